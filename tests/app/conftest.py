"""Fixtures for the command-line tests: a tiny random HF checkpoint (as a directory and loaded),
an in-process CLI runner, calibrated codebooks."""
from __future__ import annotations

import pytest

from cli_result import Result, one_error_line
from million_app.cli import main
from million_app.tiny import write_tiny_checkpoint
from models import load_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The ``tiny`` preset (2 layers, 2 KV heads, head_dim 16, byte vocabulary) as an HF dir."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory) -> str:
    """Same shapes as ``tiny_dir``, different weights (a different model fingerprint)."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_other") / "model"), seed=1)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """The ``tiny_dir`` checkpoint loaded (``models.load_model``)."""
    return load_model(tiny_dir)


@pytest.fixture
def cli(capsys):
    """cli("eval", "--model", ...) -> Result(rc, stdout, stderr), run in this process."""

    def run(*argv: str) -> Result:
        rc = main([str(a) for a in argv])
        cap = capsys.readouterr()
        return Result(rc, cap.out, cap.err)

    return run


@pytest.fixture(scope="session")
def codebooks(tiny_dir, tmp_path_factory) -> str:
    """M=8, nbits=6 per-layer-per-head codebooks of the tiny model (3 bits/elem; keys before
    RoPE, the default)."""
    path = str(tmp_path_factory.mktemp("books") / "tiny.safetensors")
    rc = main(["calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024",
               "--window", "256", "--nbits", "6", "--iters", "3", "--out", path, "--quiet"])
    assert rc == 0
    return path


@pytest.fixture(scope="session")
def post_codebooks(tiny_dir, tmp_path_factory) -> str:
    """As ``codebooks`` with keys quantized after RoPE (MILLION's choice, ``--rope post``)."""
    path = str(tmp_path_factory.mktemp("books") / "tiny_post.safetensors")
    rc = main(["calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--rope", "post",
               "--window", "256", "--nbits", "6", "--iters", "3", "--out", path, "--quiet"])
    assert rc == 0
    return path


@pytest.fixture
def error_line():
    """``cli_result.one_error_line`` as a fixture."""
    return one_error_line

"""Fixtures for the command-line tests: a tiny random HF checkpoint and an in-process CLI runner."""
from __future__ import annotations

import dataclasses

import pytest

from million_app.tiny import write_tiny_checkpoint
from million_app.cli import main


@dataclasses.dataclass
class Result:
    rc: int
    out: str
    err: str


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The ``tiny`` preset (2 layers, 2 KV heads, head_dim 16, byte vocabulary) as an HF dir."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory) -> str:
    """Same shapes as ``tiny_dir``, different weights (a different model fingerprint)."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_other") / "model"), seed=1)


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
    """M=8, nbits=6 per-layer-per-head codebooks of the tiny model (3 bits/elem)."""
    path = str(tmp_path_factory.mktemp("books") / "tiny.safetensors")
    rc = main(["calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024",
               "--window", "256", "--nbits", "6", "--iters", "3", "--out", path, "--quiet"])
    assert rc == 0
    return path


def one_error_line(res: Result) -> str:
    """Assert exit status 2 and a single ``error: ...`` line on stderr; return it."""
    assert res.rc == 2, (res.out, res.err)
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1, res.err
    assert lines[0].startswith("error: "), res.err
    assert "Traceback" not in res.err
    return lines[0]


@pytest.fixture
def error_line():
    """``one_error_line`` as a fixture (a plain ``from conftest import`` can pick up another
    directory's conftest when several test directories run together)."""
    return one_error_line

"""python -m benchmarks.gpu_e2e --tiny runs on CPU and writes well-formed rows (in-process, tiny model).

Covers what the one GPU call relies on: the real (chunked, timed) prefill and the synthetic
fill, calibration from a prefilled dense cache, the Pallas -> xla fallback (simulated), the
per-row OOM prediction, the time guard, the k-means timing and both output files; and that
the command line itself starts (``--plan`` in a subprocess, from the repository root).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

_ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"kind", "model", "context", "batch", "cache", "status", "ms_per_token", "speedup",
            "peak_bytes", "prefill_seconds", "impl", "device"}


@pytest.fixture(scope="module")
def bench() -> Any:
    # imported here, not at collection: the package's time guard counts from its import
    return importlib.import_module("benchmarks.gpu_e2e.cli")


def _rows(out: Path) -> list[dict[str, Any]]:
    (name,) = [p for p in os.listdir(out) if p.startswith("gpu_e2e_") and p.endswith(".json")]
    assert (out / name.replace(".json", ".md")).exists()
    rows = json.loads((out / name).read_text())
    assert isinstance(rows, list) and rows
    for r in rows:
        assert REQUIRED <= set(r), sorted(REQUIRED - set(r))
    return rows


def test_tiny_run_rows(bench: Any, tmp_path: Path) -> None:
    # batch 1: real prefill (+ calibration from it); batch 2: synthetic fill.
    # --fail-pallas: the PQ rows take the Pallas path, "fail", and are redone with xla.
    assert bench.main(["--tiny", "--out", str(tmp_path), "--fail-pallas"]) == 0
    rows = _rows(tmp_path)
    kinds = [r["kind"] for r in rows]
    assert kinds.count("env") == 1 and kinds.count("model") == 1 and kinds.count("kmeans") == 1

    decode = [r for r in rows if r["kind"] == "decode"]
    assert {(r["batch"], r["cache"]) for r in decode} == {(1, "bf16"), (1, "pq"), (2, "bf16"), (2, "pq")}
    for r in decode:
        assert r["status"] == "ok", r
        assert r["context"] == 64 and r["ms_per_token"] > 0 and r["peak_bytes"] > 0
        assert r["t_max"] >= r["context"] + (1 + r["repeats"]) * r["new_tokens"]
        assert r["final_length"] == r["context"] + (1 + r["repeats"]) * r["new_tokens"]
        assert r["cache_read_bytes_per_step"] > 0 and r["floor_ms"] > 0
        if r["fill"] == "prefill":
            assert r["batch"] == 1 and r["prefill_seconds"] > 0 and r["prefill_logits_finite"]
        else:
            assert r["fill"] == "synthetic" and r["prefill_seconds"] is None
        if r["cache"] == "bf16":
            assert r["impl"] == "xla" and r["speedup"] == 1.0
        else:
            assert r["impl"] == "xla" and "pallas failed" in r["impl_note"]
            assert r["speedup"] > 0 and r["M"] == 8 and r["nbits"] == 6

    (model,) = [r for r in rows if r["kind"] == "model"]
    assert model["calib_source"] == "first tokens of a prefilled context"
    assert model["codebook_bytes"] > 0 and model["calib_rel_mse_k"] < 1.0
    (km,) = [r for r in rows if r["kind"] == "kmeans"]
    assert km["status"] == "ok" and km["seconds"] > 0 and km["reconstruction_mse"] >= 0
    md = next(p for p in tmp_path.iterdir() if p.suffix == ".md").read_text()
    assert "## Where the time goes" in md and "| tiny-gqa | 2 | 64 | pq |" in md


def test_tiny_predicted_oom_and_time_guard(bench: Any, tmp_path: Path) -> None:
    # A device limit of 1 byte: every row is refused before anything is compiled or allocated.
    out = tmp_path / "oom"
    assert bench.main(["--tiny", "--out", str(out), "--skip-kmeans", "--assume-device-bytes", "1"]) == 0
    decode = [r for r in _rows(out) if r["kind"] == "decode"]
    assert len(decode) == 4
    assert all(r["status"] == "oom" and r["error"].startswith("predicted") for r in decode)
    assert all(r["ms_per_token"] is None and r["speedup"] is None for r in decode)

    # No time left: every work item is skipped, and the results are still written.
    out = tmp_path / "budget"
    assert bench.main(["--tiny", "--out", str(out), "--budget-s", "0"]) == 0
    rows = _rows(out)
    assert all(r["status"] == "skipped" for r in rows if r["kind"] in ("decode", "kmeans"))


def test_module_command_line_plan() -> None:
    # The documented entry point, run from the repository root: lists the work, runs nothing.
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_e2e", "--tiny", "--plan"], cwd=_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "tiny-gqa     B=1 T=    64 prefill" in res.stdout and "k-means 4096 x 16" in res.stdout

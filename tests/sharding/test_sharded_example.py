"""examples/sharded_generate.py (the README's sharding example) runs on 8 fake CPU devices and
generates what one device generates; with too few devices it says how to run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "sharded_generate.py"

pytestmark = pytest.mark.slow


def _run(args: list[str], tmp_path: Path, xla_flags: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_example_on_8_fake_cpu_devices_matches_one_device(tmp_path):
    # backend optimisation level 0 halves the CPU compile time; the partitioning is unaffected
    proc = _run(["--fake-cpu-devices"], tmp_path, "--xla_backend_optimization_level=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8 and res["mesh"] == [4, 2]
    assert res["tokens"] == res["ref_tokens"] and res["num_generated"] == res["ref_num_generated"]
    assert res["same_as_one_device"] and min(res["num_generated"]) >= 1
    # the codes really are split: batch over "data" (4 rows -> 1 per device), KV heads over "model"
    assert res["k_codes_spec"][:3] == [None, "data", "model"]
    L, B, H, T, M = res["k_codes_shape"]
    assert res["k_codes_shard_shape"] == [L, B // 4, H // 2, T, M]
    assert list(tmp_path.iterdir()) == []  # writes nothing where it runs


def test_example_without_8_devices_says_how_to_run_it(tmp_path):
    proc = _run([], tmp_path)
    assert proc.returncode != 0
    assert "needs 8 devices, found 1" in proc.stderr and "--fake-cpu-devices" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr

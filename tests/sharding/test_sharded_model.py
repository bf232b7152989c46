"""The model and its caches sharded over 8 fake CPU devices match one device.

The checks run in a subprocess (``sharded_checks.py``) because the fake device
count must be set before jax is imported; this file only asserts on the JSON
the script writes. Two runs (``--part dense`` and ``--part pq``, side by side under
pytest-xdist) cover dense and PQ caches on meshes (8, 1),
(2, 4), (1, 8), the PQ cache with the Pallas kernel (impl="pallas", interpret mode, per
shard under shard_map) on (2, 4) and (1, 8), plus a UniformCache on (2, 4) and GQA with 4 KV heads on an
8-way "model" axis.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "sharded_checks.py"

# (kind, mesh, n_kv_heads) of the cases each half of sharded_checks.main() runs, in order.
PARTS = {
    "dense": [("dense", (8, 1), 8), ("dense", (2, 4), 8), ("dense", (1, 8), 8),
              ("uniform", (2, 4), 8), ("dense", (1, 8), 4)],
    "pq": [("pq", (8, 1), 8), ("pq", (2, 4), 8), ("pq", (1, 8), 8),
           ("pq-pallas", (2, 4), 8), ("pq-pallas", (1, 8), 8)],
}
# Interleaved, so that the two pytest-xdist workers, handed the tests in order, start
# the two halves at the same time.
CASES = [(part, i) for i in range(5) for part in PARTS]
IDS = ["{}-{}x{}-kv{}".format(PARTS[p][i][0], *PARTS[p][i][1], PARTS[p][i][2]) for p, i in CASES]

pytestmark = pytest.mark.slow


def _run_checks(part: str, out: Path) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--part", part, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _results(root: Path, part: str) -> dict:
    """One subprocess per half per test session, even under pytest-xdist: the workers
    share the parent of their base temp dirs, and the first to take a half's lock runs it."""
    out = root / f"sharded_checks_{part}.json"
    with open(root / f"sharded_checks_{part}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.exists():
                _run_checks(part, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    res = json.loads(out.read_text())
    assert res["devices"] == 8
    got = [(c["kind"], tuple(c["mesh"]), c["n_kv_heads"]) for c in res["cases"]]
    assert got == PARTS[part]
    return res


@pytest.fixture(scope="session")
def results_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                      # this session's dir, shared by its workers
    return root


@pytest.fixture(params=CASES, ids=IDS)
def case(request, results_root) -> dict:
    part, i = request.param
    return _results(results_root, part)["cases"][i]


def test_same_generated_tokens_as_one_device(case):
    assert case["tokens_equal"], (case["tokens"], case["ref_tokens"])


def test_same_decode_logits_as_one_device(case):
    # fp32; tensor parallelism reorders the sums of the row-parallel matmuls (all-reduce).
    # In a quantized cache that reordering can flip a code at a near tie of the rounding
    # (at most 1e-3 of the codes: test_same_cache_contents_as_one_device); one flipped code
    # moves one key/value element by one quantization step, so the logits get 10x the room.
    flipped = any(d > 0 for name, d in case["cache_diff"].items() if "codes" in name)
    tol = (1e-3 if flipped else 1e-4) * max(1.0, case["logit_scale"])
    assert max(case["logit_max_abs_diff"]) <= tol, case["logit_max_abs_diff"]


def test_same_cache_contents_as_one_device(case):
    for name, diff in case["cache_diff"].items():
        if "codes" in name:
            assert diff <= 1e-3, (name, diff)        # fraction of codes flipped by a near tie
        elif "lengths" in name:
            assert diff == 0.0, name
        else:
            assert diff <= 1e-4, (name, diff)


def test_cache_keeps_its_sharding_and_is_donated(case):
    assert case["cache_sharding_errors"] == []
    assert case["donation_warnings"] == []


def test_decode_step_moves_no_cache_data(case):
    """No all-gather / all-to-all / collective-permute of a cache-shaped operand in the HLO."""
    assert case["cache_collectives"] == [], case["cache_collectives"]


def test_decode_step_moves_no_codebooks(case):
    """The codebooks are split with the KV heads and read per shard: no collective of [.., M, K, dsub]."""
    assert case.get("codebook_collectives", []) == [], case["codebook_collectives"]


def test_pallas_cases_run_the_kernel_per_shard(case):
    """impl="pallas" really runs the kernel in the decode step, under shard_map on a mesh."""
    pallas = case["kind"] == "pq-pallas"
    assert case["pallas_kernel_in_step"] == pallas
    assert case["shard_map_in_step"] == pallas

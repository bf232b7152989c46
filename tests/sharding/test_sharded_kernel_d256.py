"""The Pallas kernel per shard under ``shard_map`` at head_dim 256 on one KV head (GQA 4:1),
sharded over batch, for PQ and TurboQuant caches: the same decode step as on one device (``kernel_d256_checks.py``, run in a
subprocess under 4 fake CPU devices; this file asserts on its JSON)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~25 s of CPU: one subprocess compiling 7 decode steps

SCRIPT = Path(__file__).resolve().parent / "kernel_d256_checks.py"
ONE_KV_HEAD = ["M128-8bit", "M64-6bit-packed", "pre-M128-4bit-packed", "tq4", "tq2.5-two-parts"]
CASES = ONE_KV_HEAD + ["pre-order-hkv2"]  # two KV heads with their own RoPE pair orders
MESHES = {"M128-8bit": [[2, 2]], "M64-6bit-packed": [[2, 2]], "pre-M128-4bit-packed": [[2, 2], [4, 1]],
          "tq4": [[2, 2]], "tq2.5-two-parts": [[2, 2], [4, 1]], "pre-order-hkv2": [[2, 2]]}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("name", CASES)
def test_sharded_kernel_equals_one_device(results, name):
    res = results[name]
    assert res["single_has_kernel"]
    assert res["kernel_vs_xla"] < 3e-2, res  # the kernel's dots are bf16; the xla path is fp32
    assert [m["mesh"] for m in res["meshes"]] == MESHES[name]
    for m in res["meshes"]:
        assert m["out_vs_single"] < 1e-6, m
        assert m["codes_equal"], m


def test_per_head_pair_orders_are_split_with_their_kv_heads(results):
    """key_pair_order gives a RoPE frequency per KV head: split over "model" with the heads (the
    kernel per shard gets its own heads' frequencies; out_vs_single above checks the values)."""
    for m in results["pre-order-hkv2"]["meshes"]:
        assert (m["batch_axes"], m["kv_axes"]) == (["data"], ["model"]), m
        assert m["shard_map"] and m["pallas_call"], m
        assert m["codes_shard_shape"][1:3] == [2, 1], m


@pytest.mark.parametrize("name", ONE_KV_HEAD)
def test_one_kv_head_is_split_by_batch_and_runs_the_kernel_per_shard(results, name):
    for m in results[name]["meshes"]:
        data = m["mesh"][0]
        assert (m["batch_axes"], m["kv_axes"]) == (["data"], []), m  # one KV head: not split
        assert m["shard_map"] and m["pallas_call"], m
        assert m["codes_shard_shape"][1] == 4 // data and m["codes_shard_shape"][2] == 1, m
        assert m["out_shard_shape"][0] == 4 // data, m

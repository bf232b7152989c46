"""benchmarks/gpu_attention.py --tiny runs on CPU (interpret mode) and writes its rows."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import pytest

_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "gpu_attention.py",
)


@pytest.mark.slow
@pytest.mark.skipif(tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11),
                    reason="the GPU benchmark's smoke run goes with the GPU machine's jax (0.11): "
                           "`make test-kernels-py312` runs it (about a minute on 2 cores)")
def test_gpu_attention_tiny_smoke(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_attention_bench", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    rc = mod.main(["--tiny", "--out", str(tmp_path), "--contexts", "40", "--batches", "2",
                   "--shapes", "tiny-gqa", "--variant", "bt32:block_t=32",
                   "--copies", "2", "--try-cudnn"])
    assert rc == 0
    (json_path,) = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    assert os.path.exists(tmp_path / json_path.replace(".json", ".md"))
    rows = json.loads((tmp_path / json_path).read_text())
    checks = [r for r in rows if r["impl"].startswith("check:")]
    assert checks and all(r["ok"] for r in checks)
    assert any(":pre-rope:" in r["impl"] for r in checks)
    assert any(r["impl"].startswith("check:tiny-tq4:") for r in checks)  # TurboQuant codes + scales
    timed = {r["impl"]: r for r in rows if r["seconds"] is not None}
    assert {"pq", "pq[bt32]", "pq-pre", "pq-pre[bt32]", "bf16-xla"} <= set(timed)
    assert timed["pq-pre"]["key_rope"] == "pre" and timed["pq"]["key_rope"] == "post"
    for r in timed.values():
        assert {"context", "batch", "shape", "impl", "seconds", "gbps", "speedup", "device"} <= set(r)
        assert r["context"] == 40 and r["batch"] == 2 and r["seconds"] > 0
    assert timed["pq"]["speedup"] > 0

"""Two processes x 4 fake CPU devices (jax.distributed, gloo) generate what one device does."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import LlamaConfig, generate, init_cache, init_params

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _reference_tokens() -> list[list[int]]:
    """The same generate (same config, params, prompts as multihost_checks.py) on one device."""
    cfg = LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=8, n_kv_heads=8,
                      head_dim=8, eos_ids=())
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab, (8, 6)).astype(np.int32)
    lengths = np.array([6, 5, 4, 6, 3, 6, 2, 6], np.int32)
    params = init_params(cfg, jax.random.key(0), jnp.float32, 0.2)
    out = generate(cfg, params, init_cache(cfg, 8, 32, jnp.float32), tokens, lengths, max_new_tokens=5)
    return np.asarray(out.tokens).tolist()


def test_two_processes_match_one_device(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs, outs = [], []
    for pid in (0, 1):
        out = tmp_path / f"p{pid}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "multihost_checks.py"), "--process-id", str(pid),
             "--port", str(port), "--out", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        assert r["process_count"] == 2 and r["device_count"] == 8
        assert r["local_cache_shards"] == 4          # each process holds only its own devices' shards
    assert results[0]["tokens"] == results[1]["tokens"] == _reference_tokens()

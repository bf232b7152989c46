"""One process of a 2-process (multi-host) run on CPU: 2 x 4 fake devices, one (2, 4) mesh.

``test_multihost.py`` starts two of these with ``--process-id 0`` and ``1``;
they meet through ``jax.distributed.initialize`` (CPU collectives over gloo),
shard the same params / cache / prompts with :mod:`million_jax.sharding` and
run greedy ``generate`` once over the 8 devices of both processes. Process 0
writes the generated tokens (gathered to every host) as JSON, which the test
compares with a single-device run. This is the README's multi-host recipe::

    python tests/sharding/multihost_checks.py --process-id 0 --port 12345 --out a.json &
    python tests/sharding/multihost_checks.py --process-id 1 --port 12345 --out b.json
"""
from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("multihost_checks.py must run in a fresh interpreter (jax already imported)")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from million_jax import sharding as S  # noqa: E402
from models import LlamaConfig, generate, init_cache, init_params  # noqa: E402

CONFIG = LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=8, n_kv_heads=8,
                     head_dim=8, eos_ids=())
NEW_TOKENS = 5


def prompts() -> tuple[np.ndarray, np.ndarray]:
    """The same ragged prompts on every process: int32[8, 6] and their lengths."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, CONFIG.vocab, (8, 6)).astype(np.int32)
    lengths = np.array([6, 5, 4, 6, 3, 6, 2, 6], np.int32)
    return tokens, lengths


def run(mesh_shape: tuple[int, int]) -> dict:
    """Shard everything over the global mesh and generate; returns tokens + layout facts."""
    mesh = S.make_mesh(mesh_shape)
    rules = S.rules_for(mesh, CONFIG)
    params = S.shard_params(init_params(CONFIG, jax.random.key(0), jnp.float32, 0.2), mesh, rules)
    cache = S.shard_cache(init_cache(CONFIG, 8, 32, jnp.float32), mesh, rules)
    tokens, lengths = prompts()
    # prompt_lengths stays a host array: generate checks its values on the host, which a
    # global array spanning other processes' devices does not allow
    out = generate(CONFIG, params, cache, S.shard_batch(tokens, mesh, rules), lengths,
                   max_new_tokens=NEW_TOKENS)
    S.assert_sharded_as(out.cache, mesh, rules)
    toks = multihost_utils.process_allgather(out.tokens, tiled=True)
    return {"tokens": np.asarray(toks).tolist(), "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_cache_shards": len(out.cache.layers.k.addressable_shards)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{args.port}", num_processes=2, process_id=args.process_id,
                               initialization_timeout=120)
    res = run((2, 4))
    Path(args.out).write_text(json.dumps(res))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

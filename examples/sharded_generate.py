"""Sharded generation with a PQ cache: the tiny preset on a (4, 2) mesh, 4-way data x 2-way tensor parallel.

The README's "Several GPUs and several hosts" example as a script. It needs 8 devices; on a
machine with fewer it can run on 8 fake CPU devices::

    python examples/sharded_generate.py                      # 8 (or more) GPUs / TPUs
    python examples/sharded_generate.py --fake-cpu-devices   # anywhere: 8 fake CPU devices

It generates with params, cache, codebooks and inputs sharded by :mod:`million_jax.sharding`,
generates again on one device, and prints one JSON line: the tokens of both, whether they are
equal, and how the final cache is laid out over the devices. Exit status 1 when they differ.
"""
from __future__ import annotations

import os
import sys

if "--fake-cpu-devices" in sys.argv[1:]:  # read once, when jax starts its backends: before the import
    if "jax" in sys.modules:
        raise RuntimeError("--fake-cpu-devices must be set before jax is imported")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from million_jax import CacheSpec, fit_kv_codebooks, make_cache  # noqa: E402
from million_jax import sharding as S  # noqa: E402
from models import generate, init_params, preset  # noqa: E402

MESH = (4, 2)          # ("data", "model"): the tiny preset's 2 KV heads split 2 ways, batch 4 ways
NEW_TOKENS = 16


def build():
    """(cfg, params, cache, books, tokens int32[4, 8], lengths int32[4]) on one device."""
    cfg = preset("tiny")                                   # 4 query heads, 2 KV heads, head_dim 16
    params = init_params(cfg, jax.random.PRNGKey(0))
    kv = jax.random.normal(jax.random.PRNGKey(1), (cfg.n_layers, cfg.n_kv_heads, 1024, cfg.head_dim))  # your K/V
    books = fit_kv_codebooks(kv, kv, M=8, nbits=6, key=jax.random.PRNGKey(2), iters=2)
    cache, books = make_cache(CacheSpec("pq", codebooks=books, window=4, dtype=jnp.float32), cfg, batch=4, max_len=64)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 8), 3, cfg.vocab)
    lengths = jnp.array([8, 5, 8, 3])                      # ragged prompts, left-aligned
    return cfg, params, cache, books, tokens, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-cpu-devices", action="store_true",
                        help="run on 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    parser.parse_args(argv)
    need = MESH[0] * MESH[1]
    if jax.device_count() < need:
        raise SystemExit(f"sharded_generate.py: the {MESH[0]} x {MESH[1]} mesh needs {need} devices, found "
                         f"{jax.device_count()} ({jax.default_backend()}); add --fake-cpu-devices to run it on "
                         f"{need} fake CPU devices")

    cfg, params, cache, books, tokens, lengths = build()
    mesh = S.make_mesh(MESH)                       # ("data", "model"): 4-way data x 2-way tensor parallel
    rules = S.rules_for(mesh, cfg)                 # resolves head splits for this model's head counts
    params = S.shard_params(params, mesh, rules)
    cache = S.shard_cache(cache, mesh, rules)      # DenseCache, PQCache or UniformCache
    books = S.shard_codebooks(books, mesh, rules)  # PQCodebooks (PQ only)
    tokens, lengths = S.shard_batch((tokens, lengths), mesh, rules)
    res = generate(cfg, params, cache, tokens, lengths, cache_consts=books, max_new_tokens=NEW_TOKENS)

    cfg, params, cache, books, tokens, lengths = build()   # the same run on one device
    ref = generate(cfg, params, cache, tokens, lengths, cache_consts=books, max_new_tokens=NEW_TOKENS)
    codes = res.cache.layers.k_codes                # [L, B, Hkv, T, M]
    report = {
        "devices": jax.device_count(), "mesh": list(mesh.devices.shape),
        "tokens": np.asarray(res.tokens).tolist(), "num_generated": np.asarray(res.num_generated).tolist(),
        "ref_tokens": np.asarray(ref.tokens).tolist(), "ref_num_generated": np.asarray(ref.num_generated).tolist(),
        "k_codes_spec": [None if a is None else (a if isinstance(a, str) else list(a))
                         for a in codes.sharding.spec],
        "k_codes_shard_shape": list(codes.addressable_shards[0].data.shape), "k_codes_shape": list(codes.shape),
    }
    report["same_as_one_device"] = (report["tokens"] == report["ref_tokens"]
                                    and report["num_generated"] == report["ref_num_generated"])
    print(json.dumps(report))
    return 0 if report["same_as_one_device"] else 1


if __name__ == "__main__":
    sys.exit(main())

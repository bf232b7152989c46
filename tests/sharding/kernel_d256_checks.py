"""The Pallas kernel per shard at head_dim 256 on one KV head (Gemma 3's global layers), as a
script under 4 fake CPU devices (``test_sharded_kernel_d256.py`` runs it in a subprocess and
asserts on the JSON it prints). PQ caches, and TurboQuant caches (the same kernel with one-dim
sub-spaces and per-token norms; cases "tq...").

One KV head cannot be split, so ``rules_for`` replicates the cache over "model" and splits it
over "data" by batch only (``KernelMesh(batch_axes=("data",), kv_axes=())``). For each case a
one-layer PQCache or TurboQuantCache (B 4, 4 query heads on 1 KV head, d 256, sinks and a window) takes a ragged
prefill on one device, then one decode step runs (impl="pallas": the kernel, interpret mode)

* on one device, with impl="pallas" and with impl="xla" (the reference path), and
* with the cache, codebooks and inputs sharded on the meshes of the case,

and the script records the largest differences, the KernelMesh the cache got, whether the
traced step holds a ``shard_map`` around a ``pallas_call``, and whether the output and the
cache kept their batch sharding.

    python tests/sharding/kernel_d256_checks.py
"""
from __future__ import annotations

import os
import sys

if "jax" in sys.modules:  # the flag below is read once, when jax initialises its backends
    raise RuntimeError("kernel_d256_checks.py must run in a fresh interpreter (jax already imported)")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests" / "million_jax")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cache_layer_step import attend_layer0  # noqa: E402
from million_jax import rope  # noqa: E402
from million_jax import sharding as S  # noqa: E402
from million_jax.cache.pq_cache import PQCache  # noqa: E402
from million_jax.cache.turboquant_cache import TurboQuantCache, turboquant_consts  # noqa: E402
from million_jax.quant.kv_codebooks import PQCodebooks  # noqa: E402

B, H, HKV, D, T_MAX, SINKS, WINDOW = 4, 4, 1, 256, 40, 1, 2
# (name, M, nbits, pre-RoPE keys, meshes); TurboQuant: (name, None, bits per coordinate, False, meshes).
# "pre-order-hkv2": two KV heads, each coding the RoPE pairs in its own order (key_pair_order: a
# frequency per KV head, split with the heads on the "model" axis).
CASES = [
    ("M128-8bit", 128, 8, False, [(2, 2)]),
    ("M64-6bit-packed", 64, 6, False, [(2, 2)]),
    ("pre-M128-4bit-packed", 128, 4, True, [(2, 2), (4, 1)]),
    ("tq4", None, 4, False, [(2, 2)]),
    ("tq2.5-two-parts", None, 2.5, False, [(2, 2), (4, 1)]),
    ("pre-order-hkv2", 128, 4, True, [(2, 2)]),
]


def kv_heads(name: str) -> int:
    return 2 if name == "pre-order-hkv2" else HKV


def setup(name: str, m: int | None, nbits: float, pre: bool, seed: int) -> tuple[Any, list[tuple[np.ndarray, ...]]]:
    """The cache constants (PQ codebooks [1 layer, Hkv, M, 2**nbits, 256 / M], or for m None
    a TurboQuant rotation) and two chunks of (q, k, v, n_new): a ragged prefill, then one decode
    token per sequence."""
    rng = np.random.default_rng(seed)
    hkv = kv_heads(name)
    if m is None:
        books = turboquant_consts(1, D, seed=seed)
    else:
        shape = (1, hkv, m, 2**nbits, D // m)
        books = PQCodebooks.from_centroids(rng.standard_normal(shape).astype(np.float32),
                                           rng.standard_normal(shape).astype(np.float32), "layer_head", num_layers=1)
    if pre:
        books = books.with_pre_rope_keys(rope.rope_inv_freq(D, 1e6))
    if hkv > 1:
        books = books.with_key_pair_order(np.stack([[rng.permutation(D // 2) for _ in range(hkv)]]))
    chunks = []
    for t, n in ((30, np.array([30, 7, 19, 1], np.int32)), (1, np.ones(B, np.int32))):
        q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (H, hkv, hkv))
        chunks.append((q, k, v, n))
    return books, chunks


def decode_step(cache: Any, books: Any, chunk: tuple) -> tuple[Any, Any, str]:
    """(out, cache, traced jaxpr text) of one attend + write on layer 0."""
    args = (cache, books) + tuple(jnp.asarray(a) for a in chunk)
    traced = attend_layer0.trace(*args)
    out, cache = traced.lower().compile()(*args)
    return out, cache, str(traced.jaxpr)


def empty_cache(books: Any, nbits: float, impl: str):
    if isinstance(books, PQCodebooks):
        hkv = books.key.centroids.shape[1]
        return PQCache.for_codebooks(books, B, hkv, T_MAX, window=WINDOW, sinks=SINKS, dtype=jnp.float32, impl=impl)
    return TurboQuantCache.create(1, B, HKV, T_MAX, D, bits=nbits, window=WINDOW, sinks=SINKS, dtype=jnp.float32,
                                  impl=impl)


def run_case(name: str, m: int | None, nbits: float, pre: bool, meshes: list[tuple[int, int]], seed: int) -> dict:
    books, (prefill, step) = setup(name, m, nbits, pre, seed)
    res: dict[str, Any] = {"name": name}
    single = {}
    for impl in ("pallas", "xla"):
        cache = empty_cache(books, nbits, impl)
        _, cache = attend_layer0(cache, books, *(jnp.asarray(a) for a in prefill))
        single[impl] = (cache, decode_step(cache, books, step))
    res["kernel_vs_xla"] = float(jnp.max(jnp.abs(single["pallas"][1][0] - single["xla"][1][0])))
    res["single_has_kernel"] = "pallas_call" in single["pallas"][1][2]
    res["meshes"] = []
    cache0, (want, want_cache, _) = single["pallas"]
    for shape in meshes:
        mesh = S.make_mesh(shape)
        rules = S.rules_for(mesh, n_heads=H, n_kv_heads=kv_heads(name))
        cache = S.shard_cache(cache0, mesh, rules)
        km = cache.layers.mesh
        sbooks = S.shard_codebooks(books, mesh, rules)
        chunk = S.shard_batch(step, mesh, rules)
        out, new_cache, jaxpr = decode_step(cache, sbooks, chunk)
        codes = new_cache.layers.k_codes
        res["meshes"].append({
            "mesh": list(shape),
            "batch_axes": list(km.batch_axes), "kv_axes": list(km.kv_axes),
            "shard_map": "shard_map" in jaxpr, "pallas_call": "pallas_call" in jaxpr,
            "out_vs_single": float(jnp.max(jnp.abs(out - want))),
            "codes_equal": bool(np.array_equal(np.asarray(codes), np.asarray(want_cache.layers.k_codes))),
            "codes_shard_shape": list(codes.sharding.shard_shape(codes.shape)),
            "out_shard_shape": list(out.sharding.shard_shape(out.shape)),
        })
    return res


def main() -> int:
    assert jax.device_count() == 4, jax.devices()
    results = [run_case(*case, seed=i) for i, case in enumerate(CASES)]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

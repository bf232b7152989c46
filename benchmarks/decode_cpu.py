"""Decode-step time of SmolLM2 with the dense, PQ and uniform caches at long contexts (CPU).

Timing does not depend on the cache contents (no data-dependent control flow), so each
cache is filled directly (random codes / values, ``lengths = context``) instead of
prefilling thousands of tokens on a CPU. Each row times one jitted, donated decode step;
the cache kinds are timed interleaved in the same run and reported as ratios to dense.

Two row sets: growing context with T_max = context (+ a few steps), and a fixed context in
caches of growing capacity T_max (a step should cost the same: attention walks only the
tiles that hold tokens). Each cache dtype given is measured (float32 is what a CPU user runs;
bf16 is emulated on most CPUs).

    python benchmarks/decode_cpu.py --json benchmarks/results/decode_cpu.json
    python benchmarks/decode_cpu.py --model tiny --contexts 256 512 --fixed-context 128 \
        --t-max 256 1024 --cache-dtypes float32                       # quick
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from _results import write_results
from million_jax import DenseCache, PQCache, PQCodebooks, UniformCache
from models import decode_step, init_params, load_model, preset


def _fill(cache, context: int, rng: np.random.Generator):
    """Same cache with random contents and every sequence at ``context`` tokens."""
    def rand(a):
        if a.size == 0 or a.ndim < 2:
            return a
        if jnp.issubdtype(a.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, np.iinfo(a.dtype).max, a.shape, dtype=a.dtype))
        return jnp.asarray(rng.standard_normal(a.shape).astype(np.float32) * 0.1, a.dtype)

    return dataclasses.replace(cache, layers=jax.tree.map(rand, cache.layers),
                               lengths=jnp.full_like(cache.lengths, context))


def make_caches(cfg, dtype, batch: int, t_max: int, rng):
    L, hkv, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    M, nbits = d // 2, 8  # 4 bits/elem
    shape = (L, hkv, M, 2**nbits, d // M)
    books = PQCodebooks.from_centroids(rng.standard_normal(shape), rng.standard_normal(shape), "layer_head")
    return {
        "dense": (DenseCache.create(L, batch, hkv, t_max, d, dtype), None),
        "pq_m%d_b%d" % (M, nbits): (PQCache.for_codebooks(books, batch, hkv, t_max, window=64,
                                                          dtype=dtype, impl="xla"), books),
        "kivi4": (UniformCache.create(L, batch, hkv, t_max, d, bits=4, group_size=min(32, d), window=64,
                                      dtype=dtype), None),
    }


def measure(step, params, cfg, tok, dtype, ctx: int, t_max: int, args, rng) -> list[dict]:
    """Rows of one (dtype, context, T_max) point: every cache kind, timed interleaved."""
    caches = {k: (_fill(c, ctx, rng), cb) for k, (c, cb) in make_caches(cfg, dtype, args.batch, t_max, rng).items()}
    times = {k: [] for k in caches}
    for k, (c, cb) in caches.items():  # compile + warm-up
        _, c = step(params, c, tok, cb)
        jax.block_until_ready(c)
        caches[k] = (c, cb)
    for _ in range(args.steps):  # interleaved, so load changes hit every kind alike
        for k, (c, cb) in caches.items():
            t0 = time.perf_counter()
            logits, c = step(params, c, tok, cb)
            jax.block_until_ready((logits, c))
            times[k].append(time.perf_counter() - t0)
            caches[k] = (c, cb)
    base = float(np.median(times["dense"]))
    rows = []
    for k, (c, _) in caches.items():
        med = float(np.median(times[k]))
        rows.append({"model": args.model, "context": ctx, "t_max": t_max, "batch": args.batch, "cache": k,
                     "cache_dtype": str(dtype), "ms_per_step": med * 1e3, "ratio_to_dense": med / base,
                     "cache_bytes": c.nbytes(), "cache_bytes_ratio": c.nbytes() / caches["dense"][0].nbytes()})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a preset name (random weights)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per cache and context")
    ap.add_argument("--cache-dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="dtypes of dense K/V, rings, scales (each one measured)")
    ap.add_argument("--fixed-context", type=int, default=1024, help="context of the growing-T_max rows")
    ap.add_argument("--t-max", type=int, nargs="*", default=[2048, 8192, 32768],
                    help="cache capacities for the fixed-context rows (none: skip them)")
    ap.add_argument("--json", help="write rows to this JSON file")
    args = ap.parse_args(argv)

    if args.model == "smollm2":
        m = load_model(args.model, tokenizer=False)
        cfg, params = m.config, m.params
    else:
        cfg = preset(args.model)
        params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    step = lambda p, c, t, cb: decode_step(cfg, p, c, t, cb)  # noqa: E731 (jitted, cache donated)
    tok = jnp.zeros((args.batch,), jnp.int32)
    plan = [(ctx, ctx + args.steps + 2) for ctx in args.contexts]
    plan += [(args.fixed_context, t) for t in args.t_max if t >= args.fixed_context + args.steps + 2]
    rows = []
    for dtype_name in args.cache_dtypes:
        dtype = jnp.dtype(dtype_name)
        for ctx, t_max in plan:
            rows += measure(step, params, cfg, tok, dtype, ctx, t_max, args, rng)
    print(f"{'dtype':>8} {'context':>8} {'T_max':>7} {'cache':>12} {'ms/step':>9} {'x dense':>8} {'cache MB':>9} {'bytes x':>8}")
    for r in rows:
        print(f"{r['cache_dtype']:>8} {r['context']:8d} {r['t_max']:7d} {r['cache']:>12} {r['ms_per_step']:9.1f} {r['ratio_to_dense']:8.2f} "
              f"{r['cache_bytes'] / 2**20:9.1f} {r['cache_bytes_ratio']:8.3f}")
    if args.json:
        write_results(args.json, rows, load_avg_1min=os.getloadavg()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Why the cache protocol reads in the layer loop and writes after it: XLA copies a scan
carry that is written and then read in the same iteration.

A [30, 1, 3, T, 64] float32 "cache" (donated) is read by a scan over 30 layers; each layer
writes one token row and sums one 512-row tile. Four orders of the same work:

    write_then_read   carry: update the row, then read the tile  (the protocol before 2026-12-02)
    read_then_write   carry: read the tile, then update the row with a value that depends on
                      the read (without that dependence XLA may order the write first and copy)
    slice_layer       carry: slice the layer out, update, read, write the layer back
    deferred          the cache is only read in the loop; the rows ride out as scan outputs and
                      are written once after it (what million_jax/cache/base.py does now)

    python benchmarks/carry_copy_cpu.py            # prints ms per step for T = 2048 .. 32768
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

LAYERS, HEADS, D, TILE = 30, 3, 64, 512


def step_fn(mode: str):
    def step(k, pos):
        if mode == "deferred":
            def read(h, i):
                s = jnp.sum(jax.lax.dynamic_slice(k, (i, 0, 0, 0, 0), (1, 1, HEADS, TILE, D)))
                return h + s, jnp.ones((1, HEADS, 1, D)) * i.astype(jnp.float32)
            h, new_rows = jax.lax.scan(read, 0.0, jnp.arange(LAYERS))
            return jax.lax.dynamic_update_slice(k, new_rows, (0, 0, 0, pos, 0)), h

        def body(k, i):
            row = jnp.ones((1, 1, HEADS, 1, D))
            tile = lambda a: jax.lax.dynamic_slice(a, (i, 0, 0, 0, 0), (1, 1, HEADS, TILE, D))  # noqa: E731
            if mode == "write_then_read":
                k = jax.lax.dynamic_update_slice(k, row, (i, 0, 0, pos, 0))
                s = jnp.sum(tile(k))
            elif mode == "read_then_write":
                s = jnp.sum(tile(k))
                k = jax.lax.dynamic_update_slice(k, row * 0 + s, (i, 0, 0, pos, 0))
            else:
                layer = jax.lax.dynamic_index_in_dim(k, i, keepdims=False)
                layer = jax.lax.dynamic_update_slice(layer, row[0], (0, 0, pos, 0))
                s = jnp.sum(jax.lax.dynamic_slice_in_dim(layer, 0, TILE, axis=2))
                k = jax.lax.dynamic_update_index_in_dim(k, layer, i, 0)
            return k, s

        return jax.lax.scan(body, k, jnp.arange(LAYERS))

    return jax.jit(step, donate_argnums=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t-max", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'mode':>16} {'T_max':>7} {'ms/step':>9}")
    for mode in ("write_then_read", "read_then_write", "slice_layer", "deferred"):
        f = step_fn(mode)
        for t in args.t_max:
            k = jnp.zeros((LAYERS, 1, HEADS, t, D), jnp.float32)
            k, _ = f(k, 5)
            jax.block_until_ready(k)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                k, _ = f(k, 5)
                jax.block_until_ready(k)
            print(f"{mode:>16} {t:7d} {(time.perf_counter() - t0) / args.steps * 1e3:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Why a decode step still grows with T_max on CPU: XLA copies a scan carry that is written
and then read in the same iteration.

A [30, 1, 3, T, 64] float32 "cache" rides in a ``lax.scan`` carry over 30 layers (donated);
each layer writes one token row and sums one 512-row tile. Three orders of the same work:

    write_then_read   update the row, then read the tile        (what PQLayer.attend does)
    read_then_write   read the tile, then update the row
    slice_layer       slice the layer out, update, read, write the layer back (models/llama.py)

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
    for mode in ("write_then_read", "read_then_write", "slice_layer"):
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

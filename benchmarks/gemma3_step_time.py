"""Gemma 3 270M on CPU: decode step time with C tokens stored, dense vs PQ caches, and cache bytes.

The caches are filled by setting their lengths (the stored values do not change the work of a
step), so a 16K-token context costs no 16K-token prefill. Times are medians of --steps steps
after one compiling step, measured side by side in one run (compare as ratios).

    PYTHONPATH=. python benchmarks/gemma3_step_time.py --codebooks b4.st --contexts 1024,16384 \
        --json benchmarks/results/gemma3_270m/step_time.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from million_app import caches
from million_app.calibrate import load_model_codebooks
from million_jax.cache.spec import CacheSpec
from models import decode_step, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codebooks", required=True)
    p.add_argument("--contexts", default="1024,16384")
    p.add_argument("--bytes-at", type=int, default=32768, help="context for the cache-bytes table")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    model = load_model("gemma3-270m")
    load_s = time.perf_counter() - t0
    cfg = model.config
    books, _ = load_model_codebooks(a.codebooks, model)
    specs = {"dense bf16": CacheSpec("dense", dtype=jnp.bfloat16),
             "pq4 (all)": CacheSpec("pq", codebooks=books, quantize_all=True, dtype=jnp.bfloat16)}
    out = {"load_s": load_s, "device": jax.devices()[0].device_kind, "bytes": {}, "steps": []}
    for name, spec in specs.items():
        out["bytes"][name] = caches.memory(spec, cfg, 1, a.bytes_at)
    for ctx in [int(c) for c in a.contexts.split(",")]:
        row = {"context": ctx}
        for name, spec in specs.items():
            cache, consts = caches.build(spec, cfg, 1, ctx + a.steps + 2)
            cache = dataclasses.replace(cache, lengths=jnp.full((1,), ctx, jnp.int32))
            tok = jnp.array([818], jnp.int32)
            times = []
            for i in range(a.steps + 1):
                t = time.perf_counter()
                logits, cache = decode_step(cfg, model.params, cache, tok, consts)
                jax.block_until_ready(logits)
                if i:
                    times.append(time.perf_counter() - t)
            row[name] = statistics.median(times)
            print(f"context {ctx}: {name} {row[name] * 1e3:.1f} ms/step", flush=True)
        row["pq_over_dense"] = row["pq4 (all)"] / row["dense bf16"]
        out["steps"].append(row)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Passkey retrieval for several caches in one process, trial by trial (issue 13).

    PYTHONPATH=. python benchmarks/passkey_caches.py --out benchmarks/results/passkey_smollm2 \
        --pq4 books4.safetensors --pq2 books2.safetensors --lengths 4096,8192 --trials 3 --seed 0

`million-jax passkey` always runs a dense cache next to the chosen one, so N caches cost N
dense runs; here the model is loaded once, dense runs once and every cache sees the same
prompts. The prompts, keys and depths are exactly those of
`million-jax passkey --lengths L --trials T --seed S` (same functions of million_app.passkey,
same RNG draws). The loop is trial-major (trial 0 of every cache and length, then trial 1,
...), so a run cut short still leaves complete rows; <out>/<name>.json (the CLI's --json
layout plus seconds and bits) is rewritten after every trial.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from million_app import caches as app_caches
from million_jax import CacheSpec
from million_app.calibrate import load_model_codebooks
from million_app.loading import model_name, open_model
from million_app.passkey import passkey_prompt, run_trials
from million_app.report import write_json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True)
    p.add_argument("--pq4", required=True, help="codebook file (calibrate --bits 4)")
    p.add_argument("--pq2", required=True, help="codebook file (calibrate --bits 2)")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--only", default="", help="comma-separated cache names to run (default all)")
    p.add_argument("--first-trial", type=int, default=0,
                   help="start at this trial of the --trials/--seed plan (resume a run cut short)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = open_model(a.model)
    lengths = [int(x) for x in a.lengths.split(",")]
    books = {b: load_model_codebooks(path, model)[0] for b, path in ((4, a.pq4), (2, a.pq2))}
    paths = {4: a.pq4, 2: a.pq2}
    real = dict(sinks=a.sinks, window=a.recent)
    caches: dict[str, CacheSpec] = {"dense": CacheSpec("dense")}
    sources = {}
    for bits in (4, 2):
        caches[f"pq{bits}_all"] = CacheSpec("pq", quantize_all=True, codebooks=books[bits])
        caches[f"pq{bits}_realistic"] = CacheSpec("pq", codebooks=books[bits], **real)
        sources[f"pq{bits}_all"] = sources[f"pq{bits}_realistic"] = {"codebooks": paths[bits]}
        caches[f"kivi{bits}_all"] = CacheSpec("uniform", bits=bits, quantize_all=True)
        caches[f"kivi{bits}_realistic"] = CacheSpec("uniform", bits=bits, **real)
    if a.only:
        caches = {k: v for k, v in caches.items() if k in a.only.split(",")}

    # Same draws as million_app.passkey.passkey_eval(trials=a.trials, seed=a.seed).
    rng = np.random.default_rng(a.seed)
    plan = {}
    for length in lengths:
        keys = [int(k) for k in rng.integers(10000, 100000, size=a.trials)]
        depths = [(i + 0.5) / a.trials for i in range(a.trials)]
        plan[length] = [(passkey_prompt(model, length, k, d), k, d) for k, d in zip(keys, depths)]

    mem = {name: app_caches.memory(spec, model.config, 1, max(lengths)) for name, spec in caches.items()}
    rows = {name: {n: [] for n in lengths} for name in caches}
    for t in range(a.first_trial, a.trials):
        for length in lengths:
            for name, spec in caches.items():
                prompt, key, depth = plan[length][t]
                t0 = time.perf_counter()
                (r,) = run_trials(model, [prompt], [key], spec, 1, score=False)
                r.update(depth=depth, trial=t, seconds=round(time.perf_counter() - t0, 1))
                rows[name][length].append(r)
                print(f"trial {t} length {length} {name}: {'ok' if r['correct'] else 'FAIL'} "
                      f"{r['answer']!r} ({r['seconds']} s)", flush=True)
                write_json(os.path.join(a.out, f"{name}.json"), {
                    "lengths": lengths, "model": model_name(model), "trials": a.trials,
                    "seed": a.seed, "first_trial": a.first_trial, "cache": name, "settings": {**app_caches.settings(spec), **sources.get(name, {})},
                    **{k: mem[name][k] for k in ("bits_per_element", "storage_bits_per_element")},
                    "results": [{"length": n, "done": len(rows[name][n]),
                                 "accuracy": (sum(x["correct"] for x in rows[name][n]) / len(rows[name][n])
                                              if rows[name][n] else None),
                                 "seconds": round(sum(x["seconds"] for x in rows[name][n]), 1),
                                 "trials": rows[name][n]} for n in lengths]}, force=True)  # rewritten per trial


if __name__ == "__main__":
    main()

"""Perplexity of PQ recipes (query-aware keys, output-aware values, key/value budgets).

    PYTHONPATH=. python benchmarks/recipes.py --out benchmarks/results/recipes_smollm2 \
        --recipes pq4,pq4-qa,pq4-qa-ow,pq2,pq2-qa,pq2-qa-ow

Calibration K/V and query statistics are collected once; every recipe is fitted from the same
samples and evaluated on the same windows next to the dense cache of the same run. Writes
results.json / results.md after every recipe.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _recipe_args import add_recipe_args
from million_jax import CacheSpec
from million_app.calibrate import calibration_kvq, codebook_metadata, parse_windows, save_model_codebooks
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import evaluate
from million_app.recipes import RECIPES, fit_recipe


def main() -> None:
    p = argparse.ArgumentParser()
    add_recipe_args(p, recipes="pq4,pq4-qa")
    p.add_argument("--protocol", default="all", help="all, realistic, or all,realistic (each recipe evaluated "
                   "under both; rows named 'recipe [protocol]')")
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="k-means seed of every recipe's fit (default 0)")
    p.add_argument("--save-books", default="", help="directory to save each recipe's codebook file in")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = open_model(a.model)
    eval_ids = tokenize(model, load_text(a.text, "--text"))
    calib_ids = tokenize(model, load_text(a.calib, "--calib"))
    res = {"settings": vars(a), "rows": []}
    path = os.path.join(a.out, "results.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            res["rows"] = json.load(f)["rows"]

    def save() -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        dense = next((r["ppl"] for r in res["rows"] if r["recipe"] == "dense"), None)
        lines = ["| recipe | bits/elem (stored) | ppl | vs dense | fit s |", "|---|---|---|---|---|"]
        for r in res["rows"]:
            vs = f"{100 * (r['ppl'] / dense - 1):+.1f}%" if dense and r["recipe"] != "dense" else ""
            lines.append(f"| {r['recipe']} | {r['bits_per_element']:.2f} ({r['storage_bits_per_element']:.2f}) | "
                         f"{r['ppl']:.3f} | {vs} | {r.get('fit_seconds', 0):.0f} |")
        with open(os.path.join(a.out, "results.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    ev = dict(window=a.window, max_tokens=a.max_tokens, batch=a.batch)
    protocols = a.protocol.split(",")
    settings = {p: dict(quantize_all=p == "all", window=64, sinks=4) for p in protocols}  # all: no window / sinks
    if not a.no_dense:
        r = evaluate(model, eval_ids, CacheSpec("dense"), **ev)
        res["rows"].append({"recipe": "dense", **{k: r[k] for k in ("ppl", "bits_per_element", "storage_bits_per_element")},
                            "eval_seconds": r["seconds"]})
        save()
    calib_windows = parse_windows(a.calib_window or a.window, "--calib-window")
    names = a.recipes.split(",")
    calib = {}  # keys after / before RoPE -> (k, v, gram, count, used): one forward per kind the recipes need
    for key_rope in sorted({RECIPES[n].rope for n in names}):
        t0 = time.perf_counter()
        calib[key_rope] = calibration_kvq(model, calib_ids, tokens=a.calib_tokens, window=calib_windows,
                                          batch=a.batch, key_rope=key_rope)
        res[f"calib_seconds_{key_rope}"] = time.perf_counter() - t0
        res["calib_tokens_used"] = calib[key_rope][-1]
    for name in names:
        t0 = time.perf_counter()
        k, v, gram, count, used = calib[RECIPES[name].rope]
        books = fit_recipe(RECIPES[name], model, k, v, gram, count, seed=a.seed, iters=a.iters,
                           max_vectors=a.max_vectors)
        fit_s = time.perf_counter() - t0
        if a.save_books:
            os.makedirs(a.save_books, exist_ok=True)
            save_model_codebooks(os.path.join(a.save_books, f"{name}.safetensors"), books, codebook_metadata(
                model, books, calib_text=a.calib, calib_tokens=used,
                calib_windows=calib_windows, seed=a.seed, iters=a.iters, max_vectors=a.max_vectors, recipe=name),
                flag="--save-books", force=True)
        for protocol in protocols:
            r = evaluate(model, eval_ids, CacheSpec("pq", codebooks=books, **settings[protocol]), **ev)
            res["rows"].append({"recipe": name if len(protocols) == 1 else f"{name} [{protocol}]",
                                **{k: r[k] for k in ("ppl", "bits_per_element", "storage_bits_per_element", "cache_bytes")},
                                "fit_seconds": fit_s, "eval_seconds": r["seconds"], "label": r["cache_label"]})
            save()
            print(res["rows"][-1], flush=True)


if __name__ == "__main__":
    main()

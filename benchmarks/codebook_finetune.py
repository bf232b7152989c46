"""Codebook fine-tuning (Adam on the attention-output error) against the k-means codebooks it starts from.

    PYTHONPATH=. python benchmarks/codebook_finetune.py --out benchmarks/results/codebook_finetune_smollm2 \
        --recipes pq4,pq2 --calib-tokens 16384 --max-tokens 4096 --iters 8 --max-vectors 4096

Per base recipe (k-means, the settings of benchmarks/results/recipes_smollm2): the k-means
codebooks, then the same codebooks fine-tuned with codes fixed (``reassign 0``) and with codes
re-encoded every ``--reassign`` steps. For each: the perplexity on the held-out text
(``--text``, protocol all: every key/value from codes) next to the dense cache of the same
run, and per layer the relative attention-output error on the calibration queries and on
held-out queries (the first ``--max-tokens`` tokens of ``--text``, ``--queries`` positions per
window). Writes results.json / results.md after every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np

from _recipe_args import add_recipe_args
from million_jax import CacheSpec
from million_app.calibrate import calibration_kvq_samples
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import evaluate
from million_app.recipes import RECIPES, fit_recipe
from million_jax.calibration.finetune import FinetuneSettings, finetune_codebooks, layer_errors


def main() -> None:
    p = argparse.ArgumentParser()
    add_recipe_args(p, recipes="pq4,pq2")
    p.add_argument("--queries", type=int, default=64, help="query positions sampled per window")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--windows-per-step", type=int, default=4)
    p.add_argument("--reassign", type=int, default=20, help="re-encode period of the second variant")
    p.add_argument("--protocol", default="all")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "results.json")
    res = {"settings": vars(a), "rows": [], "load_start": os.getloadavg()}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        res["rows"] = old["rows"]
    done = {r["recipe"] for r in res["rows"]}

    def save() -> None:
        res["load_now"] = os.getloadavg()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "results.md"), "w", encoding="utf-8") as f:
            f.write(markdown(res))

    model = open_model(a.model)
    eval_ids = tokenize(model, load_text(a.text, "--text"))
    calib_ids = tokenize(model, load_text(a.calib, "--calib"))
    ev = dict(window=a.window, max_tokens=a.max_tokens, batch=a.batch)
    common = dict(quantize_all=a.protocol == "all", window=64, sinks=4)  # (quantize_all: no window, no sinks)
    if "dense" not in done:
        r = evaluate(model, eval_ids, CacheSpec("dense"), **ev)
        res["rows"].append({"recipe": "dense", "ppl": r["ppl"], "eval_seconds": r["seconds"]})
        save()
    t0 = time.perf_counter()
    k, v, gram, count, q, q_pos, used = calibration_kvq_samples(model, calib_ids, tokens=a.calib_tokens,
                                                                window=a.window, batch=a.batch,
                                                                queries_per_window=a.queries, seed=0)
    res["calib_seconds"] = time.perf_counter() - t0
    res["calib_tokens_used"] = used
    hk, hv, _, _, hq, hq_pos, hused = calibration_kvq_samples(model, eval_ids, tokens=a.max_tokens, window=a.window,
                                                              batch=a.batch, queries_per_window=a.queries, seed=1)
    res["heldout_tokens"] = hused

    def add_row(name: str, books, extra: dict) -> None:
        r = evaluate(model, eval_ids, CacheSpec("pq", codebooks=books, **common), **ev)
        row = {"recipe": name, "ppl": r["ppl"], "bits_per_element": r["bits_per_element"], "eval_seconds": r["seconds"],
               "calib_error": layer_errors(books, q, k, v, q_pos, window=a.window).sum(1).tolist(),
               "heldout_error": layer_errors(books, hq, hk, hv, hq_pos, window=a.window).sum(1).tolist(),
               **extra}
        res["rows"].append(row)
        save()
        print(name, f"ppl {row['ppl']:.3f}", {k_: v_ for k_, v_ in extra.items() if k_.endswith("_seconds") and k_ != "layer_seconds"}, flush=True)

    for name in a.recipes.split(","):
        variants = [f"{name}-ft-fixed", f"{name}-ft-reassign{a.reassign}"]
        if {name, *variants} <= done:
            continue
        t0 = time.perf_counter()
        books = fit_recipe(RECIPES[name], model, k, v, gram, count, iters=a.iters, max_vectors=a.max_vectors)
        fit_s = time.perf_counter() - t0
        if name not in done:
            add_row(name, books, {"kmeans_seconds": fit_s})
        for label, reassign in zip(variants, (0, a.reassign)):
            if label in done:
                continue
            s = FinetuneSettings(steps=a.steps, learning_rate=a.lr, windows_per_step=a.windows_per_step,
                                 reassign_every=reassign)
            t0 = time.perf_counter()
            tuned, reports = finetune_codebooks(books, q, k, v, q_pos, window=a.window, settings=s,
                                                key=jax.random.fold_in(jax.random.PRNGKey(0), 1))
            ft_s = time.perf_counter() - t0
            add_row(label, tuned, {"kmeans_seconds": fit_s, "finetune_seconds": ft_s,
                                   "finetune": dataclasses.asdict(s),
                                   "layer_seconds": [r.seconds for r in reports],
                                   "kept_heads": [int(np.sum(r.kept)) for r in reports],
                                   "tuned_calib_error": [float(r.tuned_error.sum()) for r in reports]})


def markdown(res: dict) -> str:
    rows = res["rows"]
    dense = next((r["ppl"] for r in rows if r["recipe"] == "dense"), None)
    out = ["| codebooks | ppl | vs dense | attn err calib (sum over layers) | attn err held-out | k-means s | fine-tune s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{100 * (r['ppl'] / dense - 1):+.2f}%" if dense and r["recipe"] != "dense" else ""
        ce = f"{sum(r['calib_error']):.3f}" if "calib_error" in r else ""
        he = f"{sum(r['heldout_error']):.3f}" if "heldout_error" in r else ""
        out.append(f"| {r['recipe']} | {r['ppl']:.3f} | {vs} | {ce} | {he} | {r.get('kmeans_seconds', 0):.0f} | "
                   f"{r.get('finetune_seconds', 0):.0f} |")
    base = {r["recipe"]: r for r in rows if "heldout_error" in r and "finetune" not in r}
    for r in rows:
        if "finetune" not in r:
            continue
        b = base.get(r["recipe"].split("-ft-")[0])
        if b is None:
            continue
        out += ["", f"### {r['recipe']}: per-layer relative attention-output error (sum over the 3 KV heads)", "",
                "| layer | calib k-means | calib tuned | calib gain | held-out k-means | held-out tuned | held-out gain | heads kept |",
                "|---|---|---|---|---|---|---|---|"]
        for i, (c0, c1, h0, h1, kept) in enumerate(zip(b["calib_error"], r["calib_error"], b["heldout_error"],
                                                        r["heldout_error"], r["kept_heads"])):
            out.append(f"| {i} | {c0:.4f} | {c1:.4f} | {100 * (1 - c1 / c0):+.1f}% | {h0:.4f} | {h1:.4f} | "
                       f"{100 * (1 - h1 / h0):+.1f}% | {kept} |")
        c0, c1 = sum(b["calib_error"]), sum(r["calib_error"])
        h0, h1 = sum(b["heldout_error"]), sum(r["heldout_error"])
        out.append(f"| all | {c0:.4f} | {c1:.4f} | {100 * (1 - c1 / c0):+.1f}% | {h0:.4f} | {h1:.4f} | "
                   f"{100 * (1 - h1 / h0):+.1f}% | |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()

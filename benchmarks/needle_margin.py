"""How sure the model is of the needle, per cache: the log-probability of the pass key's tokens
after a passkey prompt (teacher-forced through the real decode path), not just right / wrong.

The prompts are the ones ``million-jax niah`` builds for the same ``--lengths`` (in the same
order: keys are drawn length by length), ``--depths``, ``--trials`` and ``--seed``, so a row here
explains a cell there. Each prompt goes through ``million_app.passkey.run_trials`` once per
setting (``--chunk`` tokens per prefill forward): the greedy answer and, from the same prefill,
the key's tokens (" 12345") teacher forced (``generate(forced=...)``). Per prompt and setting:
``logp`` (sum over the key's tokens), ``first_logp`` (the first key token after the prompt),
``correct`` (the greedy answer's first number is the key). Rows written before 2026-12-06 21:30
UTC hold ``first_rank`` / ``greedy_first`` (the first key token is the argmax) instead of
``correct``; ``million-jax niah`` reports the same ``key_logp`` per trial and cell.

``--token-error N``: instead, the relative squared error |x - x_hat|^2 / |x|^2 of each global layer's
key and value through the codebooks (as the cache reads them, ``pq_loss_split.pq_reconstruct``)
for the last N prompt tokens and the needle, against the median and 90th percentile over the
prompt: are the tokens whose exactness decides the answer worse coded than the rest?

Settings (``--settings``): ``dense``; ``all`` (every global-layer key / value from codes, the
file's precise sinks exact); ``rN`` (the same, but the last N tokens exact: ``--protocol realistic
--sinks 0 --recent N``).

    PYTHONPATH=. python benchmarks/needle_margin.py --model gemma3-270m --codebooks g3pq4_s0.safetensors \
        --lengths 32768,8192,16384 --depths 0.5 --trials 3 --seed 1 --settings dense,all,r4,r16,r64 \
        --json benchmarks/results/frontier/gemma3/needle_margin.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pq_loss_split import pq_reconstruct
from million_app import caches
from million_app.calibrate import collect_model_kv, load_model_codebooks
from million_app.loading import tokenize
from million_app.niah import draw_cells, parse_depths
from million_app.passkey import key_tokens, passkey_prompt, run_trials
from million_jax.cache.spec import CacheSpec
from models import LoadedModel, load_model


def setting_spec(name: str, books: Any, precise_sinks: int) -> CacheSpec:
    """CacheSpec of one setting name: dense, all or rN (N >= 1 exact recent tokens)."""
    if name == "dense":
        return CacheSpec("dense", dtype=jnp.bfloat16)
    if name == "all":
        return CacheSpec("pq", codebooks=books, quantize_all=True, window=64, dtype=jnp.bfloat16,
                         precise_sinks=precise_sinks)
    if name.startswith("r") and name[1:].isdigit() and int(name[1:]) >= 1:
        return CacheSpec("pq", codebooks=books, quantize_all=False, window=int(name[1:]), sinks=0,
                         dtype=jnp.bfloat16, precise_sinks=precise_sinks)
    raise SystemExit(f"unknown setting {name!r}: dense, all or rN with N >= 1")


def token_errors(model: LoadedModel, books: Any, prompt: list[int]) -> tuple[np.ndarray, ...]:
    """Relative squared error of every prompt token's key and value, float[L_global, N] each
    (mean over KV heads), through ``books`` as the PQ cache encodes and reads them (the codes
    alone: a file's explicit norms are not applied), then the norm ratios |x_hat| / |x| alike."""
    n = len(prompt)
    k, v = collect_model_kv(model, prompt, window=n, batch=1, max_tokens=n)  # [Lg, Hkv, N, d] post-RoPE
    errs = []
    for i in range(k.shape[0]):
        layer_books = jax.tree.map(lambda x, i=i: x[i], books)
        kk, vv = (jnp.asarray(x[i]).transpose(1, 0, 2)[None] for x in (k, v))  # [1, N, Hkv, d]
        kh, vh = pq_reconstruct(layer_books, kk, vv, jnp.arange(n)[None])
        errs.append([np.asarray((((xh - x) ** 2).sum(-1) / (x ** 2).sum(-1))[0].mean(-1))
                     for x, xh in ((kk, kh), (vv, vh))]
                    + [np.asarray((jnp.linalg.norm(xh, axis=-1) / jnp.linalg.norm(x, axis=-1))[0].mean(-1))
                       for x, xh in ((kk, kh), (vv, vh))])
    return tuple(np.stack([e[j] for e in errs]) for j in range(4))


def report_token_errors(model: LoadedModel, books: Any, prompt: list[int], key: int, last: int) -> dict[str, Any]:
    """The errors of the last ``last`` tokens and the needle's tokens beside the prompt's median / p90."""
    ek, ev, rk, rv = token_errors(model, books, prompt)
    needle = tokenize(model, f"The pass key is {key}.")
    at = next(j for j in range(len(prompt)) if prompt[j: j + len(needle)] == needle)
    pick = {"last": range(len(prompt) - last, len(prompt)), "needle": range(at, at + len(needle))}
    out: dict[str, Any] = {"median": {"key": np.median(ek, 1).round(4).tolist(), "value": np.median(ev, 1).round(4).tolist()},
                           "p90": {"key": np.percentile(ek, 90, 1).round(4).tolist(),
                                   "value": np.percentile(ev, 90, 1).round(4).tolist()},
                           "mean_norm_ratio": {"key": rk.mean(1).round(4).tolist(), "value": rv.mean(1).round(4).tolist()}}
    for name, rng in pick.items():
        out[name] = [{"pos": t, "token": model.decode([prompt[t]]), "key": ek[:, t].round(4).tolist(),
                      "value": ev[:, t].round(4).tolist(), "key_norm_ratio": rk[:, t].round(4).tolist(),
                      "key_percentile": [round(float((ek[layer] < ek[layer, t]).mean() * 100), 1)
                                         for layer in range(ek.shape[0])]} for t in rng]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--codebooks", required=True)
    p.add_argument("--lengths", default="32768")
    p.add_argument("--depths", default="0.5")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settings", default="dense,all,r1,r4,r16,r64")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward (0: one forward)")
    p.add_argument("--token-error", type=int, metavar="N",
                   help="report the key / value error of the last N prompt tokens and the needle instead")
    p.add_argument("--json")
    a = p.parse_args()
    model = load_model(a.model)
    books, meta = load_model_codebooks(a.codebooks, model)
    precise = int(meta.get("precise_sinks", 0))
    if a.token_error:
        length = int(a.lengths.split(",")[0])
        depth, key = draw_cells(np.random.default_rng(a.seed), parse_depths(a.depths), a.trials)[0]
        r = {"length": length, "depth": depth, "key": key, "codebooks": a.codebooks,
             **report_token_errors(model, books, passkey_prompt(model, length, key, depth), key, a.token_error)}
        print(json.dumps(r, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return
    settings = a.settings.split(",")
    specs = {s: setting_spec(s, books, precise) for s in settings}
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = parse_depths(a.depths)
    rng = np.random.default_rng(a.seed)  # the key draws of `million-jax niah` for the same flags
    rows = []
    for length in lengths:
        for depth, key in draw_cells(rng, depths, a.trials):
            prompt = passkey_prompt(model, length, key, depth)
            for s in settings:
                t0 = time.perf_counter()
                trial, = run_trials(model, [prompt], [key], specs[s], 1, a.chunk or None)
                row = {"length": length, "depth": depth, "setting": s, "cache": caches.label(specs[s]),
                       "answer_tokens": key_tokens(model, key), **trial,
                       "logp": trial["key_logp"], "first_logp": trial["key_token_logp"][0],
                       "wall_s": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("length", "depth", "key", "setting", "logp", "first_logp",
                                                      "correct", "wall_s")}), flush=True)
        write(a, precise, rows, lengths, settings)  # after each length: a long run keeps what it measured


def write(a: argparse.Namespace, precise: int, rows: list[dict[str, Any]], lengths: list[int],
          settings: list[str]) -> None:
    """Print the summary (mean log p of the key, first tokens right) and write ``--json``."""
    summary: dict[str, Any] = {}
    for length in lengths:
        for s in settings:
            sel = [r for r in rows if r["length"] == length and r["setting"] == s]
            if sel:
                summary[f"{length} {s}"] = {"mean_logp": round(float(np.mean([r["logp"] for r in sel])), 3),
                                            "correct": sum(r["correct"] for r in sel), "prompts": len(sel)}
    print(json.dumps(summary, indent=1), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "codebooks": a.codebooks, "precise_sinks": precise, "seed": a.seed,
                       "trials": a.trials, "chunk": a.chunk, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()

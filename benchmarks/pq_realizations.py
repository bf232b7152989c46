"""How far apart are two numerically equivalent PQ caches? The quantization's own noise floor.

The PQ cache (``--protocol all``: every token from codes) and ``pq_loss_split``'s reconstruction
(a float32 dense cache storing decode(encode(x)) with the same codebooks, transforms, pair order
and norm scales) compute the same function: one layer's outputs on the same inputs agree to float
rounding (printed: ``layer_max_abs_diff``). With a norm-explicit file it also prints what rounding the
norm scales to bfloat16 / float16 does to four layers' outputs (``scale_rounding_by_layer``). Pre-RoPE keys are turned by exact fixed-point angles
in the cache and by float32 angles in the reconstruction, so the two differ by ~1e-5 per layer;
post-RoPE they are bit-identical. Through the model, a difference that small moves a later
layer's key or value across a k-means cell boundary now and then (its code flips, moving that
vector by a cell's width), and those flips cascade: this script measures how much that changes
the perplexity and each position's log-likelihood. Two runs of the same codebooks that differ
only in float rounding are two draws of the quantization noise; a difference between recipes
smaller than theirs is not a result.

    PYTHONPATH=. python benchmarks/pq_realizations.py --codebooks /tmp/kv/po/books_s0/pq4-pre-nu-po.safetensors \\
        --max-tokens 4096 --json benchmarks/results/frontier/key_bits/realizations/po_s0.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pq_loss_split import make, pq_reconstruct, window_nlls
from million_app import caches
from million_app.calibrate import collect_model_kv, load_model_codebooks
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import eval_windows
from million_jax.cache.pq_cache import norm_scale
from million_jax.cache.spec import CacheSpec
from million_jax.quant.kv_codebooks import unit_vectors


def layer_inputs(k: np.ndarray, v: np.ndarray, layer: int, n_heads: int, rng: np.random.Generator):
    """One layer's keys and values float32[1, N, Hkv, d] from ``collect_model_kv``'s [L, Hkv, N, d],
    and queries float64[1, N, H, d]: the keys plus noise, for peaked scores."""
    kk, vv = (jnp.asarray(x[layer]).transpose(1, 0, 2)[None].astype(jnp.float32) for x in (k, v))
    q = np.repeat(np.asarray(kk, np.float64), n_heads // kk.shape[2], axis=2)
    return kk, vv, q + 0.5 * rng.normal(size=q.shape)


def layer_diff(model, books, k: np.ndarray, v: np.ndarray, layer: int, seed: int = 0) -> float:
    """max |out_cache - out_reconstruction| of one layer's attention on the model's own keys and
    values k, v float[L, Hkv, N, d] of one window, from an empty cache."""
    window = k.shape[2]
    lb = jax.tree.map(lambda x: x[layer], books)
    kk, vv, q = layer_inputs(k, v, layer, model.config.n_heads, np.random.default_rng(seed))
    q = jnp.asarray(q, jnp.float32)
    z, n = jnp.zeros((1,), jnp.int32), jnp.full((1,), window, jnp.int32)
    cache, _ = caches.build(CacheSpec("pq", codebooks=books, quantize_all=True, dtype=jnp.float32),
                            model.config, 1, window)
    out_c, _ = jax.tree.map(lambda x: x[0], cache.layers).attend(lb, q, kk, vv, z, n)
    rc = make(model.config, books, 1, window, norm_k=books.key_norms, norm_v=books.value_norms,
              unit=books.unit_codes)
    out_r, _ = jax.tree.map(lambda x: x[0], rc.layers).attend(lb, q, kk, vv, z, n)
    return float(jnp.abs(out_c - out_r).max())


def scale_rounding(model, books, k: np.ndarray, v: np.ndarray, layers: list[int], seed: int = 0) -> dict[str, dict]:
    """Per layer: how far the attention output (float64, causal, queries = keys + noise) moves when
    the norm scales |x| / |x_hat| (``pq_cache.norm_scale``) are stored in bfloat16 or float16
    instead of float32, relative L2, beside the PQ error itself (float32 scales vs the exact keys
    and values). k, v float[L, Hkv, N, d] of one window; norm-explicit files only."""
    window = k.shape[2]
    h, rng, out = model.config.n_heads, np.random.default_rng(seed), {}
    causal = np.tril(np.ones((window, window), bool))

    def attention(q, kk, vv):  # [1, N, H or Hkv, d] float64
        kk, vv = (np.repeat(np.asarray(x, np.float64), h // x.shape[2], axis=2) for x in (kk, vv))
        s = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(kk.shape[-1])
        p = np.exp(np.where(causal, s, -np.inf) - np.where(causal, s, -np.inf).max(-1, keepdims=True))
        return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vv)

    for layer in layers:
        lb = jax.tree.map(lambda x: x[layer], books)
        kk, vv, q = layer_inputs(k, v, layer, h, rng)
        unit = books.unit_codes
        kh, vh = pq_reconstruct(lb, unit_vectors(kk) if unit else kk, unit_vectors(vv) if unit else vv,
                                jnp.arange(window)[None])

        def scaled(dtype):
            return attention(q, *(xh * norm_scale(x, xh, dtype).astype(jnp.float32) for x, xh in ((kk, kh), (vv, vh))))

        ref = scaled(jnp.float32)
        rel = lambda a, b: round(float(np.linalg.norm(a - b) / np.linalg.norm(b)), 5)  # noqa: E731
        out[str(layer)] = {"bfloat16": rel(scaled(jnp.bfloat16), ref), "float16": rel(scaled(jnp.float16), ref),
                           "pq_vs_exact": rel(ref, attention(q, kk, vv))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--codebooks", required=True)
    p.add_argument("--text", default="builtin:eval")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layer", type=int, default=15, help="the layer of the one-layer check")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model(a.model)
    books, meta = load_model_codebooks(a.codebooks, model)
    if int(meta.get("precise_sinks", 0)):
        raise SystemExit("files with precise sinks: the reconstruction would need them too (not built)")
    ids = tokenize(model, load_text(a.text, "--text"))
    w = eval_windows(ids, a.window, a.max_tokens)
    t0 = time.perf_counter()
    builds = {"cache": lambda b, t: caches.build(CacheSpec("pq", codebooks=books, quantize_all=True, dtype=jnp.bfloat16),
                                                 model.config, b, t),
              "reconstruction": lambda b, t: (make(model.config, books, b, t, norm_k=books.key_norms,
                                                   norm_v=books.value_norms, unit=books.unit_codes), books)}
    nll = {name: window_nlls(model, w, a.batch, build) for name, build in builds.items()}  # [W, window - 1] each
    # the model's own keys and values of the first window, for the one-layer checks: [L, Hkv, N, d]
    k, v = collect_model_kv(model, ids[:a.window], window=a.window, batch=1, max_tokens=a.window)
    d = np.abs(nll["cache"] - nll["reconstruction"])
    step = a.window // 8
    out = {"command": "PYTHONPATH=. python benchmarks/pq_realizations.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "codebooks": a.codebooks, "recipe": books.recipe, "tokens": int(d.size),
        "layer": a.layer, "layer_max_abs_diff": layer_diff(model, books, k, v, a.layer),
        "scale_rounding_by_layer": (scale_rounding(model, books, k, v, [0, 5, 15, model.config.n_layers - 1])
                                    if books.key_norms and books.value_norms else None),
        "ppl": {k: float(np.exp(v.mean())) for k, v in nll.items()},
        "mean_abs_dnll": float(d.mean()),
        "mean_abs_dnll_by_position": {f"{i}-{i + step - 1}": round(float(d[:, i:i + step].mean()), 5)
                                      for i in range(0, a.window - 1, step)},
        "positions_dnll_over_0.1": round(float((d > 0.1).mean()), 4),
        "wall_s": round(time.perf_counter() - t0, 1)}
    out["ppl_rel_diff_pct"] = round(100 * (out["ppl"]["cache"] / out["ppl"]["reconstruction"] - 1), 3)
    print(json.dumps(out, indent=1))
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Issue 34 item 3, measurement: where is the PQ loss? Keys only / values only from codes.

    PYTHONPATH=. python benchmarks/pq_loss_split.py --codebooks /tmp/fr/pq4_s0.safetensors \\
        --json benchmarks/results/frontier/loss_split_pq4_s0.json

Every key and value of every layer goes through the PQ codebooks of a ``million-jax calibrate``
file, exactly as a ``PQCache`` with every token from codes (``--protocol all``) reads them, but
only for the part under test:

* ``keys+values``: both reconstructed (the check: must give the ``pq`` cache's own ppl),
* ``keys``: keys reconstructed, values exact,
* ``values``: values reconstructed, keys exact,
* ``keys+values, S exact sinks`` (``--sinks``): both reconstructed except the first S rows of
  each window (exact), as ``eval --protocol realistic --sinks S --recent 0`` reads them;
  ``--sink-int8`` adds a row with those S rows rounded to 8-bit per-token integers (a bf16
  scale and zero per row, as ``--cache uniform --uniform-mode token`` stores them) instead,
* ``--norm-explicit``: norm-explicit PQ with today's codebooks, i.e. each reconstruction rescaled
  to the vector's own norm by a 16-bit scale stored beside the codes (``x_hat * |x| / |x_hat|``; RoPE keeps
  norms, so pre-RoPE keys are rescaled alike): rows with keys and values rescaled and with keys
  only (and, with ``--sinks``, both rescaled plus the S exact first rows). The norms cost 16 bits
  per vector (+16 / d b/elem for each of keys and values).

How: a dense float32 cache whose new rows are replaced, before they are stored and read, by
their PQ reconstruction: decode(encode(x)), with the codebooks' transforms (query-aware keys:
A^-1 decode(encode(A k)); output-aware values likewise), residual stages summed, and pre-RoPE
keys rotated back to position 0, encoded in RoPE-pair layout and turned again to their own
position. Attention from codes computes q . k_hat and sum p v_hat of exactly these
reconstructions (LUT scores are dot products with the decoded centroids), so attention over the
stored reconstructions equals the code attention up to float rounding; the ``keys+values`` row
is the check against ``million-jax eval --cache pq --protocol all`` on the same windows.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from million_app.calibrate import load_model_codebooks
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import eval_windows, window_nll
from million_jax import rope
from million_jax.cache.base import register_cache
from million_jax.cache.dense import DenseCache, DenseLayer
from million_jax.cache.pq_cache import norm_scale
from million_jax.quant.kv_codebooks import PQCodebooks, unit_vectors
from million_jax.quant.kv_transforms import apply_head_transform
from million_jax.quant.pq import Codebooks
from million_jax.quant.residual_pq import decode_stages, encode_stages
from million_jax.quant.uniform import dequantize_token_groups, quantize_token_groups


def pq_reconstruct(books: PQCodebooks, k: jax.Array, v: jax.Array, pos: jax.Array):
    """(k_hat, v_hat) float32[B, T, Hkv, d]: one layer's new keys (post-RoPE) and values through
    its codebooks (``books`` sliced to one layer), as the PQ cache encodes and reads them."""
    st = books.stages

    def through(cb: Codebooks, x: jax.Array) -> jax.Array:  # [B, T, Hkv, d] -> same
        codes = encode_stages(Codebooks(cb.centroids), jnp.swapaxes(x.astype(jnp.float32), 1, 2), st)
        return jnp.swapaxes(decode_stages(Codebooks(cb.centroids), codes, st), 1, 2)

    if books.rope_inv_freq is not None:
        cos, sin = rope.rope_cos_sin(pos, jnp.asarray(books.rope_inv_freq, jnp.float32))  # [B, T, d/2]
        c, s = cos[:, :, None], sin[:, :, None]
        pairs = books.key_rope_pairs
        k_pair = rope.to_pair_layout(rope.unrotate(k.astype(jnp.float32), c, s), pairs)
        order = books.key_pair_order  # [G, d/2] or None: each head's pairs in its sub-spaces' order
        if order is not None:
            k_pair = rope.order_pairs(k_pair, order)
        k_hat_pair = through(books.key, k_pair)
        if order is not None:
            k_hat_pair = rope.order_pairs(k_hat_pair, jnp.argsort(order, axis=-1))
        k_hat = rope.rotate(rope.from_pair_layout(k_hat_pair, pairs), c, s)
    elif books.key_transform is not None:  # q . k = (A^-T q) . (A k): k_hat = A^-1 decode(encode(A k))
        k_hat = apply_head_transform(through(books.key, apply_head_transform(k, books.key_transform)),
                                     jnp.swapaxes(books.query_transform, -1, -2))
    else:
        k_hat = through(books.key, k)
    if books.value_transform is not None:
        v_hat = apply_head_transform(through(books.value, apply_head_transform(v, books.value_transform)),
                                     books.output_transform)
    else:
        v_hat = through(books.value, v)
    return k_hat, v_hat


def int8_rows(x: jax.Array) -> jax.Array:
    """x float[..., d] through 8-bit per-row integer codes with a bf16 scale and zero (one group of d
    per row: the library's ``quantize_token_groups``), dequantized -> float32."""
    d = x.shape[-1]
    return dequantize_token_groups(*quantize_token_groups(x.astype(jnp.float32), 8, d, jnp.bfloat16))


def with_norm_of(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """x_hat float[..., d] times the scale the PQ cache stores beside its codes
    (``pq_cache.norm_scale``: |x| / |x_hat|, rounded as the cache rounds it): norm-explicit PQ."""
    return x_hat * norm_scale(x, x_hat).astype(jnp.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"],
                   meta_fields=["quant_k", "quant_v", "sinks", "sink_int8", "norm_k", "norm_v", "unit"])
@dataclasses.dataclass(frozen=True)
class ReconstructedLayer(DenseLayer):
    """A dense layer that stores (and reads) the PQ reconstruction of the chosen parts."""

    quant_k: bool = True
    quant_v: bool = True
    sinks: int = 0
    sink_int8: bool = False
    norm_k: bool = False
    norm_v: bool = False
    unit: bool = False  # encode x / |x| (codebooks of unit vectors; with norm_k / norm_v)

    def attend(self, consts, q, k, v, lengths, n_new):
        if not (self.quant_k or self.quant_v):  # the exact row (no codebooks needed)
            return super().attend(None, q, k, v, lengths, n_new)
        t = q.shape[1]
        pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        k_hat, v_hat = pq_reconstruct(consts, unit_vectors(k) if self.unit else k,
                                      unit_vectors(v) if self.unit else v, pos)
        k_hat = with_norm_of(k, k_hat) if self.norm_k else k_hat
        v_hat = with_norm_of(v, v_hat) if self.norm_v else v_hat
        sink = (pos < self.sinks)[:, :, None, None]
        bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731 - as the cache's sinks
        k_s, v_s = (int8_rows(k), int8_rows(v)) if self.sink_int8 else (bf16(k), bf16(v))
        k = jnp.where(sink, k_s, k_hat) if self.quant_k else k
        v = jnp.where(sink, v_s, v_hat) if self.quant_v else v
        return super().attend(None, q, k, v, lengths, n_new)


@register_cache
@dataclasses.dataclass(frozen=True)
class ReconstructedCache(DenseCache):
    """The dense cache of :class:`ReconstructedLayer`s; cache_consts: the PQCodebooks."""

    layers: ReconstructedLayer
    lengths: jax.Array

    def layer_consts(self, cache_consts=None):
        return cache_consts


def make(cfg, books: PQCodebooks, batch: int, max_len: int, **kw) -> ReconstructedCache:
    dense = DenseCache.create(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim, jnp.float32)
    return ReconstructedCache(layers=ReconstructedLayer(k=dense.layers.k, v=dense.layers.v, **kw),
                              lengths=dense.lengths)


def window_nlls(model, windows: np.ndarray, batch: int, build) -> np.ndarray:
    """-log p of every target token float64[W, T-1] of ``windows`` int[W, T], each window from an
    empty cache ``build(batch, T) -> (cache, cache_consts)``, ``batch`` windows per forward (the
    last batch padded with copies of its last window)."""
    rows = []
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        real = len(chunk)
        if real < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
        cache, consts = build(batch, windows.shape[1])
        rows.append(np.asarray(window_nll(model.config, model.params, cache, jnp.asarray(chunk), consts),
                               np.float64)[:real])
    return np.concatenate(rows)


def reconstructed_ppl(model, books: PQCodebooks, windows: np.ndarray, batch: int = 4, **kw) -> float:
    """Perplexity of ``windows`` int[W, T] (each from an empty cache) with the parts ``kw`` of
    :class:`ReconstructedLayer` read as their reconstruction through ``books``."""
    nll = window_nlls(model, windows, batch, lambda b, t: (make(model.config, books, b, t, **kw), books))
    return float(np.exp(nll.sum() / nll.size))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codebooks", required=True)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--parts", default="keys+values,keys,values",
                   help="comma list of keys+values, keys, values")
    p.add_argument("--sinks", type=int, default=0, help="also the keys+values row with S exact first rows")
    p.add_argument("--sink-int8", action="store_true", help="and with those S rows in 8-bit per-token integers")
    p.add_argument("--norm-explicit", action="store_true",
                   help="also rows with the reconstructions rescaled to each vector's bf16 norm")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model("smollm2")
    books, meta = load_model_codebooks(a.codebooks, model)
    ids = tokenize(model, load_text("builtin:eval", "--text"))
    w = eval_windows(ids, a.window, a.max_tokens)
    rows = []
    # norm-explicit codebooks (calibrate --norms on / unit) are read as the cache reads them: every row
    # rescales to the stored norm (and encodes unit vectors) on the sides the file says
    own = dict(norm_k=books.key_norms, norm_v=books.value_norms, unit=books.unit_codes)
    variants = [(part, dict(own, quant_k="keys" in part, quant_v="values" in part)) for part in a.parts.split(",")
                if part]
    if a.sinks:
        variants.append((f"keys+values, {a.sinks} exact sinks", dict(own, sinks=a.sinks)))
        if a.sink_int8:
            variants.append((f"keys+values, {a.sinks} int8 sinks", dict(own, sinks=a.sinks, sink_int8=True)))
    if a.norm_explicit:
        variants.append(("keys+values, exact bf16 norms", dict(norm_k=True, norm_v=True)))
        variants.append(("keys+values, exact bf16 key norms", dict(norm_k=True)))
        if a.sinks:
            variants.append((f"keys+values, {a.sinks} exact sinks, exact bf16 norms",
                             dict(sinks=a.sinks, norm_k=True, norm_v=True)))
    out = {"command": "PYTHONPATH=. python benchmarks/pq_loss_split.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in vars(a).items() if v not in (None, False)), "codebooks": a.codebooks,
        "recipe": books.recipe, "windows": int(len(w)), "rows": rows}
    for name, kw in variants:
        t0 = time.perf_counter()
        row = {"reconstructed": name, "ppl": reconstructed_ppl(model, books, w, a.batch, **kw),
               "tokens": int(w.shape[0] * (w.shape[1] - 1)), "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(row, flush=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Attention over uniform (KIVI-style / per-token) integer codes, pure jnp.

Two parts, merged by the caller with log-sum-exp:

* :func:`uniform_attention_xla`: tokens of complete key groups (and, in token mode, every
  token), dequantized one tile at a time inside the shared tile loop
  (:mod:`million_jax.attention.tiling`);
* :func:`current_group_attention`: each query over its own, still growing, key group with
  the group's prefix statistics (causal within a group; see
  :mod:`million_jax.cache.uniform_cache`).

The quantization math is :mod:`million_jax.quant.uniform`; the softmax is
:mod:`pallas_kernels.softmax`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from million_jax.attention.tiling import tiled_attention
from million_jax.quant.uniform import decode, encode, expand_stats, unpack
from pallas_kernels.softmax import group_heads, softmax_attention

__all__ = ["uniform_attention_xla", "current_group_attention", "take_rows", "CURRENT_CHUNK"]

# Queries per lax.map step of the current-group attention (bounds its memory
# to CURRENT_CHUNK * B * Hkv * G * d floats during a long prefill).
CURRENT_CHUNK = 64


def uniform_attention_xla(
    q: jax.Array,
    k_codes: jax.Array,
    k_scale: jax.Array,
    k_zero: jax.Array,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    bits: int,
    key_rows: int,
    tile: int = 512,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over tokens stored as uniform codes, one tile at a time.

    q:                 float[B, T, H, d]        (GQA: head h reads KV head h // (H/Hkv))
    k_codes, v_codes:  uint8[B, Hkv, N, d*bits/8]
    k_scale, k_zero:   float[B, Hkv, ceil(N/key_rows), d/kc]  key_rows tokens x kc channels
                       share a stat (kivi: key_rows=G, kc=1; token: 1, d)
    v_scale, v_zero:   float[B, Hkv, N, d/vc]   per token, vc channels share a stat
    lo, hi:            int32[B, T]              query t sees tokens lo <= s < hi
    Returns (out float32[B, T, H, d], lse float32[B, T, H]); 0 / -inf for a query
    that sees no token. Only one tile of ``tile`` tokens is dequantized at a time.
    """
    b, t, h, d = q.shape
    hkv = k_codes.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    kc, vc = d // k_scale.shape[-1], d // v_scale.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tile = -(-max(1, min(tile, k_codes.shape[2])) // key_rows) * key_rows
    qg = group_heads(q.astype(jnp.float32), hkv)  # [B, Hkv, G, T, d]

    def tile_fn(parts, rows, start):
        kct, kst, kzt, vct, vst, vzt = parts
        kx = lambda st: expand_stats(st, key_rows, kc, rows, d)  # noqa: E731
        vx = lambda st: expand_stats(st, 1, vc, rows, d)  # noqa: E731
        kd = decode(unpack(kct, bits), kx(kst), kx(kzt))  # [B, Hkv, tile, d] f32, this tile only
        vd = decode(unpack(vct, bits), vx(vst), vx(vzt))
        return jnp.einsum("bkgtd,bksd->bkgts", qg, kd) * scale, vd

    arrays = [(k_codes, 1), (k_scale, key_rows), (k_zero, key_rows), (v_codes, 1), (v_scale, 1), (v_zero, 1)]
    return tiled_attention((b, hkv, h // hkv, t), d, tile, lo, hi, arrays, tile_fn)


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, Hkv, N, d], idx int[B, R] -> x[b, :, idx[b]] as [B, Hkv, R, d] (idx clipped)."""
    idx = jnp.clip(idx, 0, x.shape[2] - 1)
    return jnp.take_along_axis(x, idx[:, None, :, None], axis=2, mode="promise_in_bounds")


def current_group_attention(q, xw, ps, pz, vw, offs, base, lo, hi, *, bits, group, scale):
    """Attention of each query over its own key group with the group's prefix statistics.

    q:       float[B, T, H, d]
    xw:      float32[B, Hkv, NW, d]  exact keys, window layout: row r is position base + r
    ps, pz:  dtype[B, Hkv, NW, d]    scale / zero of the group of row r over its rows <= r
    vw:      float32[B, Hkv, NW, d]  dequantized values of the same rows
    offs:    int32[B, T]             window row of each query (its position - base)
    base:    int32[B]                position of window row 0 (a multiple of G)
    lo, hi:  int32[B, T]             code region; this part covers max(lo, group start) <= s < hi
    Returns (out float32[B, T, H, d], lse float32[B, T, H]).
    """
    b, t, h, d = q.shape
    hkv = xw.shape[1]
    grp = h // hkv
    steps = jnp.arange(group, dtype=jnp.int32)

    def one(x):
        qt, o, lo_t, hi_t = x  # [B, H, d], [B], [B], [B]
        start = (o // group) * group
        idx = start[:, None] + steps[None, :]  # [B, G]
        sc = take_rows(ps, o[:, None])  # [B, Hkv, 1, d]
        ze = take_rows(pz, o[:, None])
        kd = decode(encode(take_rows(xw, idx), sc, ze, bits), sc, ze)  # [B, Hkv, G, d]
        vd = take_rows(vw, idx)
        spos = base[:, None] + idx
        vis = (spos >= jnp.maximum(lo_t, base + start)[:, None]) & (spos < hi_t[:, None])  # [B, G]
        scores = jnp.einsum("bkgd,bksd->bkgs", qt.astype(jnp.float32).reshape(b, hkv, grp, d), kd) * scale
        out, lse = softmax_attention(scores[:, :, :, None], vis[:, None, None, None, :], vd)
        return out.reshape(b, h, d), lse.reshape(b, h)

    xs = (jnp.swapaxes(q, 0, 1), offs.T, lo.T, hi.T)
    if t <= CURRENT_CHUNK:
        out, lse = jax.vmap(one)(xs)
    else:
        out, lse = jax.lax.map(one, xs, batch_size=CURRENT_CHUNK)
    return jnp.swapaxes(out, 0, 1), jnp.swapaxes(lse, 0, 1)

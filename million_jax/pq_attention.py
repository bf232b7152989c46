"""Attention over PQ codes in pure jnp (the "xla" implementation, and the kernel's fallback).

For query head h (KV head h // G) and a key stored as codes c_t[m]:

    LUT[m, j] = q_m . Ck_m[j]                 one [M, K] table per query
    score_t   = scale * sum_m LUT[m, c_t[m]]  M lookups, no dequantization
    out       = sum_t p_t * concat_m Cv_m[cv_t[m]]

The context is walked in tiles (:mod:`million_jax.tiling`), so dequantized K/V are never
materialised for the whole context. With many queries per call (prefill) the key side of a
tile is gathered and multiplied instead of read from a LUT: the same numbers, computed the
way a matmul unit likes. The LUT / gather math is :mod:`pallas_kernels.pq_math`.

Shapes (one layer):
    q:            float[B, T, H, d]
    k_codes:      uint8|uint16[B, Hkv, N, M]   (v_codes alike)
    k_centroids:  float[G, M, K, dsub], G in {1, Hkv}   (v_centroids alike)
    lo, hi:       int32[B, T]   query t of sequence b sees tokens lo <= s < hi
Returns (out float32[B, T, H, d], lse float32[B, T, H]); 0 / -inf when a query sees no token.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from million_jax.tiling import tiled_attention
from pallas_kernels.pq_math import build_lut, gather_centroids, lut_scores
from pallas_kernels.softmax import einsum_f32, group_heads

__all__ = ["pq_attention", "LUT_MAX_QUERIES"]

# With at most this many queries per call the key scores come from the LUT;
# above it a tile of keys is decoded and multiplied (prefill).
LUT_MAX_QUERIES = 8


def pq_attention(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_centroids: jax.Array,
    v_centroids: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    scale: float | None = None,
    tile: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over tokens stored as PQ codes (see module docstring)."""
    b, t, h, d = q.shape
    hkv, n, m = k_codes.shape[1:]
    g, m_cb, kc, dsub = k_centroids.shape
    if m_cb != m or m * dsub != d:
        raise ValueError(f"codebook [G={g}, M={m_cb}, K={kc}, dsub={dsub}] does not fit codes M={m}, d={d}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = group_heads(q.astype(jnp.float32), hkv)  # [B, Hkv, G, T, d]
    grp = h // hkv
    tile = max(1, min(tile, n))
    lut = build_lut(qg.reshape(b, hkv, grp * t, d), k_centroids) if t <= LUT_MAX_QUERIES else None

    def tile_fn(parts, rows):
        kc_tile, vc_tile = parts
        if lut is not None:
            scores = lut_scores(lut, kc_tile).reshape(b, hkv, grp, t, -1)
        else:
            scores = einsum_f32("bkgtd,bksd->bkgts", qg, gather_centroids(k_centroids, kc_tile))
        return scores * scale, gather_centroids(v_centroids, vc_tile)

    return tiled_attention((b, hkv, grp, t), d, tile, lo, hi, [(k_codes, 1), (v_codes, 1)], tile_fn)

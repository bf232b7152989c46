"""Attention over PQ codes in pure jnp (the "xla" implementation, and the kernel's fallback).

For query head h (KV head h // G) and a key stored as codes c_t[m]:

    LUT[m, j] = q_m . Ck_m[j]                 one [M, K] table per query
    score_t   = scale * sum_m LUT[m, c_t[m]]  M lookups, no dequantization
    out       = sum_t p_t * concat_m Cv_m[cv_t[m]]

The context is walked in tiles (:mod:`million_jax.attention.tiling`), so dequantized K/V are never
materialised for the whole context. With many queries per call (prefill) the key side of a
tile is gathered and multiplied instead of read from a LUT: the same numbers, computed the
way a matmul unit likes. The LUT / gather math is :mod:`pallas_kernels.pq_math`.

Shapes (one layer):
    q:            float[B, T, H, d]
    k_codes:      uint8|uint16[B, Hkv, N, Mk], or packed uint8[B, Hkv, N, ceil(Mk * nbits / 8)]
                  (:mod:`pallas_kernels.code_packing`; unpacked here one tile at a time)
                  or, with ``k_parts`` (codes of several widths), uint8[B, Hkv, N, parts_width(k_parts)]
    v_codes:      alike with Mv (keys and values may have different M and nbits)
    k_centroids:  float[G, Mk, Kk, d / Mk], G in {1, Hkv}   (v_centroids: [G, Mv, Kv, d / Mv])
    lo, hi:       int32[B, T]   query t of sequence b sees tokens lo <= s < hi
    rope_inv_freq: float32[Mk] or [Mk, P] (or per KV head [G, Mk, P], G in {1, Hkv}: heads whose
                  sub-spaces hold their pairs in their own order), or None. None: keys quantized after RoPE (MILLION).
                  Else the keys were quantized before RoPE, key sub-space m is P whole RoPE
                  pairs (dsub = 2P, pair layout, :func:`million_jax.rope.to_pair_layout`) and
                  stored row s is the key of absolute position s: pair p of its sub-space m is
                  rotated by s * rope_inv_freq[m, p] here (q is rotated at its own position
                  already). With the LUT: two tables (q.c, q.Jc) per pair and
                  score = sum_pairs cos LUT + sin LUTJ; with the matmul: the tile's decoded keys
                  rotated (`pallas_kernels.pq_math`, exact fixed-point angles).
    k_scales, v_scales: float[B, Hkv, N, 1] or None: a per-token factor of each stored key's
                  score / value (norm-explicit PQ, :mod:`million_jax.quant.kv_codebooks`).
Returns (out float32[B, T, H, d], lse float32[B, T, H]); 0 / -inf when a query sees no token.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.code_packing import (Parts, check_layout, check_layout_codes, codebook_nbits, is_packed, maybe_unpack,
                                         unpack_layout)
from million_jax.attention.tiling import tiled_attention
from pallas_kernels.pq_math import (
    build_lut,
    check_rope_inv_freq,
    gather_centroids,
    lut_scores,
    pair_freqs,
    pair_subspaces,
    quarter_turn,
    rope_lut_scores,
    rope_turns,
    rotate_pairs,
    turn_cos_sin,
)
from pallas_kernels.softmax import einsum_f32, group_heads

__all__ = ["pq_attention_xla", "check_code_fit", "LUT_MAX_QUERIES"]

# With at most this many queries per call the key scores come from the LUT;
# above it a tile of keys is decoded and multiplied (prefill).
LUT_MAX_QUERIES = 8


def check_code_fit(d: int, k_codes, v_codes, k_centroids, v_centroids, k_parts: Parts | None = None) -> None:
    """ValueError unless codes [B, Hkv, N, width] fit their codebooks [G, M, K, dsub] (width M,
    or M packed codes of log2 K bits, or with ``k_parts`` uint8 key codes in that layout, its counts
    summing to M and its widest part log2 K bits; M * dsub = d) and keys and values agree on
    [B, Hkv, N]. Shapes only (trace time)."""
    for name, codes, cb in (("key", k_codes, k_centroids), ("value", v_codes, v_centroids)):
        g, m_cb, kc, dsub = cb.shape
        nbits = codebook_nbits(kc)
        try:
            if name == "key" and k_parts is not None:
                check_layout(k_parts, m_cb, nbits)
                check_layout_codes(k_parts, m_cb, codes.shape[-1], codes.dtype)
            else:
                is_packed(codes.shape[-1], m_cb, nbits)
        except ValueError as e:
            raise ValueError(f"{name} codebook [G={g}, M={m_cb}, K={kc}, dsub={dsub}] does not fit its codes: "
                             f"{e}") from None
        if m_cb * dsub != d:
            raise ValueError(f"{name} codebook [G={g}, M={m_cb}, K={kc}, dsub={dsub}] does not fit d={d}")
    if v_codes.shape[:3] != k_codes.shape[:3]:
        raise ValueError(f"key codes {k_codes.shape} and value codes {v_codes.shape} differ in [B, Hkv, N]")


def pq_attention_xla(
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
    rope_inv_freq: jax.Array | None = None,
    check_codes: bool = True,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    k_parts: Parts | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over tokens stored as PQ codes (see module docstring).

    check_codes: check the codes against their codebooks (:func:`check_code_fit`); False for
    callers that did it once already (the PQ cache, in ``layer_consts``). k_parts: the key codes'
    layout of several widths (``PQCodebooks.key_parts``) or None."""
    if check_codes:
        check_code_fit(q.shape[-1], k_codes, v_codes, k_centroids, v_centroids, k_parts)
    b, t, h, d = q.shape
    hkv = k_codes.shape[1]
    n = k_codes.shape[2]
    if k_parts is None:
        unpack_k = lambda c: maybe_unpack(c, k_centroids.shape[1], codebook_nbits(k_centroids.shape[2]))  # noqa: E731
    else:
        unpack_k = lambda c: unpack_layout(c, k_parts)  # noqa: E731
    unpack_v = lambda c: maybe_unpack(c, v_centroids.shape[1], codebook_nbits(v_centroids.shape[2]))  # noqa: E731
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = group_heads(q.astype(jnp.float32), hkv)  # [B, Hkv, G, T, d]
    grp = h // hkv
    tile = max(1, min(tile, n))
    use_lut = t <= LUT_MAX_QUERIES
    rows_q = qg.reshape(b, hkv, grp * t, d)
    if rope_inv_freq is None:
        lut = build_lut(rows_q, k_centroids) if use_lut else None
    else:
        check_rope_inv_freq(rope_inv_freq, k_centroids.shape[1], k_centroids.shape[3], hkv)
        turns = rope_turns(pair_freqs(rope_inv_freq))  # once per call; each tile's angles from its positions
        pairs = pair_subspaces(k_centroids)  # [G, Mk * P, Kk, 2]: one table row per RoPE pair
        lut = build_lut(rows_q, pairs) if use_lut else None
        lut_j = build_lut(rows_q, quarter_turn(pairs)) if use_lut else None

    def key_scores(kc_tile, rows, start):
        if rope_inv_freq is None:
            if use_lut:
                return lut_scores(lut, kc_tile).reshape(b, hkv, grp, t, -1)
            return einsum_f32("bkgtd,bksd->bkgts", qg, gather_centroids(k_centroids, kc_tile))
        pos = start + jnp.arange(rows, dtype=jnp.int32)
        cos, sin = turn_cos_sin(pos, *turns)  # [(G,) rows, Mk * P]
        if use_lut:
            return rope_lut_scores(lut, lut_j, kc_tile, cos, sin).reshape(b, hkv, grp, t, -1)
        keys = rotate_pairs(gather_centroids(k_centroids, kc_tile), cos, sin)
        return einsum_f32("bkgtd,bksd->bkgts", qg, keys)

    scaled = [x for x in (k_scales, v_scales) if x is not None]
    for x in scaled:
        if tuple(x.shape) != (b, hkv, n, 1):
            raise ValueError(f"per-token scales must be float[B, Hkv, N, 1] = {[b, hkv, n, 1]}, got {list(x.shape)}")

    def tile_fn(parts, rows, start):
        kc_tile, vc_tile = unpack_k(parts[0]), unpack_v(parts[1])
        extra = iter(parts[2:])
        scores = key_scores(kc_tile, rows, start) * scale
        values = gather_centroids(v_centroids, vc_tile)
        if k_scales is not None:  # [B, Hkv, rows, 1] -> one factor per token's score
            scores = scores * next(extra)[..., 0].astype(jnp.float32)[:, :, None, None, :]
        if v_scales is not None:
            values = values * next(extra).astype(jnp.float32)
        return scores, values

    arrays = [(k_codes, 1), (v_codes, 1)] + [(x, 1) for x in scaled]
    return tiled_attention((b, hkv, grp, t), d, tile, lo, hi, arrays, tile_fn)

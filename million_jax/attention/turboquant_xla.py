"""Attention read straight from TurboQuant codes (pure jnp), in rotated coordinates.

The query is rotated once per call (``q' = R q``, and ``S q'`` for the QJL residual); a stored
token t holds a norm n_t and one code c_tj per rotated coordinate, so

    score_t = n_t * sum_j q'_j levels[c_tj]  (+ r_t sqrt(pi/2)/d * sum_j (S q')_j sign_tj)
    out'    = sum_t p_t n_t levels[c_t]      (rotated; the caller turns it back once: R^T out')

``q'_j levels[l]`` is the per-coordinate table (d rows of 2^b entries, the 1-dim sub-space case
of PQ's table) and the sum over j its lookup; here it is one einsum of q' with the tile's
gathered levels, which is the same arithmetic. Only one tile of ``tile`` tokens is unpacked at a
time, inside the token-tile walk shared by every xla path (:mod:`million_jax.attention.tiling`;
the online softmax is :mod:`pallas_kernels.softmax`). Quantization math:
:mod:`million_jax.quant.turboquant`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from million_jax.attention.layer_slice import ArrayOrSlice
from million_jax.attention.tiling import tiled_attention
from million_jax.quant.turboquant import QJL_SCALE, Part, unit_levels, unpack_parts, unpack_signs
from pallas_kernels.softmax import einsum_f32, group_heads

__all__ = ["turboquant_attention_xla"]


def turboquant_attention_xla(
    qr: jax.Array,
    qs: jax.Array | None,
    k_codes: ArrayOrSlice,
    k_norm: ArrayOrSlice,
    k_qjl: ArrayOrSlice | None,
    k_rnorm: ArrayOrSlice | None,
    v_codes: ArrayOrSlice,
    v_norm: ArrayOrSlice,
    lo: jax.Array,
    hi: jax.Array,
    *,
    key_parts: tuple[Part, ...],
    value_parts: tuple[Part, ...],
    tile: int = 512,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of the rotated query over tokens stored as TurboQuant codes.

    qr:                float[B, T, H, d]     R q (GQA: head h reads KV head h // (H/Hkv))
    qs:                float[B, T, H, d]     S R q (QJL keys), or None
    k_codes, v_codes:  uint8[B, Hkv, N, P]   packed codes of the parts, side by side
    k_norm, v_norm:    float[B, Hkv, N, 1]   per-token norms
    k_qjl, k_rnorm:    uint8[B, Hkv, N, d/8] sign bits and float[B, Hkv, N, 1] residual norms, or None
    lo, hi:            int32[B, T]           query t sees tokens lo <= s < hi
    Returns (out float32[B, T, H, d] in rotated coordinates, lse float32[B, T, H]); 0 / -inf
    for a query that sees no token.
    """
    b, t, h, d = qr.shape
    hkv = k_codes.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    if (qs is None) != (k_qjl is None):
        raise ValueError("the QJL query (qs) and the stored QJL bits (k_qjl) come together")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = group_heads(qr.astype(jnp.float32), hkv)  # [B, Hkv, G, T, d]
    qsg = None if qs is None else group_heads(qs.astype(jnp.float32), hkv)
    arrays = [(k_codes, 1), (k_norm, 1), (v_codes, 1), (v_norm, 1)]
    if k_qjl is not None:
        arrays += [(k_qjl, 1), (k_rnorm, 1)]

    def tile_fn(parts, rows, start):
        kct, knt, vct, vnt = parts[:4]
        ku = unit_levels(unpack_parts(kct, key_parts), key_parts, d)  # [B, Hkv, rows, d]
        scores = einsum_f32("bkgtd,bksd->bkgts", qg, ku) * knt[..., 0].astype(jnp.float32)[:, :, None, None, :]
        if qsg is not None:
            signs = unpack_signs(parts[4], d)
            rn = parts[5][..., 0].astype(jnp.float32)[:, :, None, None, :]
            scores = scores + einsum_f32("bkgtd,bksd->bkgts", qsg, signs) * (QJL_SCALE / d) * rn
        vd = unit_levels(unpack_parts(vct, value_parts), value_parts, d) * vnt.astype(jnp.float32)
        return scores * scale, vd

    return tiled_attention((b, hkv, h // hkv, t), d, tile, lo, hi, arrays, tile_fn)

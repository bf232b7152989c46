"""The pure-jnp fp32 reference of the PQ decode kernel (`pq_decode_attention`): any backend,
uint8 / uint16 / packed codes, post- and pre-RoPE keys.

Written with the math the library shares (:mod:`pallas_kernels.pq_math`,
:mod:`pallas_kernels.softmax`, :mod:`pallas_kernels.code_packing`), not with the kernel's own
in-register copy of it, so the kernel tests compare two independent formulations.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._pq_inputs import check_pq_inputs
from pallas_kernels.code_packing import Parts, unpack_parts
from pallas_kernels.pq_math import (
    build_lut,
    check_rope_inv_freq,
    gather_centroids,
    lut_scores,
    pair_freqs,
    pair_subspaces,
    quarter_turn,
    rope_cos_sin,
    rope_lut_scores,
)
from pallas_kernels.softmax import softmax_attention

__all__ = ["pq_decode_attention_reference"]


def pq_decode_attention_reference(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    scale: float | None = None,
    rope_inv_freq: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    k_parts: Parts | None = None,
    v_parts: Parts | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp fp32 reference of `pq_decode_attention` (any backend, uint8 / uint16 / packed codes).

    Written with the shared math: LUT[b, g, h, m, j] = q_m . Ck_m[j] (`pq_math.build_lut`),
    score = scale * sum_m LUT[m, code_m] (`pq_math.lut_scores`), values = the value centroids
    the codes name (`pq_math.gather_centroids`), masked softmax over start[b] <= t < end[b]
    (`softmax.softmax_attention`). Pre-RoPE keys (``rope_inv_freq``): the two tables q.c and
    q.Jc per RoPE pair and score = scale * sum_i cos_ti LUT + sin_ti LUTJ (`pq_math.rope_lut_scores`), the
    angles of row t from `pq_math.rope_cos_sin`. Per-token scales multiply row t's score
    (``k_scales``) and its value (``v_scales``); codes in a layout of parts are unpacked part by
    part (`code_packing.unpack_parts`).

    Args / returns: as `pq_decode_attention` (codes may also be uint16[B, Hkv, T, M]).
    Memory: O(B * H * T * M) for the gathered LUT entries.
    """
    dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end, k_parts=k_parts,
                           v_parts=v_parts, k_scales=k_scales, v_scales=v_scales)
    batch, num_heads, head_dim = dims.batch, dims.num_heads, dims.head_dim
    hkv, group, t_len = dims.num_kv_heads, dims.group, dims.seq_len
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    q_grouped = q.astype(jnp.float32).reshape(batch, hkv, group, head_dim)
    k_codes = _unpacked(k_codes, dims.layout("k"))
    v_codes = _unpacked(v_codes, dims.layout("v"))
    if rope_inv_freq is None:
        lut = build_lut(q_grouped, k_codebooks)  # [B, Hkv, group, M, Kk]
        scores = scale * lut_scores(lut, k_codes)  # [B, Hkv, group, T]
    else:
        check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim, dims.num_kv_heads)
        pairs = pair_subspaces(k_codebooks)  # [G, M * P, Kk, 2]: one table row per RoPE pair
        lut = build_lut(q_grouped, pairs)
        lut_j = build_lut(q_grouped, quarter_turn(pairs))
        cos, sin = rope_cos_sin(jnp.arange(t_len, dtype=jnp.int32), pair_freqs(rope_inv_freq))  # [T, M * P]
        scores = scale * rope_lut_scores(lut, lut_j, k_codes, cos, sin)
    if k_scales is not None:
        scores = scores * k_scales.astype(jnp.float32)[:, :, None, :]
    t = jnp.arange(t_len)
    valid = (t[None, :] >= start.astype(jnp.int32)[:, None]) & (t[None, :] < end.astype(jnp.int32)[:, None])
    v_hat = gather_centroids(v_codebooks, v_codes)  # [B, Hkv, T, d]
    if v_scales is not None:
        v_hat = v_hat * v_scales.astype(jnp.float32)[..., None]
    out, lse = softmax_attention(scores[:, :, :, None], valid[:, None, None, None, :], v_hat)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def _unpacked(codes: jax.Array, layout: Parts | None) -> jax.Array:
    """Codes one per entry [..., M] from their stored layout (None: already one per entry)."""
    if layout is None:
        return codes
    return jnp.concatenate([c.astype(jnp.int32) for c in unpack_parts(codes, layout)], axis=-1)

"""Exact masked attention over full-precision keys (the dense cache, the exact window, forward).

The softmax / merge math itself lives once in :mod:`pallas_kernels.softmax`; this module
adds the dense score computation and the causal mask.

Shapes (GQA: ``H`` query heads share ``Hkv`` key/value heads, ``G = H // Hkv``;
query head ``h`` reads KV head ``h // G``):

    q:     float[B, T, H, d]
    k, v:  float[B, Hkv, S, d]      (the cache layout, one layer)
    mask:  bool[B, T, S]            True where query t may attend to key s
    out:   float[B, T, H, d]        in q.dtype
    lse:   f32[B, T, H]             log sum_s exp(score), -inf for a query
                                     that sees no key (its out is 0)

Scores, softmax and the P.V accumulation are float32 whatever the input dtype;
probabilities are cast to v.dtype before the P.V product (as HF eager attention does).
"""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

from million_jax.attention.layer_slice import ArrayOrSlice
from million_jax.attention.tiling import tiled_attention
from pallas_kernels.softmax import einsum_f32, group_heads, softmax_attention, ungroup_heads

__all__ = ["attention", "causal_mask", "causal_attention", "einsum_f32", "new_token_attention", "tiled_dense_attention"]


def causal_mask(q_positions: jax.Array, kv_lengths: jax.Array, num_keys: int) -> jax.Array:
    """bool[B, T, S]: key s is visible to query t iff s < kv_lengths[b] and s <= q_pos[b, t].

    q_positions: int[B, T] absolute positions of the queries.
    kv_lengths:  int[B]    number of valid keys per sequence.
    """
    s = jnp.arange(num_keys, dtype=jnp.int32)
    valid = s[None, :] < kv_lengths[:, None]                      # [B, S]
    causal = s[None, None, :] <= q_positions[:, :, None]          # [B, T, S]
    return causal & valid[:, None, :]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Masked softmax attention (shapes in the module docstring).

    Returns ``out`` or ``(out, lse)`` when ``return_lse``. Fully masked query
    rows give ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    chex.assert_rank([q, k, v, mask], [4, 4, 4, 3])
    b, t, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    chex.assert_shape(k, (b, hkv, s, d))
    chex.assert_shape(v, (b, hkv, s, v.shape[-1]))
    chex.assert_shape(mask, (b, t, s))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = einsum_f32("bkgtd,bksd->bkgts", group_heads(q, hkv), k) * scale  # [B, Hkv, G, T, S]
    out, lse = softmax_attention(scores, mask[:, None, None], v)
    out = ungroup_heads(out).astype(q.dtype)
    return (out, ungroup_heads(lse)) if return_lse else out


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention where key s sits at absolute position s.

    q: float[B, T, H, d]; k, v: float[B, Hkv, S, d].
    q_positions: int[B, T] (default: ``arange(T)``, i.e. self-attention over a
    full sequence); kv_lengths: int[B] (default: S).
    """
    b, t = q.shape[:2]
    s = k.shape[2]
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if kv_lengths is None:
        kv_lengths = jnp.full((b,), s, jnp.int32)
    mask = causal_mask(q_positions, kv_lengths, s)
    return attention(q, k, v, mask, scale=scale, return_lse=return_lse)


def tiled_dense_attention(
    q: jax.Array,
    k: ArrayOrSlice,
    v: ArrayOrSlice,
    lo: jax.Array,
    hi: jax.Array,
    *,
    tile: int = 512,
    scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q float[B, T, H, d] over stored keys k, v float[B, Hkv, N, d] (arrays or
    :class:`~million_jax.attention.layer_slice.LayerSlice` views of a stacked cache), tokens
    lo <= s < hi (int32[B, T]) visible, walked in tiles up to the longest ``hi`` only
    (:mod:`million_jax.attention.tiling`): a decode step costs O(longest sequence), not O(N).

    Returns out float[B, T, H, d] in q.dtype (0 for a query that sees nothing), or with
    ``return_lse`` (out float32[B, T, H, d], lse float32[B, T, H]) for a merge.
    """
    b, t, h, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = group_heads(q, hkv)  # [B, Hkv, G, T, d]

    def tile_fn(parts, rows, start):
        kt, vt = parts
        return einsum_f32("bkgtd,bksd->bkgts", qg, kt) * scale, vt

    out, lse = tiled_attention((b, hkv, h // hkv, t), v.shape[-1], tile, lo, hi, [(k, 1), (v, 1)], tile_fn)
    return (out, lse) if return_lse else out.astype(q.dtype)


def new_token_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of q float[B, T, H, d] over the T keys / values of this call itself,
    k, v float[B, T, Hkv, d] (new token j visible to query t iff lo[b, t] <= j < hi[b, t]).

    k, v come in the dtype the cache would store them in. A cache attends to what it stored
    before the call and to the call's own tokens as two parts merged by log-sum-exp, and writes the new tokens only afterwards: reading a cache
    buffer after writing it in the same layer-loop iteration makes XLA copy it.
    Returns (out float32[B, T, H, d], lse float32[B, T, H]).
    """
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return tiled_dense_attention(q, kt, vt, lo, hi, scale=scale, return_lse=True)

"""Exact masked attention in pure jnp, with log-sum-exp for merging partials.

Used by the dense cache and by the cache-free full forward, and by any cache
that splits attention into parts (e.g. a quantized history plus an exact
recent window): each part returns ``(out, lse)`` and ``merge_attention``
combines them exactly.

Shapes (GQA: ``H`` query heads share ``Hkv`` key/value heads, ``G = H // Hkv``;
query head ``h`` reads KV head ``h // G``):

    q:     float[B, T, H, d]
    k, v:  float[B, Hkv, S, d]      (the cache layout, one layer)
    mask:  bool[B, T, S]            True where query t may attend to key s
    out:   float[B, T, H, d]        in q.dtype
    lse:   f32[B, T, H]             log sum_s exp(score), -inf for a query
                                     that sees no key (its out is 0)

Scores, softmax and the P.V accumulation are float32 whatever the input
dtype; probabilities are cast to v.dtype before the P.V product (as HF
eager attention does).
"""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

__all__ = ["attention", "causal_mask", "causal_attention", "merge_attention", "einsum_f32"]


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation and result.

    On accelerators low-precision operands go to the dot unit as they are. XLA's
    CPU runtime has no BF16 x BF16 -> F32 dot for every shape ("Unsupported
    element type for DotThunk"), so there the operands are upcast first (exact).
    """
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


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
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    qg = q.reshape(b, t, hkv, g, d)
    scores = einsum_f32("btkgd,bksd->bkgts", qg, k) * scale            # [B, Hkv, G, T, S]
    m4 = mask[:, None, None, :, :]
    scores = jnp.where(m4, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)                                  # [B, Hkv, G, T]
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(m4, jnp.exp(scores - row_max[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)                                         # [B, Hkv, G, T]
    o = einsum_f32("bkgts,bksd->btkgd", p.astype(v.dtype), v)
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)                        # [B, Hkv, G, T]
    o = o * jnp.transpose(inv, (0, 3, 1, 2))[..., None]
    out = o.reshape(b, t, h, v.shape[-1]).astype(q.dtype)
    if not return_lse:
        return out
    lse = row_max + jnp.log(denom)                                      # -inf where denom == 0
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)
    return out, lse


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


def merge_attention(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact softmax combination of two attention results over disjoint key sets.

    out_*: float[..., d]; lse_*: f32[...]. Returns (out in out_a.dtype, lse).
    Parts with ``lse = -inf`` (no keys) contribute nothing.
    """
    chex.assert_equal_shape([out_a, out_b])
    chex.assert_equal_shape([lse_a, lse_b])
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.exp(lse_a - m)
    wb = jnp.exp(lse_b - m)
    tot = wa + wb
    out = (wa[..., None] * out_a.astype(jnp.float32) + wb[..., None] * out_b.astype(jnp.float32))
    out = out / jnp.where(tot > 0, tot, 1.0)[..., None]
    return out.astype(out_a.dtype), m + jnp.log(tot)

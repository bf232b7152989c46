"""Tiled online softmax shared by the attention-from-codes paths (PQ and uniform).

Layout (GQA groups explicit): scores f32[B, Hkv, G, T, n] for one tile of n tokens,
vis bool broadcastable to it, tile values vd f32[B, Hkv, n, d]; the running state is
(m, l, acc) = (f32[B, Hkv, G, T], f32[B, Hkv, G, T], f32[B, Hkv, G, T, d]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["softmax_init", "softmax_step", "softmax_finish", "pad_rows", "to_tiles"]


def softmax_init(b: int, hkv: int, g: int, t: int, d: int):
    """Empty running state: m = -inf, l = 0, acc = 0."""
    return (
        jnp.full((b, hkv, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, g, t), jnp.float32),
        jnp.zeros((b, hkv, g, t, d), jnp.float32),
    )


def softmax_step(carry, scores: jax.Array, vis: jax.Array, vd: jax.Array):
    """Fold one tile into the running state; masked scores never produce NaN."""
    m_run, l_run, acc = carry
    scores = jnp.where(vis, scores, -jnp.inf)
    m_new = jnp.maximum(m_run, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(vis, jnp.exp(scores - m_safe[..., None]), 0.0)
    alpha = jnp.where(jnp.isfinite(m_run), jnp.exp(m_run - m_safe), 0.0)
    acc = acc * alpha[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p, vd)
    l_run = l_run * alpha + jnp.sum(p, axis=-1)
    return m_new, l_run, acc


def softmax_finish(carry, b: int, t: int, h: int, d: int):
    """(out f32[B, T, H, d], lse f32[B, T, H]); a query that saw nothing gets 0 / -inf."""
    m_run, l_run, acc = carry
    ok = l_run > 0
    out = acc / jnp.where(ok, l_run, 1.0)[..., None]
    lse = jnp.where(ok, jnp.where(jnp.isfinite(m_run), m_run, 0.0) + jnp.log(jnp.where(ok, l_run, 1.0)), -jnp.inf)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)
    return out, lse


def pad_rows(x: jax.Array, n: int) -> jax.Array:
    """Zero-pad axis 2 of x [B, Hkv, N, ...] to n rows."""
    pad = n - x.shape[2]
    if pad <= 0:
        return x
    return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))


def to_tiles(x: jax.Array, n_tiles: int) -> jax.Array:
    """[B, Hkv, n_tiles*r, ...] -> [n_tiles, B, Hkv, r, ...] (scanned over the first axis)."""
    b, hkv, n = x.shape[:3]
    return jnp.moveaxis(x.reshape((b, hkv, n_tiles, n // n_tiles) + x.shape[3:]), 2, 0)

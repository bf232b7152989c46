"""The exact (full-precision) part shared by quantized caches: sinks + a ring of recent tokens.

A quantized cache stores every token as codes and, next to them, keeps in the
model dtype the first ``S`` tokens ("sinks") and the last ``W`` tokens (a ring
buffer, slot = position % W). Attention then reads, for a query at position p:

    exact:  sinks (s < S), and the sliding window  p - W < s <= p  (s >= S)
    codes:  S <= s <= p - W

The window of a query of a multi-token call (prefill) reaches back into tokens
stored before the call; those are exactly the ring's content before the append,
so chunked prefill sees the same exact/quantized split as one-shot prefill. Attention
reads the sinks and the ring as stored before the call plus the call's new tokens; the
new tokens are written afterwards (:mod:`million_jax.cache.base`).

Shapes (one layer):
    sink_k, sink_v: float[B, Hkv, S, d]
    ring_k, ring_v: float[B, Hkv, W, d]
    k, v (new):     float[B, T, Hkv, d]
    lengths:        int32[B]  tokens stored before this call
    n_new:          int32[B]  real new tokens (rows t >= n_new[b] are padding)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import Any

from million_jax.attention.exact import attention
from million_jax.cache.base import KVCache, LayerState, Writes

__all__ = ["ExactWindowCache", "ExactWindowLayer", "empty_window", "window_writes", "exact_window_attention"]


class ExactWindowLayer(LayerState):
    """Mixin of a quantized layer state: codes ``k_codes [..., T_max, *]`` plus the exact
    ``sink_k / sink_v [..., S, d]`` and ``ring_k / ring_v [..., W, d]`` (module docstring)."""

    quantize_all: bool

    @property
    def max_len(self) -> int:
        return self.k_codes.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.ring_k.shape[-1]

    @property
    def window(self) -> int:
        return self.ring_k.shape[-2]

    @property
    def sinks(self) -> int:
        return self.sink_k.shape[-2]

    @property
    def has_exact(self) -> bool:
        """Whether some tokens are read exactly (sinks or window, and not ``quantize_all``)."""
        return not self.quantize_all and bool(self.sinks or self.window)

    def write_exact(self, k: jax.Array, v: jax.Array, lengths: jax.Array, n_new: jax.Array) -> Writes:
        """The sink / ring writes that append k, v float[B, T, Hkv, d] (see :func:`window_writes`);
        empty when the cache keeps no exact tokens."""
        if not (self.sinks or self.window):
            return {}
        return window_writes(self.sinks, self.window, k, v, lengths, n_new)

    def exact_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, n_new: jax.Array,
                        scale: float | None = None):
        """(out, lse) of q over the exact tokens: the sinks and the ring as stored before this
        call and the new k, v as they will be stored (:func:`exact_window_attention`)."""
        dt = self.ring_k.dtype
        return exact_window_attention(q, self.sink_k, self.sink_v, self.ring_k, self.ring_v, k.astype(dt),
                                      v.astype(dt), lengths, n_new, scale=scale)

    def code_region(self, pos: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(lo, hi) int32[B, T]: query at pos[b, t] reads tokens lo <= s < hi from codes.

        end: int32[B], tokens stored after this call's append.
        """
        exact = self.has_exact
        lo = jnp.full_like(pos, self.sinks if exact else 0)
        hi = jnp.minimum(pos + 1 - (self.window if exact else 0), end[:, None])
        return lo, hi


class ExactWindowCache(KVCache):
    """Mixin of a quantized cache whose ``layers`` is an :class:`ExactWindowLayer`."""

    @property
    def window(self) -> int:
        return self.layers.window

    @property
    def sinks(self) -> int:
        return self.layers.sinks


def empty_window(lead: tuple[int, ...], sinks: int, window: int, head_dim: int, dtype: Any) -> dict[str, jax.Array]:
    """Zero sink_k, sink_v float[*lead, S, d] and ring_k, ring_v float[*lead, W, d] (distinct buffers)."""
    sink, ring = lead + (sinks, head_dim), lead + (window, head_dim)
    return dict(sink_k=jnp.zeros(sink, dtype), sink_v=jnp.zeros(sink, dtype),
                ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype))


def window_writes(sinks: int, window: int, k: jax.Array, v: jax.Array, lengths: jax.Array,
                  n_new: jax.Array) -> Writes:
    """The writes storing the new tokens that belong to the sinks or to the last W positions.

    Only the last W real new tokens go to the ring, so no two writes hit the same slot.
    """
    t = k.shape[1]
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] + steps  # [B, T]
    real = steps < n_new[:, None]
    sink_rows = jnp.where(real & (pos < sinks), pos, sinks)
    writes = {"sink_k": (sink_rows, k), "sink_v": (sink_rows, v)}
    if window:
        end = lengths + n_new
        keep = real & (pos >= (end - window)[:, None])
        ring_rows = jnp.where(keep, pos % window, window)
        writes.update(ring_k=(ring_rows, k), ring_v=(ring_rows, v))
    return writes


def _ring_positions(lengths: jax.Array, w: int) -> jax.Array:
    """int32[B, W]: the position held in each ring slot before the append (-1: empty)."""
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    pos = last - jnp.mod(last - j, w)
    return jnp.where(pos >= 0, pos, -1)


def exact_window_attention(q, sink_k, sink_v, ring_k, ring_v, k, v, lengths, n_new, *, scale=None):
    """Attention of q float[B, T, H, d] over the exact keys (sinks, window).

    sink_k, sink_v / ring_k, ring_v: as stored before this call; k, v float[B, T, Hkv, d]: the
    call's new tokens (n_new[b] real ones), which serve as sinks (position < S) or as window.
    Returns (out float32[B, T, H, d], lse float32[B, T, H]); lse = -inf where a
    query sees no exact key.
    """
    b, t = q.shape[:2]
    s_cap, w_cap = sink_k.shape[2], ring_k.shape[2]
    steps = jnp.arange(t, dtype=jnp.int32)
    q_pos = lengths[:, None] + steps[None, :]  # [B, T]
    new_pos = jnp.where(steps[None, :] < n_new[:, None], q_pos, -1)  # padding never visible
    sink_pos = jnp.broadcast_to(jnp.arange(s_cap, dtype=jnp.int32)[None, :], (b, s_cap))
    sink_pos = jnp.where(sink_pos < lengths[:, None], sink_pos, -1)  # stored before this call
    ring_pos = _ring_positions(lengths, w_cap) if w_cap else jnp.zeros((b, 0), jnp.int32)
    kv_pos = jnp.concatenate([sink_pos, ring_pos, new_pos], axis=1)  # [B, S + W + T]
    is_sink = jnp.concatenate(
        [jnp.ones((b, s_cap), bool), jnp.zeros((b, w_cap), bool), new_pos < s_cap], axis=1
    )
    dt = q.dtype
    keys = jnp.concatenate([sink_k.astype(dt), ring_k.astype(dt), jnp.swapaxes(k, 1, 2).astype(dt)], axis=2)
    vals = jnp.concatenate([sink_v.astype(dt), ring_v.astype(dt), jnp.swapaxes(v, 1, 2).astype(dt)], axis=2)
    p = q_pos[:, :, None]
    s = kv_pos[:, None, :]
    valid = s >= 0
    causal = s <= p
    # sinks are exact for every query; other keys only inside the window and not sinks
    in_window = (s > p - w_cap) & (s >= s_cap)
    mask = valid & causal & jnp.where(is_sink[:, None, :], True, in_window)
    out, lse = attention(q.astype(jnp.float32), keys.astype(jnp.float32), vals.astype(jnp.float32), mask, scale=scale, return_lse=True)
    return out, lse

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


# Calls with more new tokens than this attend in query blocks of QUERY_BLOCK: each block reads the
# sinks, the ring and only the new tokens within a window of it, so a 32K-token prefill costs
# O(T * (S + 2W + Q)) memory instead of O(T^2).
BLOCK_ABOVE = 2048
QUERY_BLOCK = 512


def exact_window_attention(q, sink_k, sink_v, ring_k, ring_v, k, v, lengths, n_new, *, scale=None):
    """Attention of q float[B, T, H, d] over the exact keys (sinks, window).

    sink_k, sink_v / ring_k, ring_v: as stored before this call; k, v float[B, T, Hkv, d]: the
    call's new tokens (n_new[b] real ones), which serve as sinks (position < S) or as window.
    Returns (out float32[B, T, H, d], lse float32[B, T, H]); lse = -inf where a
    query sees no exact key. Long calls (T > BLOCK_ABOVE, with a window) run in query blocks.
    """
    b, t = q.shape[:2]
    s_cap, w_cap = sink_k.shape[2], ring_k.shape[2]
    steps = jnp.arange(t, dtype=jnp.int32)
    q_pos = lengths[:, None] + steps[None, :]  # [B, T]
    new_pos = jnp.where(steps[None, :] < n_new[:, None], q_pos, -1)  # padding never visible
    sink_pos = jnp.broadcast_to(jnp.arange(s_cap, dtype=jnp.int32)[None, :], (b, s_cap))
    sink_pos = jnp.where(sink_pos < lengths[:, None], sink_pos, -1)  # stored before this call
    ring_pos = _ring_positions(lengths, w_cap) if w_cap else jnp.zeros((b, 0), jnp.int32)
    dt = q.dtype
    old_k = jnp.concatenate([sink_k.astype(dt), ring_k.astype(dt)], axis=2)  # [B, Hkv, S + W, d]
    old_v = jnp.concatenate([sink_v.astype(dt), ring_v.astype(dt)], axis=2)
    old_pos = jnp.concatenate([sink_pos, ring_pos], axis=1)
    old_sink = jnp.concatenate([jnp.ones((b, s_cap), bool), jnp.zeros((b, w_cap), bool)], axis=1)
    new_k, new_v = jnp.swapaxes(k, 1, 2).astype(dt), jnp.swapaxes(v, 1, 2).astype(dt)  # [B, Hkv, T, d]

    def part(qb, qpos, nk, nv, npos):
        """qb [B, Tq, H, d] at qpos [B, Tq] over the old keys and new keys nk at npos."""
        kv_pos = jnp.concatenate([old_pos, npos], axis=1)
        is_sink = jnp.concatenate([old_sink, (npos >= 0) & (npos < s_cap)], axis=1)
        keys = jnp.concatenate([old_k, nk], axis=2)
        vals = jnp.concatenate([old_v, nv], axis=2)
        p, s = qpos[:, :, None], kv_pos[:, None, :]
        # sinks are exact for every query; other keys only inside the window and not sinks
        in_window = (s > p - w_cap) & (s >= s_cap)
        mask = (s >= 0) & (s <= p) & jnp.where(is_sink[:, None, :], True, in_window)
        return attention(qb.astype(jnp.float32), keys.astype(jnp.float32), vals.astype(jnp.float32), mask,
                         scale=scale, return_lse=True)

    if t <= BLOCK_ABOVE or not w_cap:
        return part(q, q_pos, new_k, new_v, new_pos)
    qb_len = QUERY_BLOCK
    n_blocks = -(-t // qb_len)
    pad = n_blocks * qb_len - t
    span = min(t, w_cap + qb_len)  # new keys a block can see: its own and the window before it
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    qpos_p = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)

    # New tokens that are sinks (the first S of a sequence) are seen by every block: each block
    # reads the first S new tokens as sinks only and its slice of new tokens as non-sinks only.
    head = min(s_cap, t)
    head_pos = jnp.where(new_pos[:, :head] < s_cap, new_pos[:, :head], -1)

    def block(j):
        start = j * qb_len
        lo = jnp.clip(start - w_cap, 0, t - span)
        qb = jax.lax.dynamic_slice_in_dim(qp, start, qb_len, axis=1)
        qpos = jax.lax.dynamic_slice_in_dim(qpos_p, start, qb_len, axis=1)
        nk = jax.lax.dynamic_slice_in_dim(new_k, lo, span, axis=2)
        nv = jax.lax.dynamic_slice_in_dim(new_v, lo, span, axis=2)
        npos = jax.lax.dynamic_slice_in_dim(new_pos, lo, span, axis=1)
        npos = jnp.where(npos < s_cap, -1, npos)
        return part(qb, qpos, jnp.concatenate([new_k[:, :, :head], nk], axis=2),
                    jnp.concatenate([new_v[:, :, :head], nv], axis=2), jnp.concatenate([head_pos, npos], axis=1))

    out, lse = jax.lax.map(block, jnp.arange(n_blocks))  # [n, B, Q, H, d], [n, B, Q, H]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_blocks * qb_len, *out.shape[3:])[:, :t]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, n_blocks * qb_len, *lse.shape[3:])[:, :t]
    return out, lse

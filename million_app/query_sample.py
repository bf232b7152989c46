"""QueryRecordCache: the calibration cache that also keeps the raw post-RoPE queries.

Codebook fine-tuning (:mod:`million_jax.codebook_finetune`) needs real queries, not only the
Gram sums that ``QueryStatsCache`` keeps. This cache wraps a ``QueryStatsCache`` layer (so the
keys, values and Gram sums are exactly what calibration collects today) and writes the queries
the model hands to ``attend`` into a buffer, through the public cache protocol: no change to
the model or the library's caches.

State (``QueryRecordLayer``, stacked over layers):

    stats:   QueryStatsLayer                   k, v float[L, B, Hkv, T_max, d], q_gram, q_count
    q:       float32[L, B, T_max, H, d]         the queries of every stored token (RoPE applied)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.cache.base import KVCache, LayerState, register_cache, token_rows
from million_jax.cache.query_stats import QueryStatsCache, QueryStatsLayer

__all__ = ["QueryRecordCache", "QueryRecordLayer"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryRecordLayer(LayerState):
    """stats: QueryStatsLayer of one layer; q: float32[B, T_max, H, d]."""

    stats: QueryStatsLayer
    q: jax.Array

    @property
    def max_len(self) -> int:
        return self.stats.max_len

    def attend(self, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array,
               lengths: jax.Array, n_new: jax.Array) -> tuple[jax.Array, "QueryRecordLayer"]:
        """As QueryStatsLayer; the real rows of q float[B, T, H, d] are written at their positions."""
        out, stats = self.stats.attend(consts, q, k, v, lengths, n_new)
        b, t = q.shape[:2]
        _, rows = token_rows(lengths, n_new, t, self.q.shape[1])
        bidx = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        qbuf = self.q.at[bidx, rows].set(q.astype(self.q.dtype), mode="drop")
        return out, QueryRecordLayer(stats, qbuf)


@register_cache
@dataclasses.dataclass(frozen=True)
class QueryRecordCache(KVCache):
    """QueryStatsCache + the raw queries (module docstring); needs no cache_consts."""

    layers: QueryRecordLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_heads: int, num_kv_heads: int, max_len: int,
               head_dim: int) -> "QueryRecordCache":
        stats = QueryStatsCache.create(num_layers, batch, num_kv_heads, max_len, head_dim)
        q = jnp.zeros((num_layers, batch, max_len, num_heads, head_dim), jnp.float32)
        return cls(layers=QueryRecordLayer(stats.layers, q), lengths=stats.lengths)

    def stats_cache(self) -> QueryStatsCache:
        """The wrapped QueryStatsCache (for ``collect_kv`` / ``collect_query_gram``)."""
        return QueryStatsCache(layers=self.layers.stats, lengths=self.lengths)

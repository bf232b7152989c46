"""QueryRecordCache: the calibration cache that also keeps the raw post-RoPE queries.

Codebook fine-tuning (:mod:`million_jax.calibration.finetune`) needs real queries, not only the
Gram sums that ``QueryStatsCache`` keeps. This cache wraps a ``QueryStatsCache`` layer (so the
keys, values and Gram sums are exactly what calibration collects today) and writes the queries
the model hands to ``attend`` into a buffer, through the public cache protocol: no change to
the model or the library's caches.

State (``QueryRecordLayer``, a ``QueryStatsLayer`` plus the queries, stacked over layers):

    k, v, q_gram, q_count                      as QueryStatsLayer
    q:       float32[L, B, H, T_max, d]         the queries of every stored token (RoPE applied)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.cache.base import KVCache, Writes, register_cache, token_rows
from million_jax.cache.query_stats import QueryStatsCache, QueryStatsLayer

__all__ = ["QueryRecordCache", "QueryRecordLayer"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryRecordLayer(QueryStatsLayer):
    """QueryStatsLayer + q float32[B, H, T_max, d] (one layer)."""

    TOKEN_FIELDS = ("k", "v", "q")

    q: jax.Array = None  # type: ignore[assignment]

    def attend(self, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array,
               lengths: jax.Array, n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """As QueryStatsLayer; the real rows of q float[B, T, H, d] are written at their positions."""
        out, writes = super().attend(consts, q, k, v, lengths, n_new)
        _, rows = token_rows(lengths, n_new, q.shape[1], self.max_len)
        return out, {**writes, "q": (rows, q)}


@register_cache
@dataclasses.dataclass(frozen=True)
class QueryRecordCache(KVCache):
    """QueryStatsCache + the raw queries (module docstring); needs no cache_consts."""

    layers: QueryRecordLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_heads: int, num_kv_heads: int, max_len: int,
               head_dim: int) -> "QueryRecordCache":
        st = QueryStatsCache.create(num_layers, batch, num_kv_heads, max_len, head_dim).layers
        q = jnp.zeros((num_layers, batch, num_heads, max_len, head_dim), jnp.float32)
        return cls(layers=QueryRecordLayer(st.k, st.v, st.q_gram, st.q_count, q), lengths=jnp.zeros((batch,), jnp.int32))

    def stats_cache(self) -> QueryStatsCache:
        """The QueryStatsCache part (for ``collect_kv`` / ``collect_query_gram``)."""
        lay = self.layers
        return QueryStatsCache(layers=QueryStatsLayer(lay.k, lay.v, lay.q_gram, lay.q_count), lengths=self.lengths)

"""QueryStatsCache: a DenseCache that also sums q q^T of the queries each KV head serves.

Calibration of query-aware key codebooks (:mod:`million_jax.quant.kv_transforms`) needs
``E[q q^T]`` over the post-RoPE queries of the query heads that read a KV head. Running the
calibration text through any model with this cache gives it, with no change to the model:
the cache protocol hands the attention block's (q, k, v) to ``attend``.

State (``QueryStatsLayer``, stacked over layers):

    k, v:     float[L, B, Hkv, T_max, d]   as DenseCache (attention is exact)
    q_gram:   float32[L, Hkv, d, d]        sum over real query rows and the GQA group of q q^T
    q_count:  float32[L, Hkv]              how many query vectors went into q_gram
    lengths:  int32[B]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from million_jax.cache.base import KVCache, Writes, register_cache
from million_jax.cache.dense import DenseCache, DenseLayer

__all__ = ["QueryStatsCache", "QueryStatsLayer"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryStatsLayer(DenseLayer):
    """DenseLayer + q_gram float32[Hkv, d, d], q_count float32[Hkv] (one layer)."""

    q_gram: jax.Array = None  # type: ignore[assignment]
    q_count: jax.Array = None  # type: ignore[assignment]

    def attend(self, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array,
               lengths: jax.Array, n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """Exact attention as DenseLayer; rows t < n_new[b] of q float[B, T, H, d] are summed
        into the new q_gram / q_count (written whole)."""
        out, writes = DenseLayer(self.k, self.v).attend(consts, q, k, v, lengths, n_new)
        b, t, h, d = q.shape
        hkv = self.k.shape[1]
        real = (jnp.arange(t)[None, :] < n_new[:, None]).astype(jnp.float32)  # [B, T]
        qg = q.astype(jnp.float32).reshape(b, t, hkv, h // hkv, d) * real[:, :, None, None, None]
        gram = jnp.einsum("btkgi,btkgj->kij", qg, qg, precision=lax.Precision.HIGHEST)
        count = jnp.full((hkv,), jnp.sum(real) * (h // hkv), jnp.float32)
        return out, {**writes, "q_gram": self.q_gram + gram, "q_count": self.q_count + count}


@register_cache
@dataclasses.dataclass(frozen=True)
class QueryStatsCache(KVCache):
    """DenseCache with query statistics (module docstring); needs no cache_consts."""

    layers: QueryStatsLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype: Any = jnp.float32) -> "QueryStatsCache":
        dense = DenseCache.create(num_layers, batch, num_kv_heads, max_len, head_dim, dtype)
        gram = jnp.zeros((num_layers, num_kv_heads, head_dim, head_dim), jnp.float32)
        count = jnp.zeros((num_layers, num_kv_heads), jnp.float32)
        return cls(layers=QueryStatsLayer(dense.layers.k, dense.layers.v, gram, count), lengths=dense.lengths)

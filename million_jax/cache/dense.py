"""DenseCache: preallocated full-precision K/V, the baseline every other cache is measured against.

State (``DenseLayer``, stacked over layers so the model can scan):

    k, v:     float[L, B, Hkv, T_max, d]   bf16 or fp32
    lengths:  int32[B]                     tokens stored per sequence

New tokens are written with a scatter in ``mode="drop"``: padding rows of a ragged prefill
and anything at a position ``>= T_max`` are discarded, never written out of bounds.
Attention is exact: the stored tokens (``million_jax.attention.exact.tiled_dense_attention``,
walked in tiles up to the longest sequence of the batch, so a step costs in proportion to
the tokens stored, not to T_max) and the call's new tokens, merged by log-sum-exp.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp

from million_jax.attention.exact import new_token_attention, tiled_dense_attention
from million_jax.cache.base import (CACHE_DIMS, KVCache, LayerState, Writes, check_cache_args, kept_tokens,
                                    register_cache, token_rows)
from million_jax.quant.uniform import KVBits
from pallas_kernels.softmax import merge_partials

__all__ = ["DenseCache", "DenseLayer"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseLayer(LayerState):
    """k, v: float[B, Hkv, T_max, d] (one layer; [L, ...] when stacked)."""

    TOKEN_FIELDS = ("k", "v")

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def bits_per_element(self) -> KVBits:
        """The dtype's bits for keys and values (16 for bf16, 32 for fp32)."""
        return KVBits(*(8.0 * jnp.dtype(x.dtype).itemsize for x in (self.k, self.v)))

    def attend(self, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array,
               lengths: jax.Array, n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """q float[B, T, H, d] over the stored tokens and the new k, v (float[B, T, Hkv, d]).

        Returns (out float[B, T, H, d], writes of k, v at ``lengths + t`` for t < n_new).
        """
        b, t = q.shape[:2]
        hkv, t_max, d = self.k.shape[1:]
        chex.assert_shape([k, v], (b, t, hkv, d))
        chex.assert_shape(n_new, (b,))
        kept = kept_tokens(lengths, n_new, t_max)
        _, rows = token_rows(lengths, kept, t, t_max)
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        zeros = jnp.zeros((b, t), jnp.int32)
        stored = tiled_dense_attention(q, self.k, self.v, zeros, jnp.broadcast_to(lengths[:, None], (b, t)),
                                       return_lse=True)
        steps = jnp.arange(t, dtype=jnp.int32)[None, :]
        fresh = new_token_attention(q, k, v, zeros, jnp.minimum(steps + 1, kept[:, None]))
        out, _ = merge_partials(*zip(stored, fresh))
        return out.astype(q.dtype), {"k": (rows, k), "v": (rows, v)}


@register_cache
@dataclasses.dataclass(frozen=True)
class DenseCache(KVCache):
    """Full-precision KV cache (see module docstring for shapes); needs no cache_consts."""

    layers: DenseLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype: Any = jnp.bfloat16) -> "DenseCache":
        """An empty cache: zeros of shape [L, B, Hkv, max_len, d], lengths 0."""
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        check_cache_args(dict(zip(CACHE_DIMS, shape)), dtype)
        return cls(layers=DenseLayer(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)),
                   lengths=jnp.zeros((batch,), jnp.int32))

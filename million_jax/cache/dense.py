"""DenseCache: preallocated full-precision K/V, the baseline every other cache is measured against.

Layout (one array per K and V, all layers stacked so the model can scan):

    k, v:     float[L, B, Hkv, T_max, d]   bf16 or fp32
    lengths:  int32[B]                     tokens stored per sequence

New tokens are written with a scatter in ``mode="drop"``: padding rows of a
ragged prefill and anything at a position ``>= T_max`` are discarded, never
written out of bounds. Attention is exact (``million_jax.attention``) over
all T_max slots with a causal/length mask, so a step costs O(T_max) whatever
the fill level, like any preallocated cache.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp

from million_jax.attention import causal_attention
from million_jax.cache.base import KVCache

__all__ = ["DenseCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache(KVCache):
    """Full-precision KV cache (see module docstring for shapes).

    Per-layer state handed to ``attend`` is ``{"k": float[B, Hkv, T_max, d],
    "v": float[B, Hkv, T_max, d]}``; this cache needs no ``cache_consts``.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
    ) -> "DenseCache":
        """An empty cache: zeros of shape [L, B, Hkv, max_len, d], lengths 0."""
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer_slices(self, cache_consts: Any = None) -> tuple[dict[str, jax.Array], None]:
        """({"k": [L, B, Hkv, T_max, d], "v": ...}, None)."""
        return {"k": self.k, "v": self.v}, None

    def attend(
        self,
        state: dict[str, jax.Array],
        const: Any,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        n_new: jax.Array,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Write k, v (float[B, T, Hkv, d]) at ``lengths + t`` for t < n_new, then attend.

        q: float[B, T, H, d]. Returns (out: float[B, T, H, d], new layer state).
        """
        kc, vc = state["k"], state["v"]
        b, t = q.shape[:2]
        hkv, t_max, d = kc.shape[1:]
        chex.assert_shape([k, v], (b, t, hkv, d))
        chex.assert_shape(n_new, (b,))
        steps = jnp.arange(t, dtype=jnp.int32)
        pos = self.lengths[:, None] + steps[None, :]                      # [B, T]
        # Padding rows go to index T_max, which mode="drop" discards.
        write = jnp.where(steps[None, :] < n_new[:, None], pos, t_max)
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        # Advanced indices (rows, write) around a slice put [B, T] first: [B, T, Hkv, d].
        kc = kc.at[rows, :, write, :].set(k.astype(kc.dtype), mode="drop")
        vc = vc.at[rows, :, write, :].set(v.astype(vc.dtype), mode="drop")
        kv_len = jnp.minimum(self.lengths + n_new, t_max)
        out = causal_attention(q, kc, vc, q_positions=pos, kv_lengths=kv_len)
        return out, {"k": kc, "v": vc}

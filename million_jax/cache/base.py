"""The cache protocol every KV-cache kind implements.

The model never branches on the cache type. Per layer it hands the cache the
RoPE-rotated queries/keys and the values of the new tokens and gets the
attention output back, together with the updated per-layer cache state.
Layers run under ``lax.scan``, so a cache exposes its per-layer state as a
pytree whose leaves carry a leading layer axis ``L``:

    states, consts = cache.layer_slices(cache_consts)      # leaves: [L, ...]
    def body(h, xs):
        layer_params, state, const = xs
        ...                                                  # q, k, v of this layer
        out, state = cache.attend(state, const, q, k, v, n_new)
        ...
        return h, state
    h, states = lax.scan(body, h, (params.layers, states, consts))
    cache = cache.advance(states, n_new)

Conventions (all caches):
    q:      float[B, T, H, d]    queries of the T new tokens, RoPE applied
    k, v:   float[B, T, Hkv, d]  keys (RoPE applied) / values of the new tokens
    n_new:  int32[B]             rows t < n_new[b] are real tokens, the rest
                                 padding (ragged prefill); 0 is allowed
    token t of sequence b sits at position ``lengths[b] + t``; it attends to
    every stored position <= its own. Writes past ``max_len`` are dropped,
    never out of bounds; callers check ``lengths`` before writing.

``cache_consts`` holds arrays that are constant across steps (PQ codebooks)
and must not be donated with the cache; it is ``None`` for caches that need
none. Caches are immutable pytrees: every method returns a new cache.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class KVCache(abc.ABC):
    """Abstract cache protocol (see module docstring for shapes)."""

    lengths: jax.Array  # int32[B]: tokens stored per sequence

    @property
    @abc.abstractmethod
    def max_len(self) -> int:
        """T_max: the number of positions the cache can hold per sequence."""

    @abc.abstractmethod
    def layer_slices(self, cache_consts: PyTree = None) -> tuple[PyTree, PyTree]:
        """(states, consts): pytrees with a leading layer axis, scanned over."""

    @abc.abstractmethod
    def attend(
        self,
        state: PyTree,
        const: PyTree,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        n_new: jax.Array,
    ) -> tuple[jax.Array, PyTree]:
        """Append the new tokens to one layer's state and attend.

        Returns (out: float[B, T, H, d] in q.dtype, new state of this layer).
        Uses ``self.lengths`` (before the append) for positions and masking.
        """

    def advance(self, states: PyTree, n_new: jax.Array) -> "KVCache":
        """A new cache holding ``states`` with ``lengths + n_new`` (clipped to max_len).

        ``states`` maps field names of the cache dataclass to their new arrays.
        """
        lengths = jnp.minimum(self.lengths + n_new.astype(jnp.int32), self.max_len)
        return dataclasses.replace(self, lengths=lengths, **states)

    def nbytes(self) -> int:
        """Bytes of the per-step cache state (every array leaf; cache_consts excluded)."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))


class CodesWithWindow(KVCache):
    """Shape info shared by quantized caches: codes ``k_codes [L, B, Hkv, T_max, ...]``
    plus exact ``sink_k [L, B, Hkv, S, d]`` and ``ring_k [L, B, Hkv, W, d]``."""

    k_codes: jax.Array
    sink_k: jax.Array
    ring_k: jax.Array

    @property
    def max_len(self) -> int:
        return self.k_codes.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k_codes.shape[0]

    @property
    def head_dim(self) -> int:
        return self.ring_k.shape[-1]

    @property
    def window(self) -> int:
        return self.ring_k.shape[3]

    @property
    def sinks(self) -> int:
        return self.sink_k.shape[3]

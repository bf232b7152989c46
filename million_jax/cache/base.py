"""The cache protocol every KV-cache kind implements.

A cache is two things: the per-layer state ``layers`` (a registered dataclass whose array
leaves carry a leading layer axis ``L``) and ``lengths`` (int32[B], tokens stored per
sequence, shared by every layer). The model scans over ``cache.layers`` together with its
stacked params, hands each layer's state the new tokens, and advances the cache once::

    consts = cache.layer_consts(cache_consts)        # None, or e.g. PQCodebooks [L, ...]
    def body(h, xs):
        layer_params, layer, const = xs
        ...                                          # q, k, v of this layer
        out, layer = layer.attend(const, q, k, v, cache.lengths, n_new)
        ...
        return h, layer
    h, layers = lax.scan(body, h, (params["layers"], cache.layers, consts))
    cache = cache.advance(layers, n_new)

``LayerState.attend(consts, q, k, v, lengths, n_new) -> (out, new_layer_state)`` is pure;
static settings (window, protocol, implementation) are meta fields of the layer state, so
they survive slicing, scanning and jit.

Conventions (all caches):
    q:        float[B, T, H, d]    queries of the T new tokens, RoPE applied
    k, v:     float[B, T, Hkv, d]  keys (RoPE applied) / values of the new tokens
    lengths:  int32[B]             tokens stored before this call
    n_new:    int32[B]             rows t < n_new[b] are real tokens, the rest padding
                                   (ragged prefill); 0 is allowed
    token t of sequence b sits at position ``lengths[b] + t``; it attends to every stored
    position <= its own. Writes past ``max_len`` are dropped, never out of bounds; callers
    check first: ``cache.overflow(n_new)`` (bool[B], works under jit); the model's
    ``prefill`` / ``decode_step`` raise ``CacheOverflowError`` when the lengths are concrete.

``cache_consts`` holds arrays that are constant across steps (PQ codebooks) and must not be
donated with the cache; it is ``None`` for caches that need none. Caches are immutable
pytrees: every method returns a new cache.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

__all__ = ["CACHE_DIMS", "CacheOverflowError", "LayerState", "KVCache", "check_cache_args", "register_cache", "token_rows", "write_rows"]


class LayerState(abc.ABC):
    """One layer's cache state (arrays [B, Hkv, ...]; [L, B, Hkv, ...] inside a KVCache)."""

    @property
    @abc.abstractmethod
    def max_len(self) -> int:
        """T_max: positions the cache holds per sequence (valid stacked or per layer)."""

    @abc.abstractmethod
    def attend(
        self,
        consts: PyTree,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        lengths: jax.Array,
        n_new: jax.Array,
    ) -> tuple[jax.Array, "LayerState"]:
        """Append the new tokens to this layer and attend.

        Returns (out float[B, T, H, d] in q.dtype, the new state of this layer).
        """


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A stacked per-layer state plus the shared lengths (see the module docstring)."""

    layers: Any  # a LayerState with leaves [L, ...]
    lengths: jax.Array  # int32[B]

    @property
    def max_len(self) -> int:
        """T_max: the number of positions the cache can hold per sequence."""
        return self.layers.max_len

    @property
    def num_layers(self) -> int:
        return jax.tree.leaves(self.layers)[0].shape[0]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def layer_consts(self, cache_consts: PyTree = None) -> PyTree:
        """The constants scanned with ``layers`` (leading L axis), checked against this cache.

        Caches without constants accept only ``None``.
        """
        if cache_consts is not None:
            raise ValueError(f"{type(self).__name__} takes no cache_consts (pass None)")
        return None

    def advance(self, layers: Any, n_new: jax.Array) -> "KVCache":
        """The cache holding ``layers`` with ``lengths + n_new`` (clipped to max_len)."""
        lengths = jnp.minimum(self.lengths + n_new.astype(jnp.int32), self.max_len)
        return dataclasses.replace(self, layers=layers, lengths=lengths)

    def overflow(self, n_new: jax.Array) -> jax.Array:
        """bool[B]: rows whose ``n_new`` new tokens do not all fit (the excess would be dropped).

        Works under jit: a hand-written decode loop checks it (``generate`` stops such a row
        with the reason ``cache_full``); ``prefill`` / ``decode_step`` raise
        :class:`CacheOverflowError` themselves when called with concrete values.
        """
        return self.lengths + jnp.asarray(n_new, jnp.int32) > self.max_len

    def nbytes(self) -> int:
        """Bytes of the per-step cache state (every array leaf; cache_consts excluded)."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))


class CacheOverflowError(ValueError):
    """New tokens do not fit in the cache (raised on the host, where the lengths are known)."""


# The leading constructor arguments of every cache kind, in order.
CACHE_DIMS = ("num_layers", "batch", "num_kv_heads", "max_len", "head_dim")


def check_cache_args(sizes: dict[str, int], dtype: Any, window: int = 0, sinks: int = 0) -> None:
    """ValueError naming the first bad constructor argument of a cache.

    sizes: {name in CACHE_DIMS: value}, each must be >= 1; ``window`` / ``sinks`` >= 0;
    ``dtype`` a floating type.
    """
    for name, val in sizes.items():
        if int(val) < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if window < 0 or sinks < 0:
        raise ValueError(f"window and sinks must be >= 0, got window={window}, sinks={sinks}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")


def register_cache(cls: type) -> type:
    """Register a KVCache subclass (fields ``layers``, ``lengths``) as a dataclass pytree."""
    return jax.tree_util.register_dataclass(cls, data_fields=["layers", "lengths"], meta_fields=[])


def token_rows(lengths: jax.Array, n_new: jax.Array, t: int, t_max: int) -> tuple[jax.Array, jax.Array]:
    """Positions and write rows of T new tokens.

    Returns (pos int32[B, T] = lengths + t, rows int32[B, T]): rows is ``pos`` for real tokens
    that fit (t < n_new[b] and pos < t_max), else ``t_max``, which :func:`write_rows` drops.
    """
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] + steps
    rows = jnp.where((steps < n_new[:, None]) & (pos < t_max), pos, t_max)
    return pos, rows


def write_rows(buf: jax.Array, rows: jax.Array, vals: jax.Array) -> jax.Array:
    """Scatter vals float[B, T, Hkv, ...] into buf [B, Hkv, N, ...] at rows int[B, T].

    Rows outside [0, N) are dropped (use N as the "don't write" index).
    """
    b, t = rows.shape
    bidx = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    return buf.at[bidx, :, rows].set(vals.astype(buf.dtype), mode="drop")

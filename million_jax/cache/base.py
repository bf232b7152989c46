"""The cache protocol every KV-cache kind implements.

A cache is two things: the per-layer state ``layers`` (a registered dataclass whose array
leaves carry a leading layer axis ``L``) and ``lengths`` (int32[B], tokens stored per
sequence, shared by every layer). The model loops over its stacked params; each layer reads
the cache in place and returns what it would write, and all layers are written at once after
the loop::

    consts = cache.layer_consts(cache_consts)        # None, or e.g. PQCodebooks [L, ...]
    def body(h, xs):
        i, layer_params, const = xs
        ...                                          # q, k, v of layer i
        out, writes = cache.attend(i, const, q, k, v, n_new)
        ...
        return h, writes
    h, writes = lax.scan(body, h, (jnp.arange(L), params["layers"], consts))
    cache = cache.write(writes, n_new)               # every layer's new rows; lengths += n_new

Why read first and write after the loop: a cache buffer written and then read in the same
loop iteration (or a layer sliced out and written back) makes XLA copy it, an O(T_max) cost
per layer and step (``benchmarks/carry_copy_cpu.py``). So attention reads only what was
stored before the call, through a :class:`~million_jax.attention.layer_slice.LayerSlice` view of the
stacked arrays (``layers.view(i)``), plus the call's own new tokens as a separate part merged
by log-sum-exp; the new rows ride out of the loop as small scan outputs.

``LayerState.attend(consts, q, k, v, lengths, n_new) -> (out, writes)`` is pure and never
writes; ``LayerState.write(writes)`` applies the writes to one layer's state (vmapped over
layers by ``KVCache.write``); ``LayerState.append`` does both for a single layer (e.g. one
Flax module's cache). Static settings (window, protocol, implementation) are meta fields of
the layer state, so they survive slicing, scanning and jit.

``writes``: ``{field: (rows int32[B, R], vals [B, R, Hkv, ...])}`` scatters rows into a
field ``[B, Hkv, N, ...]`` (rows outside [0, N) are dropped), ``{field: array}`` replaces a
small field whole (e.g. running statistics).

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
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.attention.layer_slice import LayerSlice
from million_jax.quant.uniform import KVBits

PyTree = Any
# field name -> (rows int32[B, R], vals [B, R, Hkv, ...]) scattered, or a whole new value
Writes = dict[str, Union[tuple[jax.Array, jax.Array], jax.Array]]

__all__ = ["CACHE_DIMS", "CacheOverflowError", "LayerState", "KVCache", "Writes", "check_cache_args",
           "check_exact_tokens", "kept_tokens", "register_cache", "token_rows", "tree_nbytes", "write_rows"]


class LayerState(abc.ABC):
    """One layer's cache state (arrays [B, Hkv, ...]; [L, B, Hkv, ...] inside a KVCache)."""

    # Fields with a token axis of T_max rows: a view reads them in place (LayerSlice); the
    # other array fields (exact sinks / window, statistics) are small and sliced out.
    TOKEN_FIELDS: ClassVar[tuple[str, ...]] = ()

    @property
    @abc.abstractmethod
    def max_len(self) -> int:
        """T_max: positions the cache holds per sequence (valid stacked, per layer or viewed)."""

    @property
    @abc.abstractmethod
    def head_dim(self) -> int:
        """d: the dimension of the key / value vectors the cache stores."""

    @abc.abstractmethod
    def attend(
        self,
        consts: PyTree,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        lengths: jax.Array,
        n_new: jax.Array,
    ) -> tuple[jax.Array, Writes]:
        """Attend q to the tokens stored before this call and to the new k, v; write nothing.

        Returns (out float[B, T, H, d] in q.dtype, the writes that append k, v).
        """

    def view(self, index: jax.Array) -> "LayerState":
        """Layer ``index`` of this stacked state, for :meth:`attend` (token fields are read in
        place through :class:`LayerSlice`; never returned or written)."""
        fields = {}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val is None:  # an optional field this state does not have
                continue
            if f.name in self.TOKEN_FIELDS:
                fields[f.name] = LayerSlice(val, index)
            elif isinstance(val, jax.Array):
                fields[f.name] = jax.lax.dynamic_index_in_dim(val, index, axis=0, keepdims=False)
        return dataclasses.replace(self, **fields)

    def write(self, writes: Writes) -> "LayerState":
        """This (unstacked) layer's state with ``writes`` applied (module docstring)."""
        new = {}
        for name, w in writes.items():
            new[name] = write_rows(getattr(self, name), *w) if isinstance(w, tuple) else w
        return dataclasses.replace(self, **new)

    def append(self, consts: PyTree, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
               n_new: jax.Array) -> tuple[jax.Array, "LayerState"]:
        """:meth:`attend`, then :meth:`write`: (out, this layer's new state), for a single layer."""
        out, writes = self.attend(consts, q, k, v, lengths, n_new)
        return out, self.write(writes)


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

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.layers, self.layers.TOKEN_FIELDS[0]).shape[2]

    @property
    def head_dim(self) -> int:
        return self.layers.head_dim

    @property
    def bits_per_element(self) -> KVBits:
        """Stored bits per key / value element: what the arrays with a token axis hold per
        token (codes and their per-token statistics), divided by the d elements of a key / value.
        Fixed-size parts (exact sinks and window, staging buffers, lengths) are not per token
        and not counted; :meth:`nbytes` counts everything. Default: the layer state's own
        ``bits_per_element`` (the dense layers state theirs)."""
        bits = getattr(type(self.layers), "bits_per_element", None)
        if bits is None:
            raise NotImplementedError(f"{type(self).__name__} does not count its bits per element")
        return self.layers.bits_per_element

    def bytes_per_token(self) -> float:
        """Bytes one more token of capacity costs: keys + values of every layer and KV head
        (:attr:`bits_per_element`; the token-axis arrays' bytes / T_max)."""
        bits = self.bits_per_element
        return self.num_layers * self.num_kv_heads * self.head_dim * (bits.key + bits.value) / 8

    def layer_consts(self, cache_consts: PyTree = None) -> PyTree:
        """The constants scanned with ``layers`` (leading L axis), checked against this cache.

        Caches without constants accept only ``None``.
        """
        if cache_consts is not None:
            raise ValueError(f"{type(self).__name__} takes no cache_consts (pass None)")
        return None

    def attend(self, layer: jax.Array, consts: PyTree, q: jax.Array, k: jax.Array, v: jax.Array,
               n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """Layer ``layer`` (int32 scalar) attends to what this cache holds plus the new k, v.

        consts: that layer's constants (a slice of :meth:`layer_consts`). Returns (out, writes);
        stack the writes of all layers (a scan output) and pass them to :meth:`write`.
        """
        return self.layers.view(layer).attend(consts, q, k, v, self.lengths, n_new)

    def write(self, writes: Writes, n_new: jax.Array) -> "KVCache":
        """The cache with every layer's writes (leaves [L, ...]) applied and ``lengths + n_new``
        (one scatter per field, vmapped over layers: in place, and sharding-friendly)."""
        layers = jax.vmap(lambda layer, w: layer.write(w))(self.layers, writes)
        return self.advance(layers, n_new)

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
        """Bytes of the per-step state (every array leaf; cache_consts excluded)."""
        return tree_nbytes(self)


def tree_nbytes(tree: PyTree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


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
    check_exact_tokens(window, sinks)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")


def check_exact_tokens(window: int, sinks: int) -> None:
    """ValueError unless the exact recent ``window`` and first ``sinks`` token counts are ints >= 0."""
    if any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0 for n in (window, sinks)):
        raise ValueError(f"window and sinks must be ints >= 0, got window={window!r}, sinks={sinks!r}")


def register_cache(cls: type) -> type:
    """Register a KVCache subclass (fields ``layers``, ``lengths``) as a dataclass pytree."""
    return jax.tree_util.register_dataclass(cls, data_fields=["layers", "lengths"], meta_fields=[])


def kept_tokens(lengths: jax.Array, n_new: jax.Array, t_max: int) -> jax.Array:
    """int32[B]: how many of the n_new new tokens fit (the rest are dropped everywhere)."""
    return jnp.clip(jnp.minimum(n_new.astype(jnp.int32), t_max - lengths), 0)


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
    """Scatter vals [B, R, Hkv, ...] into buf [B, Hkv, N, ...] at rows int[B, R].

    Rows outside [0, N) are dropped (use N as the "don't write" index). 16-bit floats are
    scattered as their uint16 bits: XLA's CPU backend runs a bf16 / fp16 scatter in float32,
    converting the whole buffer there and back.
    """
    vals = vals.astype(buf.dtype)
    if jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2:
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
        return jax.lax.bitcast_convert_type(write_rows(bits(buf), rows, bits(vals)), buf.dtype)
    b, r = rows.shape
    bidx = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, r))
    return buf.at[bidx, :, rows].set(vals, mode="drop")

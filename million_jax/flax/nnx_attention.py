"""``PQMultiHeadAttention``: ``flax.nnx.MultiHeadAttention`` with its decode cache stored as PQ codes.

Same constructor and call as the stock layer (same parameters, so a stock model's weights load
as they are), plus ``codebooks`` and the cache settings ``cache_spec``
(:class:`~million_jax.cache.spec.CacheSpec` of kind "pq": window, sinks, quantize_all, impl). Outside decode mode it *is* the stock layer. In decode mode (``decode=True`` after
``init_cache``) the new tokens' keys / values are encoded into ``nnx.Cache`` variables and the
attention is read from the codes by the library (:mod:`million_jax.flax.pq_layer`: the xla
path, or the Pallas kernel on GPU for one-token steps), plus the optional exact sinks / window.
Unlike the stock layer a decode call may carry T > 1 tokens (a causal prefill chunk), and each
sequence keeps its own length.

Overflow (more tokens than ``init_cache``'s max_length): the stock layer drops them silently;
this one does not. Called eagerly (concrete lengths) it raises
:class:`~million_jax.CacheOverflowError` naming max_length and the tokens asked for, before
anything is written. Under jit the tokens past max_length are dropped and the cache variable
``overflow`` (bool[B], sticky until the next ``init_cache``) is set for those sequences: read
``layer.overflow[...]``, or :func:`million_jax.flax.cache_overflow` (model) for all layers.

The codebooks are :class:`PQCodebook` variables (not ``nnx.Param``): split them apart and
never donate them::

    graphdef, params, books, cache = nnx.split(model, nnx.Param, PQCodebook, nnx.Cache)
    step = jax.jit(step_fn, donate_argnums=3)     # only the cache is donated

Layers are matched with a model's codebooks in ``nnx.iter_graph`` order (``pq_layers``);
:func:`attach_codebooks` sets them, :func:`calibrate_nnx` fits them on the user's inputs.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from million_jax.calibration.fit import DEFAULT_MAX_VECTORS
from million_jax.cache.spec import CacheSpec
from million_jax.flax.pq_layer import (STATE_FIELDS, attend_pq, check_layer_books, empty_pq_cache, fit_layers,
                                       layer_spec, select_layer)
from million_jax.quant.kv_codebooks import PQCodebooks

__all__ = ["PQCodebook", "PQMultiHeadAttention", "attach_codebooks", "calibrate_nnx", "pq_layers"]


class PQCodebook(nnx.Variable):
    """Constant PQ centroids float32[G, M, K, dsub] of one layer (not trained, never donated)."""


class PQMultiHeadAttention(nnx.MultiHeadAttention):
    """Drop-in for ``nnx.MultiHeadAttention`` whose decode cache is PQ codes (module docstring).

    Extra keyword arguments:
      codebooks: PQCodebooks of one layer (``num_layers == 1``), or None to attach them later
        (:func:`attach_codebooks` / :meth:`set_codebooks`); may also come as ``cache_spec.codebooks``.
      cache_spec: ``CacheSpec("pq", window=..., sinks=..., quantize_all=..., impl=...)``: the last
        ``window`` and first ``sinks`` tokens read exactly, or every token from codes
        (``quantize_all``); ``impl`` "auto" | "xla" | "pallas" (:func:`million_jax.pq_code_attention`).
        Default ``CacheSpec("pq")``. Its dtype is not used: the exact tokens are kept in the dtype
        given to :meth:`init_cache`.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, codebooks: PQCodebooks | None = None,
                 cache_spec: CacheSpec | None = None, **kwargs: Any):
        super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features,
                         **kwargs)
        self.cache_spec, spec_books = layer_spec(cache_spec, "PQMultiHeadAttention")
        if spec_books is not None:
            if codebooks is not None:
                raise ValueError("PQMultiHeadAttention: codebooks given twice (codebooks= and cache_spec.codebooks)")
            codebooks = spec_books
        self.kv_recorder: Callable | None = None  # set by calibrate_nnx
        self.key_codebook: PQCodebook | None = nnx.data(None)
        self.value_codebook: PQCodebook | None = nnx.data(None)
        for name in STATE_FIELDS:
            setattr(self, name, nnx.data(None))
        if codebooks is not None:
            self.set_codebooks(codebooks)

    # ------------------------------------------------------------------ codebooks and cache
    def set_codebooks(self, books: PQCodebooks, layer: int = 0) -> None:
        """Use layer ``layer`` of ``books`` (checked against this layer's heads and head dim)."""
        key, value = select_layer(books, layer)
        check_layer_books(key, value, self.num_kv_heads, self.head_dim, "PQMultiHeadAttention")
        self.key_codebook = PQCodebook(key)
        self.value_codebook = PQCodebook(value)

    def _books(self) -> PQCodebooks:
        if self.key_codebook is None:
            raise ValueError("PQMultiHeadAttention has no codebooks: pass codebooks=..., or call "
                             "million_jax.flax.attach_codebooks(model, books) / calibrate_nnx first")
        return check_layer_books(self.key_codebook[...], self.value_codebook[...], self.num_kv_heads,
                                 self.head_dim, "PQMultiHeadAttention")

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """An empty PQ cache for inputs [*batch, max_length, features]; ``dtype`` of the exact
        sinks / window. Needs the codebooks (they set M and the code width). Clears ``overflow``."""
        books = self._books()
        shape = tuple(input_shape)
        if (len(shape) < 2 or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1
                                      for n in shape) or shape[-1] != self.in_features):
            raise ValueError(f"PQMultiHeadAttention.init_cache: input_shape must be [*batch, max_length, features] "
                             f"of positive ints with features == in_features {self.in_features}, got {input_shape!r}")
        *batch, max_len, _ = shape
        b = math.prod(int(n) for n in batch)
        arrays = empty_pq_cache(books, b, int(max_len), self.num_kv_heads, self.cache_spec, dtype)
        for name, arr in arrays.items():
            setattr(self, name, nnx.Cache(arr))

    # ------------------------------------------------------------------ call
    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None, inputs_v: jax.Array | None = None,
                 *, mask: jax.Array | None = None, deterministic: bool | None = None, rngs=None,
                 sow_weights: bool = False, decode: bool | None = None, is_causal: bool = False,
                 out_sharding=None, qkv_sharding=None) -> jax.Array:
        """As ``nnx.MultiHeadAttention.__call__``; in decode mode the cache holds PQ codes.

        Decode mode: CacheOverflowError (eager) or the ``overflow`` flag (jit) when the T new
        tokens do not fit (module docstring).
        """
        decode = self.decode if decode is None else decode
        if self.kv_recorder is not None or not decode:
            if self.kv_recorder is not None:
                _, key, value = self._project(inputs_q, inputs_k, inputs_v, qkv_sharding)
                jax.debug.callback(self.kv_recorder, key, value, ordered=True)
            return super().__call__(inputs_q, inputs_k, inputs_v, mask=mask, deterministic=deterministic, rngs=rngs,
                                    sow_weights=sow_weights, decode=False, is_causal=is_causal,
                                    out_sharding=out_sharding, qkv_sharding=qkv_sharding)
        if mask is not None:
            raise ValueError("PQMultiHeadAttention decode: mask is not supported (the PQ cache applies the causal "
                             "mask over the stored tokens itself)")
        if self.lengths is None:
            raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
        query, key, value = self._project(inputs_q, inputs_k, inputs_v, qkv_sharding)
        arrays = {name: getattr(self, name)[...] for name in STATE_FIELDS}
        x, arrays = attend_pq(self._books(), arrays, self.cache_spec, query, key, value, "PQMultiHeadAttention")
        for name, arr in arrays.items():
            getattr(self, name)[...] = arr
        return self.out(x, out_sharding=out_sharding)

    def _project(self, inputs_q, inputs_k, inputs_v, qkv_sharding):
        """query float[*batch, T, H, d], key / value float[*batch, T, Hkv, d] (the stock projections)."""
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None.")
            inputs_k = inputs_q
        inputs_v = inputs_k if inputs_v is None else inputs_v
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} but module expects "
                             f"{self.in_features}.")
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)
        return query, key, value


def pq_layers(model: nnx.Module) -> list[tuple[tuple, PQMultiHeadAttention]]:
    """(path, layer) of every PQMultiHeadAttention in ``model``, in ``nnx.iter_graph`` order
    (the order of a model's codebooks: layer i of the codebooks goes to the i-th entry)."""
    return [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, PQMultiHeadAttention)]


def attach_codebooks(model: nnx.Module, books: PQCodebooks) -> list[tuple]:
    """Give layer i of ``books`` to the i-th PQ attention layer of ``model``; returns their paths."""
    layers = pq_layers(model)
    if not isinstance(books, PQCodebooks):
        raise ValueError(f"expected PQCodebooks, got {type(books)}")
    if books.num_layers != len(layers):
        raise ValueError(f"the codebooks are for {books.num_layers} layers, the model has {len(layers)} "
                         "PQMultiHeadAttention layers")
    for i, (path, layer) in enumerate(layers):
        try:
            layer.set_codebooks(books, i)
        except ValueError as e:
            raise ValueError(f"layer {i} at {'/'.join(map(str, path))}: {e}") from None
    return [path for path, _ in layers]


def calibrate_nnx(model: nnx.Module, inputs: Iterable[Any], *, M: int, nbits: int, granularity: str = "layer_head",
                  key: jax.Array, iters: int = 25, max_vectors: int = DEFAULT_MAX_VECTORS,
                  attach: bool = True) -> PQCodebooks:
    """Fit PQ codebooks on the keys / values the model's PQ attention layers see.

    ``model(x)`` is called for every ``x`` of ``inputs`` (a tuple is unpacked as arguments),
    with every PQ layer in its stock (non-decode) mode; feed real, unpadded text. Returns the
    PQCodebooks ([L, ...] in :func:`pq_layers` order), attached to the model when ``attach``.
    """
    layers = [layer for _, layer in pq_layers(model)]
    if not layers:
        raise ValueError("calibrate_nnx: the model has no PQMultiHeadAttention layer")
    seen: list[list] = [[] for _ in layers]
    for i, layer in enumerate(layers):
        layer.kv_recorder = lambda k, v, i=i: seen[i].append((k, v))
    try:
        for x in inputs:
            jax.block_until_ready(model(*x) if isinstance(x, tuple) else model(x))
        jax.effects_barrier()
    finally:
        for layer in layers:
            layer.kv_recorder = None
    books = fit_layers(seen, M=M, nbits=nbits, granularity=granularity, key=key, iters=iters,
                       max_vectors=max_vectors)
    if attach:
        attach_codebooks(model, books)
    return books

"""What the NNX and Linen adapters share: one layer's codebooks, its PQ cache arrays, one call.

The adapters keep the cache of one attention layer as plain arrays (``nnx.Cache`` variables,
or the Linen ``"cache"`` collection) and run it through the library's
:class:`~million_jax.cache.pq_cache.PQLayer`, so the encode, the exact sinks / window, the
kernel dispatch and the merge are the library's own. Shapes (one layer; ``*batch`` is
flattened to B):

    k_codes, v_codes:  uint8|uint16[B, Hkv, T_max, M]
    sink_k, sink_v:    float[B, Hkv, S, d]          (S = sinks, may be 0)
    ring_k, ring_v:    float[B, Hkv, W, d]          (W = window, may be 0)
    lengths:           int32[B]                     tokens stored per sequence (at most T_max)
    overflow:          bool[B]                      sticky: some call asked for more than T_max
    codebooks:         float32[G, M, K, dsub] each for keys and values, G in {1, Hkv}
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.cache.base import CacheOverflowError
from million_jax.cache.pq_cache import PQCache, PQLayer
from million_jax.cache.spec import CacheSpec
from million_jax.calibration.fit import DEFAULT_MAX_VECTORS, fit_kv_codebooks
from million_jax.quant.pq import Codebooks
from million_jax.quant.kv_codebooks import PQCodebooks

__all__ = ["CACHE_FIELDS", "STATE_FIELDS", "attend_pq", "check_layer_books", "check_room", "empty_pq_cache",
           "fit_layers", "layer_spec", "select_layer"]

CACHE_FIELDS = ("k_codes", "v_codes", "sink_k", "sink_v", "ring_k", "ring_v")
STATE_FIELDS = CACHE_FIELDS + ("lengths", "overflow")  # every array a layer keeps as its cache


def layer_spec(spec: CacheSpec | None, where: str) -> tuple[CacheSpec, PQCodebooks | None]:
    """(the spec a Flax PQ layer keeps, the codebooks it carried or None).

    ``spec``: a CacheSpec of kind "pq" (None: ``CacheSpec("pq")``). Its window, sinks,
    quantize_all and impl are used; its codebooks, if any, are returned apart (a layer holds them
    as variables, not as a setting). ``where`` names the layer in the errors.
    """
    spec = CacheSpec("pq") if spec is None else spec
    if not isinstance(spec, CacheSpec) or spec.kind != "pq":
        raise ValueError(f"{where} takes cache_spec=CacheSpec('pq', ...), got {spec!r}")
    return dataclasses.replace(spec, codebooks=None), spec.codebooks


def select_layer(books: PQCodebooks, layer: int) -> tuple[jax.Array, jax.Array]:
    """(key, value) centroids float32[G, M, K, dsub] of one layer of a model's codebooks."""
    if not isinstance(books, PQCodebooks):
        raise ValueError(f"expected PQCodebooks (million_jax.fit_kv_codebooks / load_kv_codebooks), got {type(books)}")
    if not 0 <= layer < books.num_layers:
        raise ValueError(f"layer {layer} is out of range: the codebooks are for {books.num_layers} layers")
    extras = [name for name in ("key_transform", "value_transform") if getattr(books, name) is not None]
    if books.stages > 1:
        extras.append(f"{books.stages} residual stages")
    if books.key_norms or books.value_norms:
        extras.append("explicit per-token norms")
    if books.key_rope == "pre":
        # flax's attention layers apply no RoPE: keys of such a model are not rotated, and
        # codebooks of keys before RoPE would rotate their reconstructions by position
        extras.append("keys quantized before RoPE (the Flax attention layers apply no RoPE; calibrate "
                      "these layers with calibrate_nnx / calibrate_linen)")
    if extras:
        # the Flax layers hold bare centroids: dropping these would read the codes wrongly
        raise ValueError(f"the Flax PQ layers take plain codebooks; these have {', '.join(extras)} "
                         f"({books.recipe}): use them with the model's PQCache (million_jax.PQCache)")
    return books.key.centroids[layer], books.value.centroids[layer]


def check_layer_books(key, value, num_kv_heads: int, head_dim: int, where: str = "") -> PQCodebooks:
    """One layer's centroids as a per-layer PQCodebooks (leaves [G, M, K, dsub]); ValueError if
    they do not fit ``num_kv_heads`` / ``head_dim``."""
    key, value = jnp.asarray(key, jnp.float32), jnp.asarray(value, jnp.float32)
    pre = f"{where}: " if where else ""
    if key.ndim != 4 or key.shape != value.shape:
        raise ValueError(f"{pre}codebooks must be key/value float[G, M, K, dsub] of one shape, "
                         f"got {key.shape} and {value.shape}")
    g, m, _, dsub = key.shape
    if m * dsub != head_dim:
        raise ValueError(f"{pre}codebooks are for head_dim {m * dsub} (M={m} x dsub={dsub}), the layer has "
                         f"head_dim {head_dim}")
    if g not in (1, num_kv_heads):
        raise ValueError(f"{pre}codebooks have {g} head groups, the layer has {num_kv_heads} KV heads")
    books = PQCodebooks(Codebooks(key), Codebooks(value), "layer_head" if g > 1 else "layer")
    books.key.validate()
    return books


def empty_pq_cache(books: PQCodebooks, batch: int, max_len: int, num_kv_heads: int, spec: CacheSpec,
                   dtype) -> dict[str, jax.Array]:
    """Zero cache arrays of one layer (module docstring) for ``batch`` sequences of ``max_len``;
    ``spec`` (from :func:`layer_spec`) sets the exact window / sinks, ``dtype`` their dtype."""
    cache = PQCache.create(1, batch, num_kv_heads, max_len, books.head_dim, M=books.key_M, nbits=books.key_nbits,
                           value_M=books.value_M, value_nbits=books.value_nbits,
                           window=spec.window, sinks=spec.sinks, dtype=dtype, impl=spec.impl)
    arrays = {name: getattr(cache.layers, name)[0] for name in CACHE_FIELDS}
    arrays["lengths"] = cache.lengths
    arrays["overflow"] = jnp.zeros((batch,), bool)
    return arrays


def check_room(lengths: jax.Array, n_new: int, max_len: int, where: str) -> None:
    """CacheOverflowError unless ``n_new`` more tokens fit every row of ``lengths`` int32[B].

    Checks only concrete lengths (an eager call): under jit (a Tracer) or with lengths spread
    over other hosts nothing is checked here, and the cache's sticky ``overflow`` flag records it.
    """
    if isinstance(lengths, jax.core.Tracer) or not getattr(lengths, "is_fully_addressable", True):
        return
    lens = np.asarray(lengths)
    over = np.nonzero(lens + n_new > max_len)[0]
    if over.size:
        b = int(over[0])
        raise CacheOverflowError(
            f"{where}: sequence {b} holds {int(lens[b])} of the cache's max_length={max_len} positions and "
            f"cannot take {n_new} more token{'s' if n_new != 1 else ''} ({int(lens[b]) + n_new} asked for; "
            "init the cache with a larger max_length)")


def attend_pq(books: PQCodebooks, arrays: dict[str, jax.Array], spec: CacheSpec, query: jax.Array,
              key: jax.Array, value: jax.Array, where: str = "PQ attention") -> tuple[jax.Array, dict[str, jax.Array]]:
    """Append the new tokens and attend from codes (plus the exact sinks / window).

    query float[*batch, T, H, d]; key, value float[*batch, T, Hkv, d]; ``arrays`` as made by
    :func:`empty_pq_cache`. Returns (out float[*batch, T, H, d] in query.dtype, new arrays).
    Tokens past the cache's max_len: with concrete lengths CacheOverflowError (naming ``where``)
    before anything is written; under jit they are dropped and the rows' ``overflow`` flag is set
    (it stays set until the cache is made anew).
    """
    lengths = arrays["lengths"]
    b = lengths.shape[0]
    lead = query.shape[:-3]
    if query.ndim < 4 or key.ndim != query.ndim or value.shape != key.shape:
        raise ValueError(f"{where}: query {query.shape}, key {key.shape} and value {value.shape} must be "
                         "[*batch, T, heads, head_dim] with key and value of one shape")
    if math.prod(lead) != b or key.shape[:-3] != lead:
        raise ValueError(f"{where}: the cache holds {b} sequences, got query {query.shape} / key {key.shape} "
                         "([*batch, T, heads, head_dim] with prod(batch) == the cache's batch)")
    if key.shape[-3] != query.shape[-3]:
        raise ValueError(f"{where}: key/value have {key.shape[-3]} tokens but the query has {query.shape[-3]}: a "
                         "cached (decode) call appends one key/value per query token")
    if query.shape[-3] == 0:
        raise ValueError(f"{where}: no tokens to append (T = 0 in query {query.shape})")
    codes = arrays["k_codes"]
    if key.shape[-2:] != (codes.shape[1], books.head_dim):
        raise ValueError(f"PQ cache is for {codes.shape[1]} KV heads of dim {books.head_dim}, got key {key.shape}")
    t = query.shape[-3]
    check_room(lengths, t, codes.shape[2], where)
    flat = lambda x: x.reshape((b,) + x.shape[-3:])  # noqa: E731
    # the layer's static settings are copied from the spec (checked there)
    layer = PQLayer(**{n: arrays[n] for n in CACHE_FIELDS}, quantize_all=spec.quantize_all, impl=spec.impl)
    layer.check_books(books)  # the one codes-vs-codebooks check of this call (the kernel does not repeat it)
    n_new = jnp.full((b,), t, jnp.int32)
    out, layer = layer.append(books, flat(query), flat(key), flat(value), lengths, n_new)
    new = {n: getattr(layer, n) for n in CACHE_FIELDS}
    new["lengths"] = jnp.minimum(lengths + n_new, layer.max_len)
    new["overflow"] = arrays["overflow"] | (lengths + n_new > layer.max_len)
    return out.reshape(query.shape), new


def fit_layers(kv: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], *, M: int, nbits: int,
               granularity: str = "layer_head", key: jax.Array, iters: int = 25,
               max_vectors: int = DEFAULT_MAX_VECTORS) -> PQCodebooks:
    """Codebooks from the keys / values each layer saw: ``kv[layer]`` is a list of
    (k, v) float[*batch, T, Hkv, d], one per calibration call (:func:`~million_jax.fit_kv_codebooks`)."""
    if not kv or any(not calls for calls in kv):
        raise ValueError("calibration recorded no keys/values: did the inputs run through the PQ attention layers?")

    def pool(i: int, j: int) -> np.ndarray:  # layer i, keys (0) or values (1) -> [Hkv, N, d]
        parts = [np.asarray(call[j], np.float32) for call in kv[i]]
        return np.swapaxes(np.concatenate([p.reshape((-1,) + p.shape[-2:]) for p in parts]), 0, 1)

    keys = [pool(i, 0) for i in range(len(kv))]
    values = [pool(i, 1) for i in range(len(kv))]
    shapes = {k.shape for k in keys}
    if len(shapes) != 1:
        raise ValueError(f"the attention layers saw different numbers of tokens / heads: {sorted(shapes)}")
    return fit_kv_codebooks(np.stack(keys), np.stack(values), M=M, nbits=nbits, granularity=granularity, key=key,
                            iters=iters, max_vectors=max_vectors)

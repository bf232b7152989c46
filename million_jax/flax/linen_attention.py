"""``PQMultiHeadDotProductAttention``: ``flax.linen.MultiHeadDotProductAttention`` with a PQ decode cache.

Same fields, call and parameter names as the stock layer (``query`` / ``key`` / ``value`` /
``out``, ``query_ln`` / ``key_ln``), so stock weights load as they are; extra fields
``num_kv_heads`` (GQA; None: one KV head per query head, as stock) and ``cache_spec``
(:class:`~million_jax.cache.spec.CacheSpec` of kind "pq": window, sinks, quantize_all, impl; its
codebooks stay None, they come from the collection below, and the exact tokens are kept in the
keys' dtype). With ``decode=False`` it computes what the stock layer computes.
With ``decode=True``:

* the codebooks are read from their own collection ``"pq_codebooks"`` (``{layer path: {"key":
  float32[G, M, K, dsub], "value": ...}}``, from :func:`linen_codebooks`); nothing writes it, so
  it is never mutated, and it is passed apart from ``"cache"``, so it is never donated;
* the first call with the codebooks and ``mutable=["cache"]`` creates the ``"cache"``
  collection for inputs [*batch, max_length, features] (and, like the stock layer's init call,
  attends densely over that input); ``model.init`` without codebooks creates the params only;
* later calls append their tokens' codes (T >= 1 tokens per call, a causal chunk) and read the
  attention from the codes (:mod:`million_jax.flax.pq_layer`);
* overflow (more tokens than that max_length; the stock layer drops them silently): an eager
  ``apply`` raises :class:`~million_jax.CacheOverflowError` naming max_length and the tokens
  asked for, before anything is written; under jit the tokens are dropped and the layer's
  ``"cache"`` entry ``overflow`` (bool[B], sticky until the cache is made anew) is set:
  ``state["cache"][<layer>]["overflow"]``, or :func:`million_jax.flax.cache_overflow` (state["cache"]).

    variables = {"params": params, "pq_codebooks": linen_codebooks(books, paths)}
    _, state = model.apply(variables, jnp.zeros((B, max_len, D)), mutable=["cache"])
    step = jax.jit(lambda v, cache, x: model.apply({**v, "cache": cache}, x, mutable=["cache"]),
                   donate_argnums=1)
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util

from million_jax.calibration.fit import DEFAULT_MAX_VECTORS
from million_jax.cache.spec import CacheSpec
from million_jax.flax.pq_layer import (STATE_FIELDS, attend_pq, check_layer_books, empty_pq_cache, fit_layers,
                                       layer_spec, select_layer)
from million_jax.quant.kv_codebooks import PQCodebooks

__all__ = ["CALIBRATION_COLLECTION", "CODEBOOK_COLLECTION", "PQMultiHeadDotProductAttention", "calibrate_linen",
           "linen_codebooks", "linen_pq_layers"]

CODEBOOK_COLLECTION = "pq_codebooks"
CALIBRATION_COLLECTION = "pq_calibration"  # mutable during calibration: layers sow their (key, value)


class PQMultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """Drop-in for ``nn.MultiHeadDotProductAttention`` whose decode cache is PQ codes (module docstring)."""

    num_kv_heads: int | None = None
    cache_spec: CacheSpec = CacheSpec("pq")

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None, inputs_v: jax.Array | None = None,
                 *, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
                 deterministic: bool | None = None, dropout_rng: jax.Array | None = None,
                 sow_weights: bool = False) -> jax.Array:
        """As ``nn.MultiHeadDotProductAttention.__call__``; in decode mode the cache holds PQ codes."""
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("If `inputs_kv` is given, `inputs_k` and `inputs_v` must be None.")
            inputs_k = inputs_v = inputs_kv
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None.")
            inputs_k = inputs_q
        inputs_v = inputs_k if inputs_v is None else inputs_v
        spec, books = layer_spec(self.cache_spec, "PQMultiHeadDotProductAttention")
        if books is not None:
            raise ValueError(f"PQMultiHeadDotProductAttention: give the codebooks in the {CODEBOOK_COLLECTION!r} "
                             "collection (million_jax.flax.linen_codebooks), not in cache_spec")
        qkv = self.qkv_features or inputs_q.shape[-1]
        heads, kv_heads = self.num_heads, self.num_kv_heads or self.num_heads
        if qkv % heads or heads % kv_heads:
            raise ValueError(f"qkv_features ({qkv}) must be divisible by num_heads ({heads}), and num_heads by "
                             f"num_kv_heads ({kv_heads})")
        d = qkv // heads
        dense = functools.partial(
            nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            bias_init=self.bias_init, use_bias=self.use_bias, precision=self.precision,
            dot_general=self.qkv_dot_general, dot_general_cls=self.qkv_dot_general_cls)
        query = dense(features=(heads, d), name="query")(inputs_q)
        key = dense(features=(kv_heads, d), name="key")(inputs_k)
        value = dense(features=(kv_heads, d), name="value")(inputs_v)
        if self.normalize_qk:
            norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
            query, key = norm(name="query_ln")(query), norm(name="key_ln")(key)
        calibrating = self.is_mutable_collection(CALIBRATION_COLLECTION) and not self.is_initializing()
        if calibrating:
            self.sow(CALIBRATION_COLLECTION, "kv", (key, value))
        x = _decode(self, spec, query, key, value, mask, kv_heads) if self.decode and not calibrating else None
        if x is None:
            x = _dense_attention(self, query, key, value, mask, deterministic, dropout_rng, sow_weights)
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
            kernel_init=self.out_kernel_init or self.kernel_init, bias_init=self.out_bias_init or self.bias_init,
            use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            dot_general=self.out_dot_general, dot_general_cls=self.out_dot_general_cls, name="out")(x)


def _books(module: PQMultiHeadDotProductAttention, kv_heads: int, d: int) -> PQCodebooks | None:
    if not module.has_variable(CODEBOOK_COLLECTION, "key"):
        return None
    return check_layer_books(module.get_variable(CODEBOOK_COLLECTION, "key"),
                             module.get_variable(CODEBOOK_COLLECTION, "value"), kv_heads, d,
                             f"{'/'.join(module.path)}: PQMultiHeadDotProductAttention")


def _decode(module, spec: CacheSpec, query, key, value, mask, kv_heads) -> jax.Array | None:
    """The PQ decode step (x float[*batch, T, H, d]), or None when this call creates the cache
    (or, in ``init`` without codebooks, creates none) and attends densely instead."""
    books = _books(module, kv_heads, query.shape[-1])
    if books is None and not module.is_initializing():
        raise ValueError(f"{'/'.join(module.path)}: PQMultiHeadDotProductAttention(decode=True) needs its codebooks "
                         f"in the {CODEBOOK_COLLECTION!r} collection (million_jax.flax.linen_codebooks)")
    if not module.has_variable("cache", "lengths"):
        if books is not None:
            arrays = empty_pq_cache(books, math.prod(query.shape[:-3]), query.shape[-3], kv_heads, spec,
                                    key.dtype)
            for name, arr in arrays.items():
                module.variable("cache", name, lambda a=arr: a)
        return None
    if mask is not None:
        raise ValueError("PQMultiHeadDotProductAttention decode: mask is not supported (the PQ cache applies the "
                         "causal mask over the stored tokens itself)")
    where = f"{'/'.join(module.path) or 'layer'}: PQMultiHeadDotProductAttention"
    x, arrays = attend_pq(books, {n: module.get_variable("cache", n) for n in STATE_FIELDS}, spec, query, key, value,
                          where)
    for n in STATE_FIELDS:
        module.put_variable("cache", n, arrays[n])
    return x


def _dense_attention(module, query, key, value, mask, deterministic, dropout_rng, sow_weights) -> jax.Array:
    """The stock layer's attention_fn call (GQA: KV heads repeated to the query heads)."""
    rep = query.shape[-2] // key.shape[-2]
    if rep > 1:
        key, value = jnp.repeat(key, rep, axis=-2), jnp.repeat(value, rep, axis=-2)
    if module.dropout_rate > 0.0:
        deterministic = nn.merge_param("deterministic", module.deterministic, deterministic)
        if not deterministic and dropout_rng is None:
            dropout_rng = module.make_rng("dropout")
    else:
        deterministic = True
    kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=module.dropout_rate,
                  broadcast_dropout=module.broadcast_dropout, deterministic=deterministic, dtype=module.dtype,
                  precision=module.precision, force_fp32_for_softmax=module.force_fp32_for_softmax,
                  qk_attn_weights_einsum=module.qk_attn_weights_einsum_cls and module.qk_attn_weights_einsum_cls(),
                  attn_weights_value_einsum=(module.attn_weights_value_einsum_cls
                                             and module.attn_weights_value_einsum_cls()))
    params = inspect.signature(module.attention_fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    if sow_weights:
        kwargs["module"] = module
    return module.attention_fn(query, key, value, **kwargs)


def _recorded(model: nn.Module, variables: Any, x: Any) -> dict[tuple, tuple]:
    """{layer path: ((key, value), ...)} of one call, in call order."""
    args = x if isinstance(x, tuple) else (x,)
    _, state = model.apply(variables, *args, mutable=[CALIBRATION_COLLECTION])
    flat = traverse_util.flatten_dict(dict(state.get(CALIBRATION_COLLECTION, {})))
    return {path[:-1]: calls for path, calls in flat.items()}


def linen_pq_layers(model: nn.Module, variables: Any, *args: Any) -> list[tuple[str, ...]]:
    """Paths of the PQ attention layers that ``model.apply(variables, *args)`` runs, in call order
    (the order of a model's codebooks: layer i of the codebooks goes to the i-th path)."""
    return list(_recorded(model, variables, tuple(args)))


def linen_codebooks(books: PQCodebooks, paths: list[tuple[str, ...]]) -> dict:
    """The ``"pq_codebooks"`` collection: layer i of ``books`` under ``paths[i]``."""
    if not isinstance(books, PQCodebooks):
        raise ValueError(f"expected PQCodebooks, got {type(books)}")
    if books.num_layers != len(paths):
        raise ValueError(f"the codebooks are for {books.num_layers} layers, the model has {len(paths)} "
                         "PQ attention layers")
    flat = {}
    for i, path in enumerate(paths):
        flat[tuple(path) + ("key",)], flat[tuple(path) + ("value",)] = select_layer(books, i)
    return traverse_util.unflatten_dict(flat)


def calibrate_linen(model: nn.Module, variables: Any, inputs: Iterable[Any], *, M: int, nbits: int,
                    granularity: str = "layer_head", key: jax.Array, iters: int = 25,
                    max_vectors: int = DEFAULT_MAX_VECTORS) -> tuple[PQCodebooks, list[tuple[str, ...]]]:
    """Fit PQ codebooks on the keys / values the model's PQ attention layers see.

    ``model.apply(variables, x)`` runs for every ``x`` of ``inputs`` (a tuple is unpacked),
    every PQ layer in its stock (non-decode) mode; feed real, unpadded text. Returns
    (PQCodebooks [L, ...], the layers' paths in the same order; see :func:`linen_codebooks`).
    """
    seen: dict[tuple, list] = {}
    for x in inputs:
        for path, calls in _recorded(model, variables, x).items():
            seen.setdefault(path, []).extend(calls)
    if not seen:
        raise ValueError("calibrate_linen: no PQMultiHeadDotProductAttention layer ran on the inputs")
    paths = list(seen)
    books = fit_layers([seen[p] for p in paths], M=M, nbits=nbits, granularity=granularity, key=key, iters=iters,
                       max_vectors=max_vectors)
    return books, paths

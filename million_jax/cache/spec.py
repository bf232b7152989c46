"""Build any cache kind from a model's shape and a small spec: one function for every caller.

    spec = CacheSpec("pq", codebooks=books, window=64, sinks=4)
    cache, consts = make_cache(spec, config, batch=1, max_len=4096)
    logits, cache = prefill(config, params, cache, tokens, lengths, consts)

``config`` is anything with ``n_layers``, ``n_kv_heads`` and ``head_dim`` (a
``models.LlamaConfig``, or :class:`CacheShape` for a hand-written model). ``consts`` is what
the cache reads but never changes (the PQ codebooks; ``None`` for the others): pass it as
``cache_consts`` next to the cache, and never donate it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from million_jax.cache.base import KVCache
from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache
from million_jax.cache.uniform_cache import UniformCache
from million_jax.attention.pq_dispatch import check_impl
from million_jax.quant.kv_codebooks import PQCodebooks

__all__ = ["CACHE_KINDS", "CacheShape", "CacheSpec", "make_cache"]

CACHE_KINDS = ("dense", "pq", "uniform")


class CacheShape(NamedTuple):
    """The model dimensions a cache needs (field names as in ``models.LlamaConfig``)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Which cache to build.

    kind:          "dense" | "pq" | "uniform"
    dtype:         dtype of the dense cache / of the exact sinks, window and uniform stats
    window, sinks: exact recent / first tokens of the quantized caches (0: none)
    quantize_all:  MILLION's protocol: every key/value read from codes (window/sinks unused)
    codebooks:     PQCodebooks (kind "pq")
    impl:          "auto" | "xla" | "pallas": attention over PQ codes
    bits, group_size, uniform_mode, tile: UniformCache settings (kind "uniform")
    """

    kind: str = "dense"
    dtype: Any = jnp.bfloat16
    window: int = 0
    sinks: int = 0
    quantize_all: bool = False
    codebooks: PQCodebooks | None = None
    impl: str = "auto"
    bits: int | None = None
    group_size: int = 32
    uniform_mode: str = "kivi"
    tile: int = 512

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {self.kind!r}")
        if self.window < 0 or self.sinks < 0:
            raise ValueError(f"window and sinks must be >= 0, got {self.window}, {self.sinks}")
        check_impl(self.impl)
        if self.kind == "pq" and not isinstance(self.codebooks, PQCodebooks):
            raise ValueError("a pq cache needs codebooks=PQCodebooks (see million_jax.fit_kv_codebooks)")
        if self.kind != "pq" and self.codebooks is not None:
            raise ValueError(f"codebooks are only used by a pq cache, not {self.kind!r}")
        if self.kind == "uniform" and self.bits is None:
            raise ValueError("a uniform cache needs bits (2, 4 or 8)")


def make_cache(spec: CacheSpec, model: Any, batch: int, max_len: int) -> tuple[KVCache, PQCodebooks | None]:
    """(empty cache, cache_consts) of ``spec`` for ``model``'s shape; bad settings: ValueError."""
    L, hkv, d = int(model.n_layers), int(model.n_kv_heads), int(model.head_dim)
    window, sinks = (0, 0) if spec.quantize_all else (spec.window, spec.sinks)
    if spec.kind == "dense":
        return DenseCache.create(L, batch, hkv, max_len, d, spec.dtype), None
    if spec.kind == "pq":
        books = spec.codebooks.check(L, hkv, d)
        cache = PQCache.for_codebooks(books, batch, hkv, max_len, window=window, sinks=sinks, dtype=spec.dtype,
                                      quantize_all=spec.quantize_all, impl=spec.impl)
        return cache, books
    cache = UniformCache.create(L, batch, hkv, max_len, d, bits=spec.bits, group_size=spec.group_size,
                                mode=spec.uniform_mode, window=window, sinks=sinks, dtype=spec.dtype,
                                quantize_all=spec.quantize_all, tile=spec.tile)
    return cache, None

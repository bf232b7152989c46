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

from million_jax import rope
from million_jax.cache.base import KVCache, check_exact_tokens
from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache
from million_jax.cache.uniform_cache import UniformCache
from million_jax.attention.pq_dispatch import check_impl
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.uniform import BITS as UNIFORM_BITS
from million_jax.quant.uniform import check_mode

__all__ = ["CACHE_KINDS", "CacheShape", "CacheSpec", "make_cache"]

CACHE_KINDS = ("dense", "pq", "uniform")


class CacheShape(NamedTuple):
    """The model dimensions a cache needs (field names as in ``models.LlamaConfig``)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Which cache to build: the one object that holds a cache's settings.

    The command line parses its flags into one, the Flax layers take one, and
    :func:`make_cache` builds from one; every setting is checked here, once.

    kind:          "dense" | "pq" | "uniform" (:data:`CACHE_KINDS`)
    dtype:         dtype of the dense cache / of the exact sinks, window and uniform stats
    window, sinks: exact recent / first tokens of the quantized caches (0: none)
    quantize_all:  MILLION's protocol: every key/value read from codes; window and sinks are
                   then set to 0 (nothing is kept exact)
    codebooks:     PQCodebooks (kind "pq"; may be left None where the codebooks come later,
                   e.g. a Flax layer's, but :func:`make_cache` needs them)
    impl:          "auto" | "xla" | "pallas": attention over PQ codes
    bits, group_size, uniform_mode, tile: UniformCache settings (kind "uniform"; bits required)
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
        check_exact_tokens(self.window, self.sinks)
        check_impl(self.impl)
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"dtype must be a floating type, got {self.dtype}")
        if self.codebooks is not None:
            if self.kind != "pq":
                raise ValueError(f"codebooks are only used by a pq cache, not {self.kind!r}")
            if not isinstance(self.codebooks, PQCodebooks):
                raise ValueError(f"codebooks must be PQCodebooks (see million_jax.fit_kv_codebooks), "
                                 f"got {type(self.codebooks).__name__}")
        if self.kind == "uniform":
            if self.bits is None:
                raise ValueError(f"a uniform cache needs bits (one of {UNIFORM_BITS})")
            check_mode(self.uniform_mode, self.bits, self.group_size)
            if self.tile < 1:
                raise ValueError(f"tile must be >= 1, got {self.tile}")
        elif self.bits is not None:
            raise ValueError(f"bits are a setting of a uniform cache, not of a {self.kind} cache")
        if self.quantize_all:  # MILLION's protocol keeps nothing exact
            object.__setattr__(self, "window", 0)
            object.__setattr__(self, "sinks", 0)


def make_cache(spec: CacheSpec, model: Any, batch: int, max_len: int) -> tuple[KVCache, PQCodebooks | None]:
    """(empty cache, cache_consts) of ``spec`` for ``model``'s shape; bad settings: ValueError."""
    L, hkv, d = int(model.n_layers), int(model.n_kv_heads), int(model.head_dim)
    if spec.kind == "dense":
        return DenseCache.create(L, batch, hkv, max_len, d, spec.dtype), None
    if spec.kind == "pq":
        if spec.codebooks is None:
            raise ValueError("a pq cache needs codebooks=PQCodebooks (see million_jax.fit_kv_codebooks)")
        books = spec.codebooks.check(L, hkv, d)
        if getattr(model, "rope_theta", None) is not None:  # a LLaMA-style config: RoPE known
            books.check_rope(rope.rope_inv_freq(d, model.rope_theta, getattr(model, "rope_scaling", None)))
        cache = PQCache.for_codebooks(books, batch, hkv, max_len, window=spec.window, sinks=spec.sinks,
                                      dtype=spec.dtype, quantize_all=spec.quantize_all, impl=spec.impl)
        return cache, books
    cache = UniformCache.create(L, batch, hkv, max_len, d, bits=spec.bits, group_size=spec.group_size,
                                mode=spec.uniform_mode, window=spec.window, sinks=spec.sinks, dtype=spec.dtype,
                                quantize_all=spec.quantize_all, tile=spec.tile)
    return cache, None

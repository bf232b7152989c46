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
import numpy as np

from million_jax import rope
from million_jax.cache.base import KVCache, check_exact_tokens
from million_jax.cache.dense import DenseCache
from million_jax.cache.hybrid import HybridCache
from million_jax.cache.pq_cache import PQCache
from million_jax.cache.uniform_cache import UniformCache
from million_jax.cache.kivi_cache import KiviCache, check_kivi
from million_jax.cache.turboquant_cache import TurboQuantCache, turboquant_consts
from million_jax.quant.turboquant import check_bits as check_turboquant_bits
from million_jax.attention.pq_dispatch import check_impl
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.uniform import BITS as UNIFORM_BITS
from million_jax.quant.uniform import check_mode

__all__ = ["CACHE_KINDS", "CacheShape", "CacheSpec", "make_cache"]

CACHE_KINDS = ("dense", "pq", "uniform", "turboquant", "kivi")


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
                   then set to 0 (nothing is kept exact but the ``precise_sinks``)
    precise_sinks: kind "pq": the first N tokens of every sequence kept in ``dtype`` under every
                   protocol, ``quantize_all`` included (attention reads them exactly, every other
                   token as the protocol says; with ``sinks`` the larger count is kept). A fixed
                   cost per sequence, 2 * N * L * Hkv * d values in ``dtype``, not per token: the
                   cache's ``nbytes`` counts it, its ``bits_per_element`` does not
                   (benchmarks/results/frontier: the first rows carry much of the PQ loss)
    codebooks:     PQCodebooks (kind "pq"; may be left None where the codebooks come later,
                   e.g. a Flax layer's, but :func:`make_cache` needs them)
    impl:          "auto" | "xla" | "pallas": attention over PQ / TurboQuant codes (the Pallas kernel)
    bits, group_size, uniform_mode, tile: UniformCache settings (kind "uniform"; bits required)
    kind "turboquant": ``bits`` per coordinate (2, 2.5, 3, 3.5, 4, ...; required), ``seed`` of the
                   per-layer rotations, ``qjl`` (keys spend one bit on the QJL residual)
    kind "kivi":   KIVI as published: ``bits`` 2 / 4 / 8, ``group_size`` G, ``window`` = R exact
                   recent tokens (a multiple of G; 0 with ``quantize_all``), no sinks
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
    seed: int = 0
    qjl: bool = False
    precise_sinks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {self.kind!r}")
        check_exact_tokens(self.window, self.sinks)
        n = self.precise_sinks
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"precise_sinks must be an int >= 0, got {n!r}")
        if self.precise_sinks and self.kind != "pq":
            raise ValueError(f"precise_sinks is a setting of a pq cache, not of a {self.kind} cache")
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
        elif self.kind == "turboquant":
            if self.bits is None:
                raise ValueError("a turboquant cache needs bits (e.g. 2, 2.5, 3, 3.5 or 4 per coordinate)")
            check_turboquant_bits(self.bits, qjl=self.qjl)
            if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
                raise ValueError(f"turboquant seed must be an int >= 0, got {self.seed!r}")
        elif self.kind == "kivi":
            if self.bits is None:
                raise ValueError(f"a kivi cache needs bits (one of {UNIFORM_BITS})")
            if self.sinks:
                raise ValueError(f"KIVI keeps no exact first tokens (sinks={self.sinks}); its exact tokens are the "
                                 "window of R recent ones")
            check_kivi(self.bits, self.group_size, 0 if self.quantize_all else self.window)
        elif self.bits is not None:
            raise ValueError(f"bits are a setting of a uniform, turboquant or kivi cache, not of a {self.kind} cache")
        if self.qjl and self.kind != "turboquant":
            raise ValueError(f"qjl (the QJL key residual) is a setting of a turboquant cache, not of a {self.kind} cache")
        if self.quantize_all:  # MILLION's protocol keeps nothing exact
            object.__setattr__(self, "window", 0)
            object.__setattr__(self, "sinks", 0)

    def exact_tokens(self) -> tuple[int, int, bool]:
        """(window, sinks, quantize_all) as the quantized layer state is built with them: the
        ``precise_sinks`` join the sinks, and under ``quantize_all`` they make a layer with exact
        sinks and no window (every position >= precise_sinks read from codes, the current
        token's included)."""
        sinks = max(self.sinks, self.precise_sinks)
        return self.window, sinks, self.quantize_all and not self.precise_sinks


def make_cache(spec: CacheSpec, model: Any, batch: int, max_len: int) -> tuple[KVCache, PQCodebooks | None]:
    """(empty cache, cache_consts) of ``spec`` for ``model``'s shape; bad settings: ValueError.

    A model with sliding-window layers (``model.is_sliding`` / ``model.sliding_window``, as a
    Gemma 3 config has) gets a :class:`~million_jax.cache.hybrid.HybridCache`: ``spec``'s kind for
    its global layers (codebooks for those layers only), an exact ring for the sliding ones.
    """
    sliding = tuple(getattr(model, "is_sliding", ()) or ())
    if not any(sliding):
        return _make_uniform_kind(spec, model, int(model.n_layers), batch, max_len)
    n_glob = sliding.count(False)
    glob, consts = _make_uniform_kind(spec, model, n_glob, batch, max_len)
    return HybridCache.create(glob, sliding, int(model.sliding_window), spec.dtype), consts


def _make_uniform_kind(spec: CacheSpec, model: Any, L: int, batch: int,
                       max_len: int) -> tuple[KVCache, PQCodebooks | None]:
    """The cache of ``spec.kind`` for ``L`` layers of ``model``'s heads."""
    hkv, d = int(model.n_kv_heads), int(model.head_dim)
    if spec.kind == "dense":
        return DenseCache.create(L, batch, hkv, max_len, d, spec.dtype), None
    if spec.kind == "pq":
        if spec.codebooks is None:
            raise ValueError("a pq cache needs codebooks=PQCodebooks (see million_jax.fit_kv_codebooks)")
        if spec.codebooks.num_layers != L:
            raise ValueError(f"the codebooks cover {spec.codebooks.num_layers} layers, but the model has {L} "
                             "layers that read codes (its global layers)")
        books = spec.codebooks.check(L, hkv, d)
        if getattr(model, "rope_theta", None) is not None:  # a LLaMA-style config: RoPE known
            books.check_rope(rope.rope_inv_freq(d, model.rope_theta, getattr(model, "rope_scaling", None)))
        window, sinks, quantize_all = spec.exact_tokens()
        cache = PQCache.for_codebooks(books, batch, hkv, max_len, window=window, sinks=sinks,
                                      dtype=spec.dtype, quantize_all=quantize_all, impl=spec.impl)
        return cache, books
    if spec.kind == "turboquant":
        cache = TurboQuantCache.create(L, batch, hkv, max_len, d, bits=spec.bits, qjl=spec.qjl, window=spec.window,
                                       sinks=spec.sinks, dtype=spec.dtype, quantize_all=spec.quantize_all,
                                       tile=spec.tile, impl=spec.impl)
        return cache, turboquant_consts(L, d, spec.seed, spec.qjl)
    if spec.kind == "kivi":
        return KiviCache.create(L, batch, hkv, max_len, d, bits=spec.bits, group_size=spec.group_size,
                                residual=spec.window, dtype=spec.dtype, quantize_all=spec.quantize_all,
                                tile=spec.tile), None
    cache = UniformCache.create(L, batch, hkv, max_len, d, bits=spec.bits, group_size=spec.group_size,
                                mode=spec.uniform_mode, window=spec.window, sinks=spec.sinks, dtype=spec.dtype,
                                quantize_all=spec.quantize_all, tile=spec.tile)
    return cache, None

"""Everything in this benchmark that knows the cache classes' API and layout.

``make_cache`` is the one place a cache is constructed; the rest derive caches from one it
made (``dataclasses.replace``) or describe its layout (the Pallas kernel's operand shapes).
When the cache API changes, this module is the one to adapt.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache, PQCodebooks
from models import LlamaConfig

from .settings import Settings


def make_cache(kind: str, config: LlamaConfig, batch: int, t_max: int, dtype: Any, *,
               M: int | None = None, nbits: int | None = None, window: int = 0, sinks: int = 0,
               codebooks: PQCodebooks | None = None, impl: str = "xla") -> DenseCache | PQCache:
    """An empty cache of ``t_max`` slots: ``kind`` "bf16" (the DenseCache in ``dtype``) or "pq".

    PQ: shaped by ``codebooks`` when given, else by ``M`` / ``nbits``.
    """
    c = config
    if kind == "bf16":
        return DenseCache.create(c.n_layers, batch, c.n_kv_heads, t_max, c.head_dim, dtype)
    if codebooks is None:
        return PQCache.create(c.n_layers, batch, c.n_kv_heads, t_max, c.head_dim, M=M, nbits=nbits,
                              window=window, sinks=sinks, dtype=dtype, impl=impl)
    return PQCache.for_codebooks(codebooks, batch, c.n_kv_heads, t_max,
                                 window=window, sinks=sinks, dtype=dtype, impl=impl)


def empty_cache_fn(s: Settings, config: LlamaConfig, codebooks: PQCodebooks | None, batch: int,
                   t_max: int, kind: str, impl: str) -> Callable[[], Any]:
    """A function making a row's empty cache with the run's settings (to jit or eval_shape)."""
    return functools.partial(make_cache, kind, config, batch, t_max, jnp.dtype(s.dtype), M=s.M,
                             nbits=s.nbits, window=s.window, sinks=s.sinks, codebooks=codebooks,
                             impl=impl)


def dense_prefix(dense: DenseCache, n: int) -> DenseCache:
    """The first sequence's first ``n`` tokens of a dense cache, as a one-sequence dense cache."""
    layers = dataclasses.replace(dense.layers, k=dense.layers.k[:, :1, :, :n], v=dense.layers.v[:, :1, :, :n])
    return dataclasses.replace(dense, layers=layers, lengths=jnp.full((1,), n, jnp.int32))


def min_length(cache: Any) -> int:
    """Tokens held by the shortest sequence of a cache."""
    return int(jnp.min(cache.lengths))


def max_length(cache: Any) -> int:
    """Tokens held by the longest sequence of a cache."""
    return int(jnp.max(cache.lengths))


def _hash_bits(shape: tuple[int, ...], seed: int) -> jax.Array:
    """uint32 pseudo-random bits from element coordinates (cheap: one fused elementwise pass)."""
    primes = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)
    h = jnp.full(shape, (seed * 0x61C88647 + 1) & 0xFFFFFFFF, jnp.uint32)
    for ax in range(len(shape)):
        h = h + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(primes[ax % len(primes)])
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def make_synthetic_fn(make_empty: Callable[[], Any], length: int, nbits: int = 8) -> Callable[[], Any]:
    """jit() -> a cache that already holds ``length`` tokens of pseudo-random K/V or codes.

    Codes are uniform in [0, 2**nbits); bf16 values uniform in [-2, 2). Slots past ``length``
    hold the same pseudo-random data (never read as tokens).
    """

    def run():
        cache = make_empty()
        lengths = jnp.full(cache.lengths.shape, length, jnp.int32)
        if isinstance(cache, DenseCache):
            def vals(x, seed):
                u = (_hash_bits(x.shape, seed) >> 16).astype(jnp.float32) * (4.0 / 65536.0) - 2.0
                return u.astype(x.dtype)

            lay = cache.layers
            layers = dataclasses.replace(lay, k=vals(lay.k, 1), v=vals(lay.v, 2))
            return dataclasses.replace(cache, layers=layers, lengths=lengths)
        shift = jnp.uint32(32 - nbits)  # top bits: codes in [0, 2**nbits)
        lay = cache.layers
        k_codes = (_hash_bits(lay.k_codes.shape, 3) >> shift).astype(lay.k_codes.dtype)
        v_codes = (_hash_bits(lay.v_codes.shape, 4) >> shift).astype(lay.v_codes.dtype)
        layers = dataclasses.replace(lay, k_codes=k_codes, v_codes=v_codes)
        return dataclasses.replace(cache, layers=layers, lengths=lengths)

    return jax.jit(run)


def pq_kernel_supported(config: LlamaConfig, s: Settings, batch: int, t_max: int) -> bool:
    """Whether the Pallas kernel takes the operands a PQCache of this row would pass it."""
    from pallas_kernels import pq_kernel_unsupported_reason

    c = config
    sd = jax.ShapeDtypeStruct
    dsub = c.head_dim // s.M
    code = jnp.uint8 if s.nbits <= 8 else jnp.uint16
    codes = sd((batch, c.n_kv_heads, t_max, s.M), code)
    books = sd((c.n_kv_heads, s.M, 2**s.nbits, dsub), jnp.float32)
    reason = pq_kernel_unsupported_reason(
        sd((batch, c.n_heads, c.head_dim), jnp.dtype(s.dtype)), codes, codes, books, books,
        sd((batch,), jnp.int32), sd((batch,), jnp.int32))
    return reason is None

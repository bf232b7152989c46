"""Every cache counts its own bytes: ``bits_per_element`` and ``bytes_per_token`` against the
arrays it really holds (the token-axis fields' bytes, and how ``nbytes()`` grows with T_max)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import DenseCache, PQCache, UniformCache
from million_jax.cache.query_stats import QueryStatsCache

L, B, HKV, D = 2, 3, 2, 16


def _make(kind: str, t_max: int, **kw):
    if kind == "dense":
        return DenseCache.create(L, B, HKV, t_max, D, **kw)
    if kind == "query_stats":
        return QueryStatsCache.create(L, B, HKV, t_max, D, **kw)
    if kind == "pq":
        return PQCache.create(L, B, HKV, t_max, D, **kw)
    return UniformCache.create(L, B, HKV, t_max, D, **kw)


CASES = [
    ("dense", dict(dtype=jnp.bfloat16)),
    ("dense", dict(dtype=jnp.float32)),
    ("query_stats", dict(dtype=jnp.float32)),
    ("pq", dict(M=8, nbits=8)),
    ("pq", dict(M=8, nbits=4, window=4, sinks=2)),                       # packed: 2 codes a byte
    ("pq", dict(M=4, nbits=6, value_M=8, value_nbits=4)),                # packed 6-bit keys: 3 bytes
    ("pq", dict(M=8, nbits=12, window=3)),                               # packed 12-bit: 12 bytes
    ("pq", dict(M=8, nbits=12, pack=False)),                             # one uint16 per code
    ("pq", dict(M=4, nbits=3, stages=2, sinks=1)),                       # residual: 8 codes, 3 bytes
    ("pq", dict(M=8, nbits=4, key_norms=True, value_norms=True)),        # norm-explicit: + 2 bytes each
    ("pq", dict(M=8, nbits=8, value_norms=True)),
    ("uniform", dict(bits=4, group_size=8, window=4, sinks=2)),
    ("uniform", dict(bits=2, group_size=4, dtype=jnp.float32)),
    ("uniform", dict(bits=8, mode="token")),
]


def _token_bytes(cache) -> int:
    """Bytes of the fields with a token axis (codes and their per-token statistics; optional ones
    the cache does not have are None)."""
    lay = cache.layers
    arrays = [getattr(lay, f) for f in lay.TOKEN_FIELDS if getattr(lay, f) is not None]
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in arrays)


@pytest.mark.parametrize("kind, kw", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_bytes_per_token_is_what_the_arrays_hold(kind, kw):
    t_max = 32  # a multiple of every group size: kivi key stats have one row per group
    cache = _make(kind, t_max, **kw)
    per_token = cache.bytes_per_token()
    assert per_token == _token_bytes(cache) / (t_max * B)
    bits = cache.bits_per_element
    assert per_token == L * HKV * D * (bits.key + bits.value) / 8
    # independent of which fields are counted: one more token of capacity costs per_token bytes a
    # sequence, everything else (sinks, ring, staging buffer, lengths, statistics) stays put
    longer = _make(kind, t_max + 16, **kw)
    assert longer.nbytes() - cache.nbytes() == 16 * B * per_token


@pytest.mark.parametrize("M, nbits, pack, value_M, value_nbits", [
    (8, 4, True, None, None), (4, 6, True, 8, 4), (8, 12, True, None, None), (8, 12, False, None, None),
    (16, 5, True, 2, 8), (8, 8, True, None, None)])
def test_pq_bits_per_element_follow_the_packed_width(M, nbits, pack, value_M, value_nbits):
    """Stored bits = 8 * bytes per token of the code array / d: ceil(M * nbits / 8) bytes packed
    (12-bit codes included, not a uint16 each), M uint8 / uint16 unpacked."""
    cache = PQCache.create(1, 1, 1, 8, D, M=M, nbits=nbits, value_M=value_M, value_nbits=value_nbits, pack=pack)

    def stored(m, nb):
        if nb == 8 or not pack:
            return m * (8 if nb <= 8 else 16) / D
        return 8 * math.ceil(m * nb / 8) / D

    want = (stored(M, nbits), stored(value_M or M, value_nbits or nbits))
    assert tuple(cache.bits_per_element) == pytest.approx(want)
    if pack:  # packed codes cost their information, rounded up to whole bytes per token
        assert cache.bits_per_element.key >= M * nbits / D


def test_dense_bits_are_the_dtype():
    assert tuple(DenseCache.create(1, 1, 1, 4, D, jnp.bfloat16).bits_per_element) == (16.0, 16.0)
    assert tuple(DenseCache.create(1, 1, 1, 4, D, jnp.float32).bits_per_element) == (32.0, 32.0)

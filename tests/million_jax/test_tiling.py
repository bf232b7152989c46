"""The shared tile loop (million_jax/attention/tiling.py): correct, and it never reads past the longest sequence."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax.attention.exact import tiled_dense_attention
from million_jax.cache.dense import DenseCache
from pallas_kernels.softmax import group_heads, softmax_attention, ungroup_heads


def _reference(q, k, v, lo, hi):
    """Masked softmax over all N keys at once (the shared one-shot math)."""
    n = k.shape[2]
    s = jnp.arange(n)
    mask = (s[None, None, :] >= lo[:, :, None]) & (s[None, None, :] < hi[:, :, None])  # [B, T, N]
    qg = group_heads(q, k.shape[1])
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k) / np.sqrt(q.shape[-1])
    out, _ = softmax_attention(scores, mask[:, None, None], v)
    return ungroup_heads(out)


@pytest.mark.parametrize("n, tile", [(40, 16), (48, 16), (7, 16), (33, 1)])
def test_tiled_matches_one_shot_and_ignores_rows_past_the_longest_sequence(n, tile):
    rng = np.random.default_rng(n * 100 + tile)
    b, t, h, hkv, d = 3, 2, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
    hi = rng.integers(0, min(n, tile) + 1, (b, t)).astype(np.int32)   # all within the first tile
    hi[0, 0] = min(n, tile)
    lo = np.minimum(rng.integers(0, 3, (b, t)), hi).astype(np.int32)
    want = _reference(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lo), jnp.asarray(hi))
    # every row past the first tile is NaN: reading any of it would poison the output
    k[:, :, tile:], v[:, :, tile:] = np.nan, np.nan
    got = jax.jit(tiled_dense_attention, static_argnames="tile")(q, jnp.asarray(k), jnp.asarray(v),
                                                                  jnp.asarray(lo), jnp.asarray(hi), tile=tile)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_long_rows_are_read_when_a_sequence_reaches_them():
    rng = np.random.default_rng(1)
    b, t, h, hkv, d, n = 2, 1, 2, 1, 4, 50
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, n, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, n, d)), jnp.float32)
    lo = jnp.zeros((b, t), jnp.int32)
    hi = jnp.asarray([[50], [3]], jnp.int32)     # one sequence spans every tile and the remainder
    got = tiled_dense_attention(q, k, v, lo, hi, tile=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, lo, hi)), rtol=2e-5, atol=2e-6)


def test_dense_decode_step_ignores_capacity_past_the_longest_sequence():
    """A decode step over a cache of 4 tiles with 10 tokens reads only the first tile."""
    rng = np.random.default_rng(2)
    cache = DenseCache.create(1, 2, 2, 2048, 8, jnp.float32)
    k = rng.standard_normal(cache.layers.k.shape).astype(np.float32)
    v = rng.standard_normal(cache.layers.v.shape).astype(np.float32)
    lengths = jnp.asarray([10, 4], jnp.int32)
    clean = dataclasses.replace(cache, layers=type(cache.layers)(jnp.asarray(k), jnp.asarray(v)), lengths=lengths)
    k[:, :, :, 512:], v[:, :, :, 512:] = np.nan, np.nan
    poisoned = dataclasses.replace(clean, layers=type(cache.layers)(jnp.asarray(k), jnp.asarray(v)))
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 1, 2, 8)), jnp.float32)
    out_clean, _ = attend_layer0(clean, None, q, kv, kv, jnp.ones((2,), jnp.int32))
    out_poison, _ = attend_layer0(poisoned, None, q, kv, kv, jnp.ones((2,), jnp.int32))
    assert np.isfinite(np.asarray(out_poison)).all()
    np.testing.assert_array_equal(np.asarray(out_poison), np.asarray(out_clean))

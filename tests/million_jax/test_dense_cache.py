"""DenseCache and the shared attention helper (million_jax/attention/exact.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax.attention import exact as attn_mod
from million_jax.cache.base import KVCache
from million_jax.cache.dense import DenseCache
from pallas_kernels.softmax import merge_partials

# jit once per test instead of dispatching (and compiling) every op eagerly
attention = jax.jit(attn_mod.attention, static_argnames=("scale", "return_lse"))
causal_attention = jax.jit(attn_mod.causal_attention, static_argnames=("scale", "return_lse"))
causal_mask = jax.jit(attn_mod.causal_mask, static_argnums=2)
merge_attention = jax.jit(lambda oa, la, ob, lb: merge_partials([oa, ob], [la, lb]))


def _naive(q, k, v, mask):
    """float64 reference: q [B,T,H,d], k/v [B,Hkv,S,d], mask [B,T,S] -> out, lse."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((b, t, h, v.shape[-1]))
    lse = np.full((b, t, h), -np.inf)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, hi // g].T / np.sqrt(d)      # [T, S]
            for ti in range(t):
                m = np.asarray(mask[bi, ti])
                if not m.any():
                    continue
                x = s[ti][m]
                p = np.exp(x - x.max())
                out[bi, ti, hi] = p @ v[bi, hi // g][m] / p.sum()
                lse[bi, ti, hi] = x.max() + np.log(p.sum())
    return out, lse


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_attention_matches_naive_gqa_and_lse():
    b, t, h, hkv, s, d = 2, 5, 6, 2, 9, 8
    q, k, v = _rand(0, b, t, h, d), _rand(1, b, hkv, s, d), _rand(2, b, hkv, s, d)
    mask = np.random.default_rng(3).random((b, t, s)) < 0.6
    mask[0, 1] = False                                                # one empty row
    out, lse = attention(q, k, v, mask, return_lse=True)
    ref_out, ref_lse = _naive(q, k, v, mask)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=1e-5)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5)
    assert np.all(np.isneginf(np.asarray(lse)[~finite]))
    assert not np.any(np.isnan(out)) and np.all(np.asarray(out)[0, 1] == 0)


def test_merge_attention_equals_attention_over_union():
    b, t, h, hkv, s, d = 1, 4, 4, 2, 12, 8
    q, k, v = _rand(4, b, t, h, d), _rand(5, b, hkv, s, d), _rand(6, b, hkv, s, d)
    left = np.ones((b, t, s), bool)
    left[:, :, 7:] = False
    right = ~left
    right[:, 0] = False                               # query 0 sees no key in the right part
    oa, la = attention(q, k, v, left, return_lse=True)
    ob, lb = attention(q, k, v, right, return_lse=True)
    out, lse = merge_attention(oa, la, ob, lb)
    ref, ref_lse = attention(q, k, v, left | right, return_lse=True)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_causal_mask_positions_and_lengths():
    m = causal_mask(jnp.array([[2, 3], [0, 1]]), jnp.array([3, 1]), 5)
    expect = np.array([[[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]],
                       [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]], bool)
    np.testing.assert_array_equal(m, expect)


def test_causal_attention_bf16_inputs_close_to_fp32():
    q, k, v = _rand(7, 1, 6, 4, 16), _rand(8, 1, 2, 6, 16), _rand(9, 1, 2, 6, 16)
    ref = causal_attention(q, k, v)
    bf = jnp.bfloat16
    out = causal_attention(jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=5e-2)


def test_create_shapes_protocol_and_nbytes():
    c = DenseCache.create(3, 2, 4, 16, 8, jnp.bfloat16)
    assert isinstance(c, KVCache)
    assert c.layers.k.shape == c.layers.v.shape == (3, 2, 4, 16, 8) and c.layers.k.dtype == jnp.bfloat16
    assert c.lengths.dtype == jnp.int32 and c.max_len == 16
    assert c.nbytes() == 2 * 3 * 2 * 4 * 16 * 8 * 2 + 2 * 4
    assert c.layer_consts(None) is None and c.num_layers == 3
    with pytest.raises(ValueError, match="cache_consts"):
        c.layer_consts(object())
    leaves, treedef = jax.tree.flatten(c)
    assert len(leaves) == 3 and isinstance(jax.tree.unflatten(treedef, leaves), DenseCache)


def _attend_layer0(cache, q, k, v, n_new):
    return attend_layer0(cache, None, q, k, v, n_new)


def test_attend_writes_ragged_rows_and_matches_reference():
    b, t, h, hkv, d, tmax = 2, 4, 4, 2, 8, 10
    cache = DenseCache.create(1, b, hkv, tmax, d, jnp.float32)
    q, k, v = _rand(10, b, t, h, d), _rand(11, b, t, hkv, d), _rand(12, b, t, hkv, d)
    out, cache = jax.jit(_attend_layer0)(cache, q, k, v, jnp.array([4, 2]))
    np.testing.assert_array_equal(cache.lengths, [4, 2])
    kk = np.asarray(cache.layers.k[0])                                    # [B, Hkv, T_max, d]
    np.testing.assert_array_equal(kk[0, :, :4], np.asarray(k[0]).transpose(1, 0, 2))
    np.testing.assert_array_equal(kk[1, :, :2], np.asarray(k[1, :2]).transpose(1, 0, 2))
    assert np.all(kk[1, :, 2:] == 0) and np.all(kk[0, :, 4:] == 0)  # padding never written
    ref, _ = _naive(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                    np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
    np.testing.assert_allclose(out[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(out[1, :2], ref[1, :2], atol=1e-5)

    # Second call appends after the stored tokens and attends to all of them.
    q2, k2, v2 = _rand(13, b, 1, h, d), _rand(14, b, 1, hkv, d), _rand(15, b, 1, hkv, d)
    out2, cache = jax.jit(_attend_layer0)(cache, q2, k2, v2, jnp.array([1, 1]))
    np.testing.assert_array_equal(cache.lengths, [5, 3])
    np.testing.assert_array_equal(np.asarray(cache.layers.k)[0, 1, :, 2], k2[1, 0])
    kall = np.concatenate([k[1:, :2], k2[1:]], axis=1).transpose(0, 2, 1, 3)
    vall = np.concatenate([v[1:, :2], v2[1:]], axis=1).transpose(0, 2, 1, 3)
    ref2, _ = _naive(q2[1:], kall, vall, np.ones((1, 1, 3), bool))
    np.testing.assert_allclose(out2[1:], ref2, atol=1e-5)


def test_writes_past_max_len_are_dropped_not_wrapped():
    b, hkv, d, tmax = 1, 1, 4, 6
    cache = DenseCache.create(1, b, hkv, tmax, d, jnp.float32)
    first = np.ones((b, 5, hkv, d), np.float32)
    _, cache = jax.jit(_attend_layer0)(cache, _rand(16, b, 5, 2, d), first, first, jnp.array([5]))
    second = np.broadcast_to(np.array([7.0, 8.0, 9.0], np.float32)[None, :, None, None],
                             (b, 3, hkv, d)).copy()         # distinct per token: 8, 9 must drop
    out, cache = jax.jit(_attend_layer0)(cache, _rand(17, b, 3, 2, d), second, second,
                                         jnp.array([3]))
    assert int(cache.lengths[0]) == tmax                           # clipped
    kk = np.asarray(cache.layers.k[0, 0, 0, :, 0])
    np.testing.assert_array_equal(kk, [1, 1, 1, 1, 1, 7])          # slot 0.. untouched
    assert np.all(np.isfinite(out))


def test_jit_donation_keeps_cache_usable():
    cache = DenseCache.create(2, 1, 1, 8, 4, jnp.float32)
    step = jax.jit(lambda c: c.advance(c.layers, jnp.array([1])), donate_argnums=0)
    new = step(cache)
    assert int(new.lengths[0]) == 1 and new.layers.k.shape == (2, 1, 1, 8, 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_output_dtype_follows_q(dtype):
    cache = DenseCache.create(1, 1, 1, 4, 8, dtype)
    q = jnp.asarray(_rand(18, 1, 1, 2, 8), dtype)
    kv = jnp.asarray(_rand(19, 1, 1, 1, 8), dtype)
    out, _ = jax.jit(_attend_layer0)(cache, q, kv, kv, jnp.array([1]))
    assert out.dtype == dtype
    # a single visible key: attention returns exactly its value
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float32),
                               np.repeat(np.asarray(kv[0, 0], np.float32), 2, 0), atol=1e-2)

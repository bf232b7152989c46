"""Cache paths agree with the cache-free forward: decode, ragged batches, chunked prefill."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cast_params, decode_step, forward, init_cache, prefill, preset
from models.config import RopeScaling

CONFIG = preset("tiny").replace(
    rope_scaling=RopeScaling("llama3", 4.0, 1.0, 4.0, original_max_position_embeddings=8))


def _tokens(b, t, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab, (b, t)).astype(np.int32)


def test_prefill_then_decode_equals_forward(params):
    toks = _tokens(2, 12)
    full = np.asarray(forward(CONFIG, params, toks))
    cache = init_cache(CONFIG, 2, 16, jnp.float32)
    logits, cache = prefill(CONFIG, params, cache, toks[:, :7], np.array([7, 7]))
    np.testing.assert_allclose(logits, full[:, :7], atol=2e-5, rtol=1e-5)
    for i in range(7, 12):
        step, cache = decode_step(CONFIG, params, cache, toks[:, i])
        np.testing.assert_allclose(step, full[:, i], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    # the logits are not trivially position independent
    assert np.abs(full[:, 7] - full[:, 8]).max() > 1e-2


def test_ragged_batch_equals_sequences_alone(params):
    lengths = np.array([7, 3, 5])
    toks = _tokens(3, 8, seed=1)               # positions past lengths[b] are junk padding
    nxt = _tokens(3, 3, seed=2)
    cache = init_cache(CONFIG, 3, 12, jnp.float32)
    logits, cache = prefill(CONFIG, params, cache, toks, lengths)
    last, _ = prefill(CONFIG, params, init_cache(CONFIG, 3, 12, jnp.float32), toks, lengths,
                      last_only=True)
    steps = []
    for i in range(3):
        s, cache = decode_step(CONFIG, params, cache, nxt[:, i])
        steps.append(np.asarray(s))
    np.testing.assert_array_equal(cache.lengths, lengths + 3)
    for b, n in enumerate(lengths):
        alone = np.concatenate([toks[b, :n], nxt[b]])[None]
        ref = np.asarray(forward(CONFIG, params, np.pad(alone, ((0, 0), (0, 11 - alone.shape[1])))))
        np.testing.assert_allclose(logits[b, :n], ref[0, :n], atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(last[b], ref[0, n - 1], atol=2e-5, rtol=1e-5)
        for i in range(3):
            np.testing.assert_allclose(steps[i][b], ref[0, n + i], atol=2e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot(params):
    toks = _tokens(2, 12, seed=3)
    one_logits, one = prefill(CONFIG, params, init_cache(CONFIG, 2, 16, jnp.float32), toks,
                              np.array([12, 9]))
    cache = init_cache(CONFIG, 2, 16, jnp.float32)
    # chunks of different sizes per sequence: [5, 4] then the rest [7, 5]
    first = np.zeros((2, 7), np.int32)
    first[0, :5], first[1, :4] = toks[0, :5], toks[1, :4]
    l1, cache = prefill(CONFIG, params, cache, first, np.array([5, 4]))
    second = np.zeros((2, 7), np.int32)
    second[0, :7], second[1, :5] = toks[0, 5:12], toks[1, 4:9]
    l2, cache = prefill(CONFIG, params, cache, second, np.array([7, 5]))
    np.testing.assert_array_equal(cache.lengths, one.lengths)
    np.testing.assert_allclose(cache.layers.k[:, 0, :, :12], one.layers.k[:, 0, :, :12], atol=1e-5)
    np.testing.assert_allclose(cache.layers.v[:, 1, :, :9], one.layers.v[:, 1, :, :9], atol=1e-5)
    np.testing.assert_allclose(l1[0, :5], one_logits[0, :5], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(l2[0, :7], one_logits[0, 5:12], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(l2[1, :5], one_logits[1, 4:9], atol=2e-5, rtol=1e-5)


def test_bf16_params_and_cache(params):
    p16 = cast_params(params, jnp.bfloat16)
    toks = _tokens(1, 10, seed=4)
    ref32 = np.asarray(forward(CONFIG, params, toks))
    full16 = np.asarray(forward(CONFIG, p16, toks))
    assert full16.dtype == np.float32
    cache = init_cache(CONFIG, 1, 16, jnp.bfloat16)
    logits, cache = prefill(CONFIG, p16, cache, toks[:, :6], np.array([6]))
    for i in range(6, 10):
        step, cache = decode_step(CONFIG, p16, cache, toks[:, i])
        np.testing.assert_allclose(step, full16[:, i], atol=0.1 * np.abs(full16).max())
    assert cache.layers.k.dtype == jnp.bfloat16
    scale = np.abs(ref32).max()
    assert np.abs(full16 - ref32).max() < 0.1 * scale


def test_decode_inactive_rows_are_frozen(params):
    toks = _tokens(2, 4, seed=5)
    cache = init_cache(CONFIG, 2, 8, jnp.float32)
    _, cache = prefill(CONFIG, params, cache, toks, np.array([4, 4]))
    before = np.asarray(cache.layers.k)          # decode_step donates the cache
    _, after = decode_step(CONFIG, params, cache, toks[:, 0], active=np.array([True, False]))
    np.testing.assert_array_equal(after.lengths, [5, 4])
    np.testing.assert_array_equal(after.layers.k[:, 1], before[:, 1])
    assert np.abs(np.asarray(after.layers.k[:, 0, :, 4])).max() > 0

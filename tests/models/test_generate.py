"""generate(): greedy equals an argmax loop; per-sequence EOS / max_tokens / cache_full stops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from logp_reference import continuation_logp

from models import (STOP_CACHE_FULL, STOP_EOS, STOP_MAX_TOKENS, forward, generate, init_cache, prefill,
                    preset, sample_logits)

CONFIG = preset("tiny")
PROMPTS = np.array([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]], np.int32)
LENGTHS = np.array([5, 3], np.int32)


@pytest.fixture(scope="module")
def greedy_ref(params):
    """Per prompt, 10 greedy tokens from a Python loop of argmax over the full forward."""
    fwd = jax.jit(lambda t: forward(CONFIG, params, t))
    out = []
    for b, n in enumerate(LENGTHS):
        seq = list(PROMPTS[b, :n])
        gen = []
        for _ in range(10):
            padded = np.zeros((1, 16), np.int32)                 # one shape: one compile
            padded[0, : len(seq)] = seq
            tok = int(np.argmax(np.asarray(fwd(padded))[0, len(seq) - 1]))
            gen.append(tok)
            seq.append(tok)
        out.append(gen)
    return out


def _gen(params, max_len=32, **kw):
    cache = init_cache(CONFIG, 2, max_len, jnp.float32)
    return generate(CONFIG, params, cache, PROMPTS, LENGTHS, **kw)


def test_greedy_equals_argmax_loop(params, greedy_ref):
    res = _gen(params, max_new_tokens=8, eos_id=())
    assert res.tokens.shape == (2, 8)
    assert res.sequences() == [g[:8] for g in greedy_ref]
    assert res.stop_reasons() == ["max_tokens", "max_tokens"]
    # the last emitted token is not in the cache
    np.testing.assert_array_equal(res.cache.lengths, LENGTHS + 7)


def test_eos_stops_each_sequence_on_its_own(params, greedy_ref):
    seq0 = greedy_ref[0]
    # an EOS id that first appears at position k >= 2 of sequence 0's greedy output
    k = next(i for i in range(2, 10) if seq0[i] not in seq0[:i])
    eos = seq0[k]
    res = _gen(params, max_new_tokens=10, eos_id=eos, pad_id=-1)
    got = res.sequences()
    assert got[0] == seq0[: k + 1] and res.stop_reasons()[0] == "eos"
    seq1 = greedy_ref[1]
    stop1 = seq1.index(eos) + 1 if eos in seq1 else 10
    assert got[1] == seq1[:stop1]
    assert int(res.stop_reason[1]) == (STOP_EOS if eos in seq1 else STOP_MAX_TOKENS)
    assert np.all(np.asarray(res.tokens)[0, k + 1:] == -1)       # padding after the stop
    # a stopped sequence is frozen: its cache holds prompt + generated - 1 tokens
    np.testing.assert_array_equal(res.cache.lengths, LENGTHS + np.asarray(res.num_generated) - 1)
    # several EOS ids: the earliest one wins
    res2 = _gen(params, max_new_tokens=10, eos_id=(seq0[1], eos))
    assert res2.sequences()[0] == seq0[:2]


def test_cache_full_stops_without_writing_out_of_bounds(params, greedy_ref):
    max_len = 8
    res = _gen(params, max_len=max_len, max_new_tokens=5, eos_id=())
    # seq 0: prompt 5 leaves room to append 3 tokens, so it emits 4 and reports cache_full
    assert res.sequences()[0] == greedy_ref[0][:4]
    assert int(res.stop_reason[0]) == STOP_CACHE_FULL
    # seq 1 (prompt 3) reaches max_new_tokens first
    assert res.sequences()[1] == greedy_ref[1][:5]
    assert int(res.stop_reason[1]) == STOP_MAX_TOKENS
    np.testing.assert_array_equal(res.cache.lengths, [8, 7])
    # the cache holds exactly prompt + first 3 generated tokens (nothing clobbered)
    full = np.array([list(PROMPTS[0]) + greedy_ref[0][:3]], np.int32)
    _, ref = prefill(CONFIG, params, init_cache(CONFIG, 1, max_len, jnp.float32), full,
                     np.array([8]))
    np.testing.assert_allclose(res.cache.layers.k[:, 0], ref.layers.k[:, 0], atol=1e-5)


def test_prompt_that_does_not_fit_reports_cache_full(params):
    cache = init_cache(CONFIG, 2, 4, jnp.float32)
    res = generate(CONFIG, params, cache, PROMPTS, LENGTHS, max_new_tokens=3, eos_id=())
    assert int(res.num_generated[0]) == 0 and int(res.stop_reason[0]) == STOP_CACHE_FULL
    assert res.sequences()[1] and int(res.cache.lengths[0]) == 4


def test_generate_continues_a_filled_cache(params, greedy_ref):
    """A second turn: generate after a previous prefill appends to the cache."""
    cache = init_cache(CONFIG, 2, 32, jnp.float32)
    first = np.array([[11, 12], [21, 0]], np.int32)
    _, cache = prefill(CONFIG, params, cache, first, np.array([2, 1]))
    rest = np.array([[13, 14, 15], [22, 23, 0]], np.int32)
    res = generate(CONFIG, params, cache, rest, np.array([3, 2]), max_new_tokens=8, eos_id=())
    assert res.sequences() == [g[:8] for g in greedy_ref]


def test_sampling_settings(params, greedy_ref):
    key = jax.random.key(7)
    topk1 = _gen(params, max_new_tokens=8, eos_id=(), temperature=1.0, top_k=1, key=key)
    assert topk1.sequences() == [g[:8] for g in greedy_ref]
    tiny_p = _gen(params, max_new_tokens=8, eos_id=(), temperature=1.0, top_p=1e-6, key=key)
    assert tiny_p.sequences() == [g[:8] for g in greedy_ref]
    a = _gen(params, max_new_tokens=8, eos_id=(), temperature=2.0, key=key)
    b = _gen(params, max_new_tokens=8, eos_id=(), temperature=2.0, key=key)
    c = _gen(params, max_new_tokens=8, eos_id=(), temperature=2.0, key=jax.random.key(8))
    assert a.sequences() == b.sequences() != c.sequences()
    with pytest.raises(ValueError, match="PRNG key"):
        _gen(params, max_new_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(CONFIG, params, init_cache(CONFIG, 2, 8), PROMPTS, np.array([0, 3]),
                 max_new_tokens=2)


def test_sample_logits_respects_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.3, 0.2, 0.05]]))
    draw = jax.jit(jax.vmap(lambda k, tk, tp: sample_logits(logits, k, 1.0, tk, tp)[0],
                            in_axes=(0, None, None)), static_argnums=(1, 2))
    keys = jax.random.split(jax.random.key(0), 2000)
    assert set(np.asarray(draw(keys, 2, 1.0)).tolist()) == {1, 2}
    assert set(np.asarray(draw(keys, 0, 0.65)).tolist()) == {1, 2}          # 0.4 + 0.3 >= 0.65
    freq = np.bincount(np.asarray(draw(keys, 0, 1.0)), minlength=5) / 2000
    np.testing.assert_allclose(freq, [0.05, 0.4, 0.3, 0.2, 0.05], atol=0.04)
    assert int(sample_logits(logits, keys[0])[0]) == 1                        # greedy


def test_cache_is_donated(params):
    cache = init_cache(CONFIG, 2, 32, jnp.float32)
    res = generate(CONFIG, params, cache, PROMPTS, LENGTHS, max_new_tokens=8, eos_id=())
    assert res.cache.layers.k.shape == cache.layers.k.shape
    if jax.default_backend() in ("cpu", "gpu"):
        assert cache.layers.k.is_deleted()


def test_forced_logp_matches_a_full_forward_and_leaves_the_answer_alone(params, greedy_ref):
    rng = np.random.default_rng(7)
    forced = rng.integers(1, CONFIG.vocab, size=(2, 4)).astype(np.int32)
    res = _gen(params, max_new_tokens=6, eos_id=(), forced=forced)
    assert res.sequences() == [g[:6] for g in greedy_ref]       # the answer starts from the prompt cache
    np.testing.assert_array_equal(res.cache.lengths, LENGTHS + 5)
    got = np.asarray(res.forced_logp)
    assert got.shape == (2, 4) and got.dtype == np.float32
    for b, n in enumerate(LENGTHS):
        ref = continuation_logp(CONFIG, params, list(PROMPTS[b, :n]), list(forced[b]))
        np.testing.assert_allclose(got[b], ref, atol=2e-4, rtol=1e-4)
    assert _gen(params, max_new_tokens=2).forced_logp is None


def test_forced_logp_of_the_greedy_answer_is_each_steps_max(params, greedy_ref):
    """Forcing the greedy answer: every entry is the max log-softmax of its step (the sampler's argmax)."""
    forced = np.asarray([g[:4] for g in greedy_ref], np.int32)
    res = _gen(params, max_new_tokens=4, eos_id=(), forced=forced)
    for b, n in enumerate(LENGTHS):
        seq = np.asarray([list(PROMPTS[b, :n]) + greedy_ref[b][:3]], np.int32)
        lp = jax.nn.log_softmax(np.asarray(forward(CONFIG, params, seq), np.float32)[0], axis=-1)
        np.testing.assert_allclose(np.asarray(res.forced_logp)[b], lp[n - 1: n + 3].max(-1), atol=2e-4)


def test_ragged_forced_padded_at_the_end(params):
    """A row padded after its real continuation scores its real tokens as an unpadded call does."""
    full = np.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32)
    padded = full.copy()
    padded[1, 2:] = 0
    a = np.asarray(_gen(params, max_new_tokens=1, forced=full).forced_logp)
    b = np.asarray(_gen(params, max_new_tokens=1, forced=padded).forced_logp)
    np.testing.assert_allclose(b[0], a[0], atol=1e-5)
    np.testing.assert_allclose(b[1, :2], a[1, :2], atol=1e-5)
    assert not np.allclose(b[1, 2:], a[1, 2:], atol=1e-3)   # the padding's entries differ: ignore them


def test_forced_without_room_or_fit_is_nan(params):
    forced = np.ones((2, 4), np.int32)
    res = _gen(params, max_len=6, max_new_tokens=1, forced=forced)   # row 0: 1 free row, row 1: 3
    lp = np.asarray(res.forced_logp)
    assert np.all(np.isfinite(lp[0, :2])) and np.all(np.isnan(lp[0, 2:]))
    assert np.all(np.isfinite(lp[1]))
    res = _gen(params, max_len=4, max_new_tokens=1, forced=forced)   # row 0's prompt does not fit
    assert np.all(np.isnan(np.asarray(res.forced_logp)[0]))


@pytest.mark.parametrize("forced, match", [
    (np.ones((3, 2), np.int32), "forced must be int"),
    (np.ones((2, 0), np.int32), "forced must be int"),
    (np.ones((2,), np.int32), "forced must be int"),
    (np.ones((2, 2), np.float32), "integer token ids"),
    (np.full((2, 2), CONFIG.vocab, np.int32), "forced token ids"),
    (np.full((2, 2), -1, np.int32), "forced token ids"),
])
def test_bad_forced_is_named(params, forced, match):
    with pytest.raises(ValueError, match=match):
        _gen(params, max_new_tokens=2, forced=forced)

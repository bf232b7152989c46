"""prefill_prompt / generate(prefill_chunk=n): the prompt in forwards of n tokens gives the one-shot prefill's
last-token logits, cache and greedy tokens (ragged rows, chunks shorter and longer than the
sliding window, dense / PQ / turboquant caches, LLaMA and Gemma 3 layouts)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import CacheSpec, fit_kv_codebooks, make_cache
from models import generate, init_params, prefill, prefill_prompt, preset
from models.generate import _prefill_last

LENGTHS = np.array([29, 17], np.int32)


def _setup(model: str, kind: str):
    cfg = preset(model)
    params = init_params(cfg, jax.random.key(3), jnp.float32, stddev=0.2)
    if kind == "dense":
        spec = CacheSpec("dense", dtype=jnp.float32)
    elif kind == "pq":
        n_glob = sum(not s for s in cfg.is_sliding) if cfg.sliding_window else cfg.n_layers
        cal = np.random.default_rng(0).standard_normal(
            (n_glob, cfg.n_kv_heads, 1024, cfg.head_dim)).astype(np.float32)
        books = fit_kv_codebooks(cal, cal, M=cfg.head_dim // 2, nbits=6, key=jax.random.key(0), iters=2)
        spec = CacheSpec("pq", codebooks=books, window=4, sinks=2, dtype=jnp.float32)
    else:
        spec = CacheSpec("turboquant", bits=4, dtype=jnp.float32)
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, cfg.vocab, (2, int(LENGTHS.max()))).astype(np.int32)
    tokens[1, LENGTHS[1]:] = 0
    return cfg, params, spec, tokens


def _leaves(cache):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(cache)]


@pytest.mark.parametrize("model,kind", [("tiny", "dense"), ("tiny", "pq"), ("tiny-gemma3", "dense"),
                                        ("tiny-gemma3", "pq"), ("tiny-gemma3", "turboquant")])
@pytest.mark.parametrize("chunk", [5, 11])
def test_chunked_prefill_equals_one_shot(model, kind, chunk):
    cfg, params, spec, tokens = _setup(model, kind)
    lengths = jnp.asarray(LENGTHS)
    runs = {}
    for c in (None, chunk):
        cache, consts = make_cache(spec, cfg, batch=2, max_len=40)
        runs[c] = jax.jit(lambda ca, c=c, consts=consts: _prefill_last(cfg, params, ca, jnp.asarray(tokens),
                                                                       lengths, consts, c))(cache)
    (one_logits, one_cache), (ch_logits, ch_cache) = runs[None], runs[chunk]
    assert np.abs(np.asarray(one_logits)).max() > 0
    np.testing.assert_allclose(ch_logits, one_logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(ch_cache.lengths, LENGTHS)
    a, b = _leaves(one_cache), _leaves(ch_cache)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        if x.size == 0:
            continue
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(y, x, atol=1e-4, rtol=1e-4)
        else:  # codes: a code may flip where two centroids are near-equidistant
            assert np.mean(x != y) < 0.01


@pytest.mark.parametrize("model", ["tiny", "tiny-gemma3"])
def test_generate_in_chunks_gives_the_same_tokens(model):
    cfg, params, spec, tokens = _setup(model, "dense")
    out = {}
    for c in (None, 6):
        cache, consts = make_cache(spec, cfg, batch=2, max_len=48)
        res = generate(cfg, params, cache, tokens, LENGTHS, max_new_tokens=8, eos_id=(),
                       cache_consts=consts, prefill_chunk=c)
        out[c] = res.sequences()
        np.testing.assert_array_equal(res.cache.lengths, LENGTHS + 7)
    assert out[6] == out[None]


def test_row_that_ends_in_an_early_chunk_keeps_its_logits():
    """Row 1 (17 tokens) ends in chunk 2 of 4: later chunks give it 0 tokens and must not
    replace its logits or its cache rows; a mutation (logits from the last chunk) fails here."""
    cfg, params, spec, tokens = _setup("tiny", "dense")
    cache, _ = make_cache(spec, cfg, batch=2, max_len=40)
    logits, cache = prefill_prompt(cfg, params, cache, tokens, LENGTHS, prefill_chunk=8)
    cache1, _ = make_cache(spec, cfg, batch=1, max_len=40)
    alone, _ = prefill(cfg, params, cache1, jnp.asarray(tokens[1:, :17]), jnp.asarray(LENGTHS[1:]), None,
                       last_only=True)
    np.testing.assert_allclose(logits[1], alone[0], atol=1e-4, rtol=1e-4)


def test_prefill_prompt_in_chunks_matches_prefill_last_only():
    """The public, jitted entry point: chunked (7) and whole-prompt (None) logits and lengths
    equal ``prefill(last_only=True)``'s."""
    cfg, params, spec, tokens = _setup("tiny-gemma3", "pq")
    ref_cache, consts = make_cache(spec, cfg, batch=2, max_len=40)
    ref, _ = prefill(cfg, params, ref_cache, jnp.asarray(tokens), jnp.asarray(LENGTHS), consts, last_only=True)
    for chunk in (None, 7):
        cache, consts = make_cache(spec, cfg, batch=2, max_len=40)
        logits, cache = prefill_prompt(cfg, params, cache, tokens, LENGTHS, consts, prefill_chunk=chunk)
        np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(cache.lengths, LENGTHS)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_bad_prefill_chunk_is_named(bad):
    cfg, params, spec, tokens = _setup("tiny", "dense")
    cache, _ = make_cache(spec, cfg, batch=2, max_len=40)
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(cfg, params, cache, tokens, LENGTHS, max_new_tokens=2, prefill_chunk=bad)
    with pytest.raises(ValueError, match="prefill_chunk"):
        prefill_prompt(cfg, params, cache, tokens, LENGTHS, prefill_chunk=bad)

"""Linen drop-in: PQMultiHeadDotProductAttention against an independent reference, the stock layer and jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from million_jax import CacheOverflowError, CacheSpec
from million_jax.flax import (CODEBOOK_COLLECTION, PQMultiHeadDotProductAttention, cache_overflow, calibrate_linen,
                              linen_codebooks)
from million_jax.flax.linen_attention import linen_pq_layers

from flax_models import (D_MODEL, HEADS, MAX_LEN, VOCAB, LinenDecoder, assert_nearest_codes, project, stored_codes,
                         random_books, reference_attention, to_np)

HKV, HEAD_DIM = 2, D_MODEL // HEADS


@pytest.mark.slow
def test_decode_equals_reference_attention_from_codes():
    window, sinks = 2, 1
    layer = PQMultiHeadDotProductAttention(num_heads=HEADS, num_kv_heads=HKV, decode=True,
                                           cache_spec=CacheSpec("pq", window=window, sinks=sinks, impl="xla"))
    x = np.random.default_rng(0).standard_normal((2, 8, D_MODEL)).astype(np.float32)
    params = layer.init(jax.random.PRNGKey(0), jnp.asarray(x))["params"]  # params only: no codebooks yet
    books = random_books(1, HKV, HEAD_DIM, M=4, nbits=5)
    variables = {"params": params, CODEBOOK_COLLECTION: linen_codebooks(books, [()])}
    _, state = layer.apply(variables, jnp.zeros((2, 12, D_MODEL)), mutable=["cache"])
    kb, vb = (to_np(c[0]) for c in (books.key.centroids, books.value.centroids))
    q, k, v = (project(to_np(x), to_np(params[n]["kernel"]), to_np(params[n]["bias"])) for n in ("query", "key", "value"))
    k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)
    start, call = 0, jax.jit(lambda state, x: layer.apply({**variables, **state}, x, mutable=["cache"]))
    for t in (4, 1, 1, 2):
        out, state = call(state, jnp.asarray(x[:, start:start + t]))
        n = start + t
        kc, vc = (stored_codes(state["cache"][f], b)[:, :, :n] for f, b in (("k_codes", kb), ("v_codes", vb)))
        assert_nearest_codes(kc, k[:, :, :n], kb)
        assert_nearest_codes(vc, v[:, :, :n], vb)
        att = reference_attention(q[:, start:n], k[:, :, :n], v[:, :, :n], kc, vc, kb, vb, start, window, sinks)
        want = np.einsum("bthd,hdo->bto", att, to_np(params["out"]["kernel"])) + to_np(params["out"]["bias"])
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
        start = n
    assert set(variables[CODEBOOK_COLLECTION]) == {"key", "value"}  # never written


def _decode_logits(model, variables, tokens):
    """logits float[B, T, V] of a token-by-token (jitted) decode of tokens int[B, T]."""
    _, state = model.apply(variables, jnp.zeros((tokens.shape[0], MAX_LEN), jnp.int32), mutable=["cache"])
    step = jax.jit(lambda state, tok, i: model.apply({**variables, **state}, tok, i, mutable=["cache"]))
    outs = []
    for i in range(tokens.shape[1]):
        logits, state = step(state, tokens[:, i:i + 1], jnp.int32(i))
        outs.append(logits)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.slow
def test_calibrated_12bit_logits_close_to_stock():
    stock = LinenDecoder()
    rng = np.random.default_rng(1)
    calib = [jnp.asarray(rng.integers(0, VOCAB, (16, 64)))]  # 1024 tokens x 4 KV heads per layer
    eval_tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 10)))
    params = stock.init(jax.random.PRNGKey(0), eval_tokens)["params"]
    dense = _decode_logits(LinenDecoder(decode=True), {"params": params}, eval_tokens)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(stock.apply({"params": params}, eval_tokens)), atol=1e-5)
    pq_kw = {"cache_spec": CacheSpec("pq", impl="xla")}
    pq = LinenDecoder(PQMultiHeadDotProductAttention, pq_kw)
    np.testing.assert_array_equal(np.asarray(pq.apply({"params": params}, eval_tokens)),  # stock weights, non-decode
                                  np.asarray(stock.apply({"params": params}, eval_tokens)))
    errors, spread = {}, float(jnp.std(dense))
    for nbits in (12, 4):
        books, paths = calibrate_linen(pq, {"params": params}, calib, M=4, nbits=nbits, granularity="layer",
                                       key=jax.random.PRNGKey(0), iters=4)
        assert paths == [("attn_0",), ("attn_1",)]
        variables = {"params": params, CODEBOOK_COLLECTION: linen_codebooks(books, paths)}
        logits = _decode_logits(LinenDecoder(PQMultiHeadDotProductAttention, pq_kw, decode=True), variables, eval_tokens)
        errors[nbits] = float(jnp.abs(logits - dense).mean())
    assert errors[12] < 0.06 * spread, (errors, spread)
    assert errors[12] < errors[4] / 4, errors


def test_jit_with_donated_cache_compiles_once():
    model = LinenDecoder(PQMultiHeadDotProductAttention, {"cache_spec": CacheSpec("pq", impl="xla", window=2), "num_kv_heads": HKV}, decode=True)
    tok = jnp.zeros((2, 1), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tok)["params"]
    books = linen_codebooks(random_books(2, HKV, HEAD_DIM, M=4, nbits=4), [("attn_0",), ("attn_1",)])
    _, state = model.apply({"params": params, CODEBOOK_COLLECTION: books}, jnp.zeros((2, 16), jnp.int32),
                           mutable=["cache"])
    cache, traces = state["cache"], []

    def step(params, books, cache, tok, start):
        traces.append(1)
        logits, state = model.apply({"params": params, CODEBOOK_COLLECTION: books, "cache": cache}, tok, start,
                                    mutable=["cache"])
        return logits, state["cache"]

    step = jax.jit(step, donate_argnums=2)
    for i in range(4):
        old = cache
        logits, cache = step(params, books, cache, tok + i, jnp.int32(i))
        assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert not any(x.is_deleted() for x in jax.tree.leaves(books))
    assert len(traces) == 1 and logits.shape == (2, 1, VOCAB)
    assert np.asarray(cache["attn_1"]["lengths"]).tolist() == [4, 4]


def test_clear_errors():
    model = LinenDecoder(PQMultiHeadDotProductAttention, {"num_kv_heads": HKV}, decode=True)
    tok = jnp.zeros((1, 1), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tok)["params"]
    assert "cache" not in model.init(jax.random.PRNGKey(0), tok)  # no codebooks at init: params only
    with pytest.raises(ValueError, match="needs its codebooks"):
        model.apply({"params": params}, tok, mutable=["cache"])
    paths = linen_pq_layers(LinenDecoder(PQMultiHeadDotProductAttention, {"num_kv_heads": HKV}), {"params": params}, tok)
    assert paths == [("attn_0",), ("attn_1",)]
    with pytest.raises(ValueError, match="for 1 layers, the model has 2"):
        linen_codebooks(random_books(1, HKV, HEAD_DIM, M=4, nbits=4), paths)
    wrong_dim = linen_codebooks(random_books(2, HKV, 2 * HEAD_DIM, M=4, nbits=4), paths)
    with pytest.raises(ValueError, match="attn_0: PQMultiHeadDotProductAttention: codebooks are for head_dim 16"):
        model.apply({"params": params, CODEBOOK_COLLECTION: wrong_dim}, tok, mutable=["cache"])
    wrong_heads = linen_codebooks(random_books(2, 4, HEAD_DIM, M=4, nbits=4), paths)
    with pytest.raises(ValueError, match="head groups"):
        model.apply({"params": params, CODEBOOK_COLLECTION: wrong_heads}, tok, mutable=["cache"])
    books = linen_codebooks(random_books(2, HKV, HEAD_DIM, M=4, nbits=4), paths)
    _, state = model.apply({"params": params, CODEBOOK_COLLECTION: books}, jnp.zeros((1, 8), jnp.int32),
                           mutable=["cache"])
    with pytest.raises(ValueError, match="holds 1 sequences"):
        model.apply({"params": params, CODEBOOK_COLLECTION: books, **state}, jnp.zeros((3, 1), jnp.int32),
                    mutable=["cache"])
    with pytest.raises(ValueError, match="num_kv_heads"):
        PQMultiHeadDotProductAttention(num_heads=4, num_kv_heads=3).init(jax.random.PRNGKey(0), jnp.ones((1, 2, 8)))
    with pytest.raises(ValueError, match=r"cache_spec=CacheSpec\('pq'"):
        PQMultiHeadDotProductAttention(num_heads=4, cache_spec=CacheSpec("uniform", bits=4)).init(
            jax.random.PRNGKey(0), jnp.ones((1, 2, 8)))
    books = random_books(1, 4, 2, M=2, nbits=4)
    with pytest.raises(ValueError, match="not in cache_spec"):
        PQMultiHeadDotProductAttention(num_heads=4, cache_spec=CacheSpec("pq", codebooks=books)).init(
            jax.random.PRNGKey(0), jnp.ones((1, 2, 8)))


def test_overflow_raises_eagerly_and_flags_under_jit():
    layer = PQMultiHeadDotProductAttention(num_heads=HEADS, num_kv_heads=HKV, decode=True,
                                           cache_spec=CacheSpec("pq", impl="xla"))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 17, D_MODEL)), jnp.float32)
    params = layer.init(jax.random.PRNGKey(0), x[:, :1])["params"]
    variables = {"params": params, CODEBOOK_COLLECTION: linen_codebooks(random_books(1, HKV, HEAD_DIM, M=4, nbits=4),
                                                                        [()])}
    _, empty = layer.apply(variables, jnp.zeros((2, 16, D_MODEL)), mutable=["cache"])  # max_length 16

    def apply(state, x):
        return layer.apply({**variables, **state}, x, mutable=["cache"])

    _, state = apply(empty, x[:, :16])  # eager, exactly full: fine
    assert np.asarray(state["cache"]["overflow"]).tolist() == [False, False]
    with pytest.raises(CacheOverflowError, match=r"PQMultiHeadDotProductAttention: .*max_length=16 .* 1 more token"):
        apply(state, x[:, 16:17])
    with pytest.raises(CacheOverflowError, match=r"cannot take 17 more tokens \(17 asked for"):
        apply(empty, x)

    call = jax.jit(apply)
    _, state = call(empty, x[:, :16])
    assert np.asarray(cache_overflow(state["cache"])).tolist() == [False, False]  # no flag when it fits
    _, state = call(state, x[:, 16:17])
    assert np.asarray(state["cache"]["overflow"]).tolist() == [True, True]  # the 17th token: flagged
    assert np.asarray(state["cache"]["lengths"]).tolist() == [16, 16]
    flag = jax.jit(lambda s, x: cache_overflow(apply(s, x)[1]["cache"]))(empty, x[:, :3])  # read under jit
    assert np.asarray(flag).tolist() == [False, False]


def test_overflow_flag_of_a_model():
    model = LinenDecoder(PQMultiHeadDotProductAttention, {"cache_spec": CacheSpec("pq", impl="xla"), "num_kv_heads": HKV},
                         decode=True)
    tok = jnp.asarray(np.random.default_rng(7).integers(0, VOCAB, (2, 3)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tok)["params"]
    variables = {"params": params, CODEBOOK_COLLECTION: linen_codebooks(random_books(2, HKV, HEAD_DIM, M=4, nbits=4),
                                                                        [("attn_0",), ("attn_1",)])}
    _, state = model.apply(variables, jnp.zeros((2, 4), jnp.int32), mutable=["cache"])
    step = jax.jit(lambda state, tok, i: model.apply({**variables, **state}, tok, i, mutable=["cache"]))
    _, state = step(state, tok, jnp.int32(0))
    assert np.asarray(cache_overflow(state["cache"])).tolist() == [False, False]
    _, state = step(state, tok[:, :2], jnp.int32(3))  # 3 + 2 > 4
    assert np.asarray(cache_overflow(state["cache"])).tolist() == [True, True]
    assert np.asarray(cache_overflow(state)).tolist() == [True, True]  # the whole mutable state works too
    with pytest.raises(ValueError, match="no PQ attention cache"):
        cache_overflow({"params": params})

"""NNX drop-in: PQMultiHeadAttention against an independent reference, the stock layer and jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from million_jax import CacheOverflowError, CacheSpec
from million_jax.quant.codebook_io import load_kv_codebooks, save_kv_codebooks
from million_jax.flax import (PQCodebook, PQMultiHeadAttention, attach_codebooks, cache_overflow, calibrate_nnx,
                              pq_layers)

from flax_models import (D_MODEL, HEADS, VOCAB, NNXDecoder, assert_nearest_codes, project, random_books, stored_codes,
                          reference_attention, to_np)

HKV, HEAD_DIM = 2, D_MODEL // HEADS


def _layer(window=0, sinks=0, impl="xla", seed=0):
    books = random_books(1, HKV, HEAD_DIM, M=4, nbits=5, seed=seed)
    return PQMultiHeadAttention(HEADS, D_MODEL, num_kv_heads=HKV, decode=True, codebooks=books,
                                cache_spec=CacheSpec("pq", window=window, sinks=sinks, impl=impl), rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("window,sinks", [(0, 0), (3, 2)])
def test_decode_equals_reference_attention_from_codes(window, sinks):
    layer = _layer(window, sinks, seed=window)
    rng = np.random.default_rng(window)
    x = rng.standard_normal((2, 9, D_MODEL)).astype(np.float32)
    layer.init_cache((2, 16, D_MODEL))
    kb, vb = to_np(layer.key_codebook[...]), to_np(layer.value_codebook[...])
    p = {n: (to_np(getattr(layer, n).kernel[...]), to_np(getattr(layer, n).bias[...])) for n in ("query", "key", "value")}
    q, k, v = (project(to_np(x), *p[n]) for n in ("query", "key", "value"))
    k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)  # [B, Hkv, N, d]
    start, call = 0, nnx.jit(lambda m, x: m(x))
    for t in (5, 1, 1, 2):  # a prefill chunk, then decode steps
        out = call(layer, jnp.asarray(x[:, start:start + t]))
        n = start + t
        kc, vc = (stored_codes(c, books)[:, :, :n] for c, books in ((layer.k_codes, kb), (layer.v_codes, vb)))
        assert_nearest_codes(kc, k[:, :, :n], kb)
        assert_nearest_codes(vc, v[:, :, :n], vb)
        att = reference_attention(q[:, start:n], k[:, :, :n], v[:, :, :n], kc, vc, kb, vb, start, window, sinks)
        want = np.einsum("bthd,hdo->bto", att, to_np(layer.out.kernel[...])) + to_np(layer.out.bias[...])
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
        start = n
    assert np.asarray(layer.lengths[...]).tolist() == [start, start]


def test_pallas_kernel_path_matches_xla():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, D_MODEL)), jnp.float32)
    outs, call = [], nnx.jit(lambda m, x: m(x))
    for impl in ("xla", "pallas"):
        layer = _layer(impl=impl, seed=1)
        layer.init_cache((2, 8, D_MODEL))
        call(layer, x[:, :3])
        outs.append(np.asarray(call(layer, x[:, 3:4])))  # one-token step: the kernel (interpret mode on CPU)
    # impl="pallas" raises rather than fall back; the kernel scores in bf16 by default
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-2, atol=2e-2)


def _decode_logits(model, tokens):
    """logits float[B, T, V] of a token-by-token (jitted) decode of tokens int[B, T]."""
    model.init_cache(tokens.shape[0])
    step = nnx.jit(lambda m, tok, i: m(tok, start=i, decode=True))
    return jnp.concatenate([step(model, tokens[:, i:i + 1], jnp.int32(i)) for i in range(tokens.shape[1])], axis=1)


@pytest.mark.slow
def test_calibrated_12bit_logits_close_to_stock():
    stock = NNXDecoder()
    rng = np.random.default_rng(2)
    calib = [jnp.asarray(rng.integers(0, VOCAB, (16, 64)))]  # 1024 tokens x 2 KV heads x 2 layers
    eval_tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 10)))
    dense = _decode_logits(stock, eval_tokens)
    errors, spread = {}, float(jnp.std(dense))
    for nbits in (12, 4):
        pq = NNXDecoder(PQMultiHeadAttention, cache_spec=CacheSpec("pq", impl="xla"))
        nnx.update(pq, nnx.state(stock, nnx.Param))  # the stock weights load as they are
        if nbits == 12:  # non-decode: the stock layer's output
            np.testing.assert_array_equal(np.asarray(pq(eval_tokens)), np.asarray(stock(eval_tokens)))
        books = calibrate_nnx(pq, calib, M=4, nbits=nbits, granularity="shared", key=jax.random.PRNGKey(0), iters=4)
        assert books.key.centroids.shape == (2, 1, 4, 2 ** nbits, 2)
        errors[nbits] = float(jnp.abs(_decode_logits(pq, eval_tokens) - dense).mean())
    assert errors[12] < 0.06 * spread, (errors, spread)
    assert errors[12] < errors[4] / 4, errors  # the comparison can tell codebooks apart


def test_jit_with_donated_cache_compiles_once():
    model = NNXDecoder(PQMultiHeadAttention, cache_spec=CacheSpec("pq", impl="xla"))
    attach_codebooks(model, random_books(2, HKV, HEAD_DIM, M=4, nbits=4))
    model.init_cache(2, 16)
    graphdef, params, books, cache = nnx.split(model, nnx.Param, PQCodebook, nnx.Cache)
    traces = []

    def step(params, books, cache, tok, start):
        traces.append(1)
        m = nnx.merge(graphdef, params, books, cache)
        return m(tok, start=start, decode=True), nnx.state(m, nnx.Cache)

    step = jax.jit(step, donate_argnums=2)
    tok = jnp.zeros((2, 1), jnp.int32)
    for i in range(4):
        old = cache
        logits, cache = step(params, books, cache, tok + i, jnp.int32(i))
        assert all(x.is_deleted() for x in jax.tree.leaves(old))  # the cache was donated ...
    assert not any(x.is_deleted() for x in jax.tree.leaves(books))  # ... the codebooks never are
    assert len(traces) == 1 and logits.shape == (2, 1, VOCAB)
    lengths = [x for p, x in nnx.to_flat_state(cache) if p[-1] == "lengths"]
    assert [np.asarray(x).tolist() for x in lengths] == [[4, 4], [4, 4]]


def test_codebook_file_round_trip(tmp_path):
    model = NNXDecoder(PQMultiHeadAttention, cache_spec=CacheSpec("pq", impl="xla"))
    books = random_books(2, HKV, HEAD_DIM, M=8, nbits=4, seed=3)
    save_kv_codebooks(tmp_path / "books.safetensors", books)
    loaded, _ = load_kv_codebooks(tmp_path / "books.safetensors")
    paths = attach_codebooks(model, loaded)
    assert paths == [("blocks", 0, "attn"), ("blocks", 1, "attn")]
    for i, (_, layer) in enumerate(pq_layers(model)):
        np.testing.assert_array_equal(np.asarray(layer.key_codebook[...]), np.asarray(books.key.centroids[i]))


def test_clear_errors():
    books = random_books(1, HKV, HEAD_DIM, M=4, nbits=4)
    with pytest.raises(ValueError, match="head_dim 8"):
        PQMultiHeadAttention(HEADS, 2 * D_MODEL, num_kv_heads=HKV, codebooks=books, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head groups"):
        PQMultiHeadAttention(HEADS, D_MODEL, num_kv_heads=4, codebooks=books, rngs=nnx.Rngs(0))
    bare = PQMultiHeadAttention(HEADS, D_MODEL, num_kv_heads=HKV, decode=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no codebooks"):
        bare.init_cache((1, 8, D_MODEL))
    with pytest.raises(ValueError, match="for 1 layers, the model has 2"):
        attach_codebooks(NNXDecoder(PQMultiHeadAttention), books)
    layer = _layer()
    x = jnp.ones((2, 1, D_MODEL))
    with pytest.raises(ValueError, match="init_cache"):
        layer(x)
    layer.init_cache((2, 8, D_MODEL))
    with pytest.raises(ValueError, match="holds 2 sequences"):
        layer(jnp.ones((3, 1, D_MODEL)))
    with pytest.raises(ValueError, match=r"no tokens to append \(T = 0"):
        layer(jnp.ones((2, 0, D_MODEL)))
    with pytest.raises(ValueError, match="key/value have 3 tokens but the query has 1"):
        layer(x, jnp.ones((2, 3, D_MODEL)))
    for bad in ((2, D_MODEL // 2), (8, D_MODEL + 1), (2, 0, D_MODEL), (D_MODEL,), (2.0, 8, D_MODEL)):
        with pytest.raises(ValueError, match=r"init_cache: input_shape must be \[\*batch, max_length, features\]"):
            layer.init_cache(bad)
    layer.init_cache((8, D_MODEL))  # no batch axes: one sequence, as the stock layer allows
    layer.init_cache((2, 8, D_MODEL))
    with pytest.raises(ValueError, match="mask is not supported"):
        layer(x, mask=jnp.ones((2, 1, 1, 8), bool))
    with pytest.raises(ValueError, match="impl"):
        CacheSpec("pq", impl="cuda")
    with pytest.raises(ValueError, match=r"cache_spec=CacheSpec\('pq'"):
        PQMultiHeadAttention(HEADS, D_MODEL, cache_spec=CacheSpec("dense"), rngs=nnx.Rngs(0))
    books = random_books(1, HKV, HEAD_DIM, M=4, nbits=5)
    with pytest.raises(ValueError, match="codebooks given twice"):
        PQMultiHeadAttention(HEADS, D_MODEL, num_kv_heads=HKV, codebooks=books, cache_spec=CacheSpec("pq", codebooks=books),
                             rngs=nnx.Rngs(0))


def test_overflow_raises_eagerly_and_flags_under_jit():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 17, D_MODEL)), jnp.float32)
    eager = _layer(seed=4)
    eager.init_cache((2, 16, D_MODEL))
    eager(x[:, :10])
    with pytest.raises(CacheOverflowError, match=r"max_length=16 .* cannot take 7 more tokens \(17 asked for"):
        eager(x[:, 10:17])
    assert np.asarray(eager.lengths[...]).tolist() == [10, 10]  # nothing was written
    eager(x[:, 10:16])  # exactly full: fine
    assert not np.asarray(eager.overflow[...]).any()
    with pytest.raises(CacheOverflowError, match=r"PQMultiHeadAttention: .*max_length=16 .* 1 more token \("):
        eager(x[:, 16:17])

    jitted = _layer(seed=4)
    jitted.init_cache((2, 16, D_MODEL))
    call = nnx.jit(lambda m, x: (m(x), cache_overflow(m)))
    _, flag = call(jitted, x[:, :16])
    assert np.asarray(flag).tolist() == [False, False]  # 16 tokens fit a 16-token cache
    _, flag = call(jitted, x[:, 16:17])
    assert np.asarray(flag).tolist() == [True, True]  # the 17th token: flagged, read under jit
    assert np.asarray(jitted.overflow[...]).tolist() == [True, True]
    assert np.asarray(jitted.lengths[...]).tolist() == [16, 16]
    jitted.init_cache((2, 16, D_MODEL))  # a new cache clears the flag
    assert not np.asarray(cache_overflow(jitted)).any()


def test_overflow_flag_of_a_model_with_split_state():
    model = NNXDecoder(PQMultiHeadAttention, cache_spec=CacheSpec("pq", impl="xla"))
    attach_codebooks(model, random_books(2, HKV, HEAD_DIM, M=4, nbits=4, seed=5))
    model.init_cache(2, 4)
    graphdef, params, books, cache = nnx.split(model, nnx.Param, PQCodebook, nnx.Cache)

    @jax.jit
    def step(params, books, cache, tok, start):
        m = nnx.merge(graphdef, params, books, cache)
        logits = m(tok, start=start, decode=True)
        return logits, nnx.state(m, nnx.Cache)

    tok = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, (2, 3)), jnp.int32)
    _, cache = step(params, books, cache, tok, jnp.int32(0))
    assert np.asarray(cache_overflow(cache)).tolist() == [False, False]
    _, cache = step(params, books, cache, tok[:, :2], jnp.int32(3))  # 3 + 2 > 4
    assert np.asarray(cache_overflow(cache)).tolist() == [True, True]
    with pytest.raises(ValueError, match="no PQ attention cache"):
        cache_overflow(NNXDecoder(PQMultiHeadAttention))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_nan_input_gives_nan_output_not_a_finite_answer(impl):
    """A NaN in one token's input makes that token's output NaN (every key from codes, so the
    NaN reaches attention only through its query); the other batch row is unaffected. Codes
    cannot hold a NaN key: later tokens read the finite code it was encoded to."""
    layer = _layer(impl=impl, seed=0)
    layer.init_cache((2, 16, D_MODEL))
    x = np.random.default_rng(0).standard_normal((2, 6, D_MODEL)).astype(np.float32)
    x[0, 2, 5] = np.nan
    call = nnx.jit(lambda m, x: m(x))
    out = np.asarray(call(layer, jnp.asarray(x[:, :5])))
    assert np.isnan(out[0, 2]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(out[0, :2]).all()
    x[0, 5, 0] = np.nan  # a decode step (the kernel's path for impl="pallas")
    assert np.isnan(np.asarray(call(layer, jnp.asarray(x[:, 5:6])))[0]).all()

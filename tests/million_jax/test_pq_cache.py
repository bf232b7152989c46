"""PQCache attention equals exact attention over the decoded (and exact-window) K/V."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cache_layer_step import attend_layer0
from million_jax.cache.pq_cache import PQCache
from million_jax.quant.pq import Codebooks, decode, encode
from million_jax.quant.kv_codebooks import PQCodebooks


def _books(rng, L, hkv, d, M, nbits, granularity):
    groups = {"shared": (), "layer": (L,), "layer_head": (L, hkv)}[granularity]
    shape = groups + (M, 2**nbits, d // M)
    return PQCodebooks.from_centroids(
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(np.float32),
        granularity,
        num_layers=L,
    )


def _reference(q, k, v, kq, vq, lengths0, n_new, S, W, quantize_all):
    """Per-query loop in numpy. k,v: exact float[B, Hkv, P, d]; kq,vq: decoded; all positions."""
    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(int(n_new[bi])):
            p = int(lengths0[bi]) + ti
            for hi in range(h):
                kv = hi // g
                keys, vals = [], []
                for s in range(p + 1):
                    exact = (not quantize_all) and (s < S or s > p - W)
                    keys.append(k[bi, kv, s] if exact else kq[bi, kv, s])
                    vals.append(v[bi, kv, s] if exact else vq[bi, kv, s])
                sc = np.array(keys) @ q[bi, ti, hi] / math.sqrt(d)
                pr = np.exp(sc - sc.max())
                pr /= pr.sum()
                out[bi, ti, hi] = pr @ np.array(vals)
    return out


def _run(cache, books, q_chunks, k_chunks, v_chunks, n_chunks):
    """Feed chunks through attend/advance for a 1-layer cache; returns outputs per chunk."""
    outs = []
    for q, k, v, n in zip(q_chunks, k_chunks, v_chunks, n_chunks):
        out, cache = attend_layer0(cache, books, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(n))
        outs.append(np.asarray(out))
    return cache, outs


@settings(max_examples=5)  # each example compiles new shapes (~5 s on 2 cores)
@given(
    seed=st.integers(0, 10_000),
    d_m=st.sampled_from([(64, 32), (64, 16), (128, 64), (128, 32)]),
    nbits=st.sampled_from([4, 8, 10]),
    hkv_g=st.sampled_from([(1, 1), (2, 2), (1, 4), (2, 3)]),
    S=st.sampled_from([0, 2]),
    W=st.sampled_from([0, 3, 8]),
    quantize_all=st.booleans(),
    granularity=st.sampled_from(["shared", "layer", "layer_head"]),
)
@pytest.mark.slow
def test_prefill_then_decode_matches_reference(seed, d_m, nbits, hkv_g, S, W, quantize_all, granularity):
    d, M = d_m
    hkv, g = hkv_g
    rng = np.random.default_rng(seed)
    b, t_max = 2, 12
    books = _books(rng, 1, hkv, d, M, nbits, granularity)
    cache = PQCache.create(1, b, hkv, t_max, d, M=M, nbits=nbits, window=W, sinks=S,
                           dtype=jnp.float32, quantize_all=quantize_all, impl="xla")
    # ragged prefill (lengths 1 and 5), then two decode steps, the second hitting t_max for b=1
    prompt_n = np.array([1, 5], np.int32)
    P = 5
    total = [prompt_n[0] + 2, prompt_n[1] + 2]
    k_all = rng.standard_normal((b, hkv, t_max, d)).astype(np.float32)
    v_all = rng.standard_normal((b, hkv, t_max, d)).astype(np.float32)
    q_all = rng.standard_normal((b, t_max, hkv * g, d)).astype(np.float32)

    def chunk(start, T, n):
        kk = np.zeros((b, T, hkv, d), np.float32)
        vv = np.zeros_like(kk)
        qq = np.zeros((b, T, hkv * g, d), np.float32)
        for bi in range(b):
            for ti in range(int(n[bi])):
                kk[bi, ti] = k_all[bi, :, start[bi] + ti]
                vv[bi, ti] = v_all[bi, :, start[bi] + ti]
                qq[bi, ti] = q_all[bi, start[bi] + ti]
        return qq, kk, vv

    q1, k1, v1 = chunk([0, 0], P, prompt_n)
    q2, k2, v2 = chunk(prompt_n, 1, np.ones(2, np.int32))
    q3, k3, v3 = chunk(prompt_n + 1, 1, np.ones(2, np.int32))
    cache, outs = _run(cache, books, [q1, q2, q3], [k1, k2, k3], [v1, v2, v3],
                       [prompt_n, np.ones(2, np.int32), np.ones(2, np.int32)])
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.array(total))

    kcb, vcb = np.asarray(books.key.centroids[0]), np.asarray(books.value.centroids[0])
    kq = np.asarray(decode(Codebooks(kcb), encode(Codebooks(kcb), k_all)))
    vq = np.asarray(decode(Codebooks(vcb), encode(Codebooks(vcb), v_all)))
    ref1 = _reference(q1, k_all, v_all, kq, vq, np.zeros(2), prompt_n, S, W, quantize_all)
    ref2 = _reference(q2, k_all, v_all, kq, vq, prompt_n, np.ones(2), S, W, quantize_all)
    ref3 = _reference(q3, k_all, v_all, kq, vq, prompt_n + 1, np.ones(2), S, W, quantize_all)
    for bi in range(b):
        n = prompt_n[bi]
        np.testing.assert_allclose(outs[0][bi, :n], ref1[bi, :n], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(outs[1], ref2, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(outs[2], ref3, rtol=2e-4, atol=2e-4)
    assert np.isfinite(outs[0]).all()


@pytest.mark.parametrize("quantize_all", [False, True])
@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(quantize_all):
    rng = np.random.default_rng(0)
    hkv, g, d, M, nbits, W, S = 2, 2, 64, 32, 6, 4, 2
    books = _books(rng, 1, hkv, d, M, nbits, "layer_head")
    T = 11
    q = rng.standard_normal((1, T, hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((1, T, hkv, d)).astype(np.float32)
    v = rng.standard_normal((1, T, hkv, d)).astype(np.float32)
    mk = lambda: PQCache.create(1, 1, hkv, 16, d, M=M, nbits=nbits, window=W, sinks=S,
                                dtype=jnp.float32, quantize_all=quantize_all, impl="xla")
    c1, (o1,) = _run(mk(), books, [q], [k], [v], [np.array([T], np.int32)])
    cuts = [0, 3, 4, 9, T]
    pieces = [(q[:, a:b], k[:, a:b], v[:, a:b], np.array([b - a], np.int32)) for a, b in zip(cuts, cuts[1:])]
    c2, outs = _run(mk(), books, *zip(*pieces))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), o1, rtol=1e-5, atol=1e-5)
    for a, b2 in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b2))


def test_writes_past_max_len_are_dropped():
    rng = np.random.default_rng(1)
    books = _books(rng, 1, 1, 8, 4, 2, "shared")
    cache = PQCache.create(1, 1, 1, 4, 8, M=4, nbits=2, window=2, dtype=jnp.float32, impl="xla")
    x = rng.standard_normal((1, 6, 1, 8)).astype(np.float32)
    cache, (out,) = _run(cache, books, [x], [x], [x], [np.array([6], np.int32)])
    assert int(cache.lengths[0]) == 4
    assert np.isfinite(out).all()


def test_mismatched_codebooks_rejected():
    rng = np.random.default_rng(2)
    cache = PQCache.create(2, 1, 2, 8, 16, M=4, nbits=4)
    with pytest.raises(ValueError, match="for 3 layers, the model has 2"):
        cache.layer_consts(_books(rng, 3, 2, 16, 4, 4, "layer"))
    with pytest.raises(ValueError, match="head_dim 32"):
        cache.layer_consts(_books(rng, 2, 2, 32, 4, 4, "layer"))
    with pytest.raises(ValueError, match="do not match the cache"):
        cache.layer_consts(_books(rng, 2, 2, 16, 8, 4, "layer"))
    with pytest.raises(ValueError, match="head groups"):
        cache.layer_consts(_books(rng, 2, 3, 16, 4, 4, "layer_head"))
    with pytest.raises(ValueError, match="cache_consts"):
        cache.layer_consts(None)
    with pytest.raises(ValueError, match="granularity"):
        PQCodebooks.from_centroids(np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.float32), "head")
    with pytest.raises(ValueError, match="num_layers"):
        PQCodebooks.from_centroids(np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.float32), "shared")
    with pytest.raises(ValueError, match="group axes"):
        PQCodebooks.from_centroids(np.zeros((2, 4, 4, 4), np.float32), np.zeros((2, 4, 4, 4), np.float32), "layer_head")
    with pytest.raises(ValueError, match="not divisible"):
        PQCache.create(1, 1, 1, 8, 10, M=4, nbits=4)


@pytest.mark.parametrize("window, sinks", [(0, 0), (4, 2)])
@pytest.mark.slow
def test_pallas_impl_matches_xla_on_decode(window, sinks):
    """impl='pallas' (the fused kernel, interpret mode off-GPU) equals the xla path."""
    rng = np.random.default_rng(5)
    hkv, g, d, M, nbits = 2, 4, 64, 32, 8
    books = _books(rng, 1, hkv, d, M, nbits, "layer_head")
    T = 9
    q = rng.standard_normal((2, T, hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((2, T, hkv, d)).astype(np.float32)
    n = np.array([T, 3], np.int32)
    mk = lambda impl: PQCache.create(1, 2, hkv, 16, d, M=M, nbits=nbits, window=window, sinks=sinks,
                                     dtype=jnp.float32, impl=impl)
    outs = {}
    for impl in ("xla", "pallas"):
        cache, _ = _run(mk(impl), books, [q[:, :T]], [k], [k], [n])
        _, (o,) = _run(cache, books, [q[:, :1]], [k[:, :1]], [k[:, :1]], [np.ones(2, np.int32)])
        outs[impl] = o
    np.testing.assert_allclose(outs["pallas"], outs["xla"], rtol=3e-2, atol=3e-2)  # bf16 dots in the kernel
    # 10-bit codes: packed (the default) the kernel reads them; one per uint16 it refuses
    books10 = _books(rng, 1, hkv, d, M, 10, "layer_head")
    outs10 = {}
    for impl in ("xla", "pallas"):
        c10 = PQCache.create(1, 2, hkv, 16, d, M=M, nbits=10, impl=impl, dtype=jnp.float32)
        assert c10.layers.k_codes.shape[-1] == M * 10 // 8 and c10.layers.k_codes.dtype == jnp.uint8
        c10, _ = _run(c10, books10, [q[:, :T]], [k], [k], [n])
        _, (outs10[impl],) = _run(c10, books10, [q[:, :1]], [k[:, :1]], [k[:, :1]], [np.ones(2, np.int32)])
    np.testing.assert_allclose(outs10["pallas"], outs10["xla"], rtol=3e-2, atol=3e-2)
    c16 = PQCache.create(1, 2, hkv, 16, d, M=M, nbits=10, impl="pallas", dtype=jnp.float32, pack=False)
    assert c16.layers.k_codes.dtype == jnp.uint16
    with pytest.raises(ValueError, match="impl='pallas' cannot run"):
        _run(c16, books10, [q[:, :1]], [k[:, :1]], [k[:, :1]], [np.ones(2, np.int32)])

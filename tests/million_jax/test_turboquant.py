"""TurboQuant: levels, rotations, and the cache against exact attention over its own dequantized vectors."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax.cache.spec import CacheShape, CacheSpec, make_cache
from million_jax.cache.turboquant_cache import TurboQuantCache, turboquant_consts
from million_jax.quant import turboquant as tq


# ------------------------------------------------------------------ levels
@pytest.mark.parametrize("d,bits", [(64, 2), (64, 3), (64, 4), (128, 4), (16, 2)])
def test_levels_are_a_lloyd_max_fixed_point(d, bits):
    """The Lloyd-Max conditions checked by adaptive quadrature of the density (an independent
    route: no grid): each level is the mean of its cell under (1 - t^2)^((d-3)/2), the cells
    split at the midpoints; and the MSE of samples of random unit vectors' coordinates agrees."""
    from scipy.integrate import quad

    lv = tq.lloyd_max_levels(d, bits).astype(np.float64)
    f = lambda t: (1 - t * t) ** ((d - 3) / 2)  # noqa: E731  unnormalised density
    edges = np.concatenate([[-1.0], (lv[1:] + lv[:-1]) / 2, [1.0]])
    for j in range(len(lv)):
        mass = quad(f, edges[j], edges[j + 1], epsabs=1e-14, limit=200)[0]
        mean = quad(lambda t: t * f(t), edges[j], edges[j + 1], epsabs=1e-14, limit=200)[0] / mass
        assert abs(mean - lv[j]) < 5e-5 / math.sqrt(d), (j, mean, lv[j])  # 5e-5 of a standard deviation
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200000 // d * 4, d))
    t = (x / np.linalg.norm(x, axis=1, keepdims=True)).reshape(-1)
    mse = np.mean((t - lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, t)]) ** 2)
    assert tq.lloyd_max_mse(d, bits) == pytest.approx(mse, rel=0.03)


def test_levels_approach_the_gaussian_lloyd_max_figures():
    # d * MSE of the coordinate quantizer -> the Gaussian Lloyd-Max distortion as d grows
    for bits, gauss in ((2, 0.1175), (3, 0.03454), (4, 0.009497)):
        assert 1000 * tq.lloyd_max_mse(1000, bits) == pytest.approx(gauss, rel=0.01)
        assert 64 * tq.lloyd_max_mse(64, bits) < gauss  # the sphere's coordinate is lighter-tailed
    lv = tq.lloyd_max_levels(64, 3)
    np.testing.assert_allclose(lv, -lv[::-1], atol=1e-7)  # symmetric


# ------------------------------------------------------------------ rotations
def test_rotation_orthogonal_and_reproducible():
    c1 = turboquant_consts(3, 64, seed=7, qjl=True)
    c2 = turboquant_consts(3, 64, seed=7, qjl=True)
    r = np.asarray(c1.rotation, np.float64)
    for i in range(3):
        np.testing.assert_allclose(r[i] @ r[i].T, np.eye(64), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c1.rotation), np.asarray(c2.rotation))
    np.testing.assert_array_equal(np.asarray(c1.qjl), np.asarray(c2.qjl))
    assert np.abs(r[0] - r[1]).max() > 0.1  # one per layer
    assert np.abs(r[0] - np.asarray(turboquant_consts(1, 64, seed=8).rotation[0])).max() > 0.1
    _, consts = make_cache(CacheSpec("turboquant", bits=3, seed=7), CacheShape(3, 2, 64), 1, 8)
    np.testing.assert_array_equal(np.asarray(consts.rotation), np.asarray(c1.rotation))


def test_relative_error_of_random_vectors_is_lloyd_max():
    rng = np.random.default_rng(1)
    rot = turboquant_consts(1, 64, seed=0).rotation[0]
    iso = jnp.asarray(rng.standard_normal((4000, 64)), jnp.float32)
    outliers = iso * jnp.asarray(1 + 9 * (rng.random(64) < 0.05), jnp.float32)  # a few 10x channels
    gauss = {2: 0.1175, 3: 0.03454, 4: 0.009497}
    for bits in (2, 3, 4, 2.5):
        parts = tq.bit_parts(bits, 64)
        want = sum(p.n * tq.lloyd_max_mse(64, p.bits) for p in parts)
        for x, tol in ((iso, 0.02), (outliers, 0.1)):
            codes, norm, _ = tq.encode(x, rot, parts, jnp.float32)
            xh = tq.decode_rotated(tq.unpack_parts(tq.pack_parts(codes, parts), parts), norm, parts, 64) @ rot
            rel = float(jnp.sum((x - xh) ** 2) / jnp.sum(x * x))
            assert rel == pytest.approx(want, rel=tol), bits
            if bits in gauss:
                assert rel <= 1.1 * gauss[bits]


# ------------------------------------------------------------------ the cache
def _rd(x, dtype):
    x = np.asarray(x, np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == jnp.bfloat16 else x


CONFIGS = [  # bits, qjl, window, sinks, dtype, plan (n_new per call for 2 sequences), tile
    (4, False, 0, 0, jnp.float32, [[9, 4], [1, 7], [1, 0], [6, 6]], 8),
    (2.5, False, 5, 2, jnp.bfloat16, [[7, 1], [1, 1], [8, 9]], 4),
    (3, True, 0, 0, jnp.float32, [[5, 11], [1, 1], [4, 2]], 512),
    (2, True, 4, 1, jnp.float32, [[6, 3], [2, 8], [1, 1]], 8),
]


@pytest.mark.parametrize("bits,qjl,window,sinks,dtype,plan,tile", CONFIGS)
def test_cache_is_exact_attention_over_its_dequantized_vectors(bits, qjl, window, sinks, dtype, plan, tile):
    """Ragged chunked prefill + decode: every output equals softmax attention over the cache's own
    dequantized keys / values for the code region and the exact ones for sinks / window."""
    b, hkv, h, d = 2, 2, 6, 32
    total = [sum(c[i] for c in plan) for i in range(b)]
    t_max = max(total) + 1
    rng = np.random.default_rng(int(bits * 10) + window)
    q_all = rng.standard_normal((b, t_max, h, d)).astype(np.float32)
    k_all = _rd(rng.standard_normal((b, t_max, hkv, d)) * (1 + 5 * (rng.random(d) < 0.1)), dtype)
    v_all = _rd(rng.standard_normal((b, t_max, hkv, d)), dtype)
    spec = CacheSpec("turboquant", bits=bits, qjl=qjl, window=window, sinks=sinks, dtype=dtype, tile=tile, seed=3)
    cache, consts = make_cache(spec, CacheShape(1, hkv, d), b, t_max)
    width = max(max(c) for c in plan)
    start = np.zeros(b, np.int32)
    calls = []
    for n in plan:
        n = np.asarray(n, np.int32)
        idx = np.minimum(start[:, None] + np.arange(width)[None, :], t_max - 1)
        take = lambda a: np.stack([a[i, idx[i]] for i in range(b)])  # noqa: E731
        out, cache = attend_layer0(cache, consts, take(q_all), take(k_all), take(v_all), n)
        calls.append((np.asarray(out, np.float32), start.copy(), n))
        start = start + n
    np.testing.assert_array_equal(np.asarray(cache.lengths), total)
    kh, vh = (np.asarray(x[0], np.float64) for x in cache.dequantize(consts))  # [B, Hkv, T, d]
    for out, st, n in calls:
        for bi in range(b):
            for ti in range(int(n[bi])):
                p = st[bi] + ti
                s = np.arange(p + 1)
                exact = (s < sinks) | (s > p - window)
                for hh in range(h):
                    kv = hh // (h // hkv)
                    keys = np.where(exact[:, None], k_all[bi, :p + 1, kv], kh[bi, kv, :p + 1])
                    vals = np.where(exact[:, None], v_all[bi, :p + 1, kv], vh[bi, kv, :p + 1])
                    sc = keys @ q_all[bi, p, hh] / math.sqrt(d)
                    pr = np.exp(sc - sc.max())
                    np.testing.assert_allclose(out[bi, ti, hh], pr / pr.sum() @ vals, atol=3e-5, rtol=1e-4)


def test_qjl_inner_products_are_unbiased():
    rng = np.random.default_rng(2)
    d = 64
    k = jnp.asarray(rng.standard_normal((1, 2000, 1, d)), jnp.float32)
    q = rng.standard_normal(d).astype(np.float32)
    ests = []
    for seed in range(4):
        cache = TurboQuantCache.create(1, 1, 1, 2000, d, bits=2, qjl=True, dtype=jnp.float32, quantize_all=True)
        consts = turboquant_consts(1, d, seed=seed, qjl=True)
        lay = jax.tree.map(lambda a: a[0], cache.layers)
        *_, rec = lay.encode_keys(jax.tree.map(lambda a: a[0], consts), k)
        kh = np.asarray(rec @ consts.rotation[0])[0, :, 0]
        ests.append((kh - np.asarray(k)[0, :, 0]) @ q)
    err = np.concatenate(ests)
    assert abs(err.mean()) < 4 * err.std() / math.sqrt(err.size)  # no bias beyond sampling noise


def test_bits_per_element_from_stored_bytes():
    shape = CacheShape(2, 3, 64)
    bpe = lambda **kw: make_cache(CacheSpec("turboquant", **kw), shape, 1, 16)[0].bits_per_element  # noqa: E731
    assert bpe(bits=4) == (4.25, 4.25)  # 32 code bytes + a bf16 norm per 64 elements
    assert bpe(bits=2.5) == (2.75, 2.75)
    assert bpe(bits=3, qjl=True) == (2 + 1 + 0.5, 3.25)  # levels 2 b, signs 1 b, two bf16 norms
    assert bpe(bits=2, dtype=jnp.float32) == (2.5, 2.5)
    assert bpe(bits=8) == (8.25, 8.25)  # 8-bit codes stored one per byte
    cache, _ = make_cache(CacheSpec("turboquant", bits=4), shape, 1, 16)
    assert cache.bytes_per_token() == 2 * 3 * 64 * 8.5 / 8


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="needs bits"):
        CacheSpec("turboquant")
    with pytest.raises(ValueError, match="must be one of"):
        CacheSpec("turboquant", bits=2.25)
    with pytest.raises(ValueError, match="QJL residual needs integer bits"):
        CacheSpec("turboquant", bits=3.5, qjl=True)
    with pytest.raises(ValueError, match="qjl"):
        CacheSpec("uniform", bits=4, qjl=True)
    with pytest.raises(ValueError, match="seed"):
        CacheSpec("turboquant", bits=4, seed=-1)
    with pytest.raises(ValueError, match="multiple of 8"):
        make_cache(CacheSpec("turboquant", bits=4), CacheShape(1, 1, 12), 1, 4)
    cache, consts = make_cache(CacheSpec("turboquant", bits=4), CacheShape(2, 1, 16), 1, 4)
    with pytest.raises(ValueError, match="TurboQuantConsts"):
        cache.layer_consts(None)
    with pytest.raises(ValueError, match="rotation has shape"):
        cache.layer_consts(turboquant_consts(3, 16))
    with pytest.raises(ValueError, match="QJL"):
        cache.layer_consts(turboquant_consts(2, 16, qjl=True))


@pytest.mark.slow
def test_model_chunked_prefill_equals_decode():
    """Through the model: a one-shot prefill and a prefill + token-by-token decode give the same
    logits (each query reads what it would read decoding)."""
    from models import decode_step, init_params, prefill, preset

    cfg = preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0))
    toks = jax.random.randint(jax.random.PRNGKey(1), (1, 12), 0, cfg.vocab)
    spec = CacheSpec("turboquant", bits=3, window=3, sinks=1, dtype=jnp.float32)
    cache, consts = make_cache(spec, cfg, 1, 16)
    full, _ = prefill(cfg, params, cache, toks, jnp.array([12]), consts)
    cache, consts = make_cache(spec, cfg, 1, 16)
    first, cache = prefill(cfg, params, cache, toks[:, :8], jnp.array([8]), consts)
    steps = [first[:, -1]]
    for i in range(8, 12):
        logits, cache = decode_step(cfg, params, cache, toks[:, i], consts)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(full[0, 7:]), np.asarray(jnp.stack(steps[:5], 1)[0]), atol=2e-4)


def test_sharding_rules_cover_the_cache_and_its_constants():
    from million_jax.sharding import make_mesh, shard_cache, shard_tree, tree_specs

    mesh = make_mesh((1, -1))
    cache, consts = make_cache(CacheSpec("turboquant", bits=3, qjl=True, window=4), CacheShape(2, 2, 64), 1, 16)
    tree_specs(cache, mesh)
    tree_specs(consts, mesh)  # a rule for every leaf (rotation, qjl), else ValueError
    shard_cache(cache, mesh), shard_tree(consts, mesh)


@pytest.mark.parametrize("bits,window,sinks", [(4, 0, 0), (2.5, 3, 1), (3.5, 0, 2)])
def test_decode_in_the_pallas_kernel_equals_the_xla_path(bits, window, sinks):
    """impl="pallas" (the PQ kernel reading TurboQuant codes as one-dim sub-spaces with per-token
    norms; interpret mode here) against impl="xla": a ragged prefill, then decode steps. The codes
    written are identical; outputs agree to the kernel's bf16 dots; the step holds a pallas_call."""
    b, hkv, h, d, t_max = 3, 2, 6, 64, 40
    rng = np.random.default_rng(int(bits * 10))
    spec = dict(bits=bits, window=window, sinks=sinks, dtype=jnp.float32, seed=1)
    caches = {impl: make_cache(CacheSpec("turboquant", impl=impl, **spec), CacheShape(1, hkv, d), b, t_max)
              for impl in ("xla", "pallas")}
    chunks = [(20, np.array([20, 5, 13], np.int32))] + [(1, np.ones(b, np.int32))] * 3
    for t, n in chunks:
        q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, t, hkv, d)) * (1 + 4 * (rng.random(d) < 0.1)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
        outs = {}
        for impl, (cache, consts) in caches.items():
            if t == 1 and impl == "pallas":
                assert "pallas_call" in str(attend_layer0.trace(cache, consts, q, k, v, jnp.asarray(n)).jaxpr)
            outs[impl], cache = attend_layer0(cache, consts, q, k, v, jnp.asarray(n))
            caches[impl] = (cache, consts)
        np.testing.assert_allclose(np.asarray(outs["pallas"]), np.asarray(outs["xla"]), atol=3e-2, rtol=3e-2)
    for name in ("k_codes", "v_codes", "k_norms", "v_norms"):
        np.testing.assert_array_equal(np.asarray(getattr(caches["xla"][0].layers, name)),
                                      np.asarray(getattr(caches["pallas"][0].layers, name)))


def test_pallas_refuses_the_qjl_residual_by_name():
    with pytest.raises(ValueError, match="QJL key residual"):
        make_cache(CacheSpec("turboquant", bits=4, qjl=True, impl="pallas"), CacheShape(1, 1, 64), 1, 8)
    cache, consts = make_cache(CacheSpec("turboquant", bits=4, qjl=True, impl="auto"), CacheShape(1, 1, 64), 1, 8)
    out, _ = attend_layer0(cache, consts, *(jnp.ones((1, 1, h, 64)) for h in (2, 1, 1)), jnp.ones(1, jnp.int32))
    assert out.shape == (1, 1, 2, 64)  # auto on CPU: the xla path reads the residual

"""Query-aware keys / output-aware values, separate key/value budgets, packed codes, query statistics.

Every check compares against an independent numpy reference on fresh random inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax.cache.pq_cache import PQCache
from million_jax.cache.query_stats import QueryStatsCache
from million_jax.calibration.fit import collect_query_gram
from million_jax.quant.codebook_io import load_kv_codebooks, save_kv_codebooks
from million_jax.attention.pq_dispatch import kernel_plan, pq_code_attention
from million_jax.quant.kv_transforms import output_value_transform, query_aware_key_transform, sqrt_psd
from million_jax.quant.pq import Codebooks
from million_jax.quant.kv_codebooks import PQCodebooks
from pallas_kernels.code_packing import pack_codes, packed_width

B, T, H, HKV, D, L = 2, 6, 4, 2, 8, 1


def test_sqrt_psd_and_transforms():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 50, 5))
    g = np.einsum("lhni,lhnj->lhij", x, x)
    a = sqrt_psd(g)
    np.testing.assert_allclose(a @ a, g, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(a, np.swapaxes(a, -1, -2), atol=1e-5)
    np.testing.assert_allclose(query_aware_key_transform(g, np.full((2, 3), 50.0)), sqrt_psd(g / 50), rtol=1e-5)
    wo = rng.normal(size=(2, 4 * 5, 7))  # L=2, H=4, d=5, D=7, Hkv=2
    bt = output_value_transform(wo, 4, 2)
    w = wo.reshape(2, 2, 2, 5, 7)
    ref = np.einsum("lkgid,lkgjd->lkij", w, w)
    np.testing.assert_allclose(bt @ bt, ref, rtol=1e-4, atol=1e-4)


def _books(rng, key_m, key_nb, val_m, val_nb, transforms):
    kc = rng.normal(size=(L, HKV, key_m, 2**key_nb, D // key_m)).astype(np.float32)
    vc = rng.normal(size=(L, HKV, val_m, 2**val_nb, D // val_m)).astype(np.float32)
    books = PQCodebooks.from_centroids(kc, vc, "layer_head")
    if not transforms:
        return books
    a = np.eye(D) + 0.3 * rng.normal(size=(L, HKV, D, D))
    b = np.eye(D) + 0.3 * rng.normal(size=(L, HKV, D, D))
    return books.with_transforms(a.astype(np.float32), b.astype(np.float32))


def _np_encode(c: np.ndarray, x: np.ndarray) -> np.ndarray:
    """c [M, K, dsub], x [N, d] -> nearest-centroid reconstruction [N, d]."""
    m, _, ds = c.shape
    xs = x.reshape(len(x), m, ds)
    idx = ((xs[:, :, None, :] - c[None]) ** 2).sum(-1).argmin(-1)  # [N, M]
    return c[np.arange(m)[None], idx].reshape(len(x), -1)


def _np_reference(books: PQCodebooks, q, k, v):
    """Causal attention with every key / value reconstructed from whitened PQ (numpy, float64)."""
    grp = H // HKV
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for hk in range(HKV):
            kc = np.asarray(books.key.centroids[0, hk], np.float64)
            vc = np.asarray(books.value.centroids[0, hk], np.float64)
            a = np.eye(D) if books.key_transform is None else np.asarray(books.key_transform[0, hk], np.float64)
            bm = np.eye(D) if books.value_transform is None else np.asarray(books.value_transform[0, hk], np.float64)
            khat = _np_encode(kc, k[b, :, hk] @ a.T)            # A k, reconstructed
            vhat = _np_encode(vc, v[b, :, hk] @ bm.T) @ np.linalg.inv(bm).T
            for g in range(grp):
                h = hk * grp + g
                qt = q[b, :, h] @ np.linalg.inv(a)              # (A^-T q) as a row vector
                s = qt @ khat.T / np.sqrt(D)
                s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ vhat
    return out


@pytest.mark.parametrize("budget,transforms", [((4, 4, 2, 3), True), ((4, 4, 4, 4), True), ((2, 3, 8, 2), False)])
@pytest.mark.slow
def test_pq_cache_matches_numpy_reference(budget, transforms):
    rng = np.random.default_rng(sum(budget) + transforms)
    books = _books(rng, *budget, transforms)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, HKV, HKV))
    ref = _np_reference(books, q, k, v)
    outs = []
    for pack in (True, False):
        cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl="xla", pack=pack)
        layer = jax.tree.map(lambda x: x[0], cache.layers)
        per_layer = jax.tree.map(lambda x: x[0], books)
        out, new = layer.append(per_layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32))
        outs.append(np.asarray(out))
        assert new.k_codes.shape[-1] == (packed_width(budget[0], budget[1]) if pack else budget[0])
    np.testing.assert_allclose(outs[0], ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(outs[0], outs[1])  # packed and unpacked: identical


def test_decode_kernel_and_fallbacks():
    rng = np.random.default_rng(7)
    n = 20
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
    lo, hi = jnp.zeros((B, 1), jnp.int32), jnp.asarray([[n], [n - 7]], jnp.int32)
    # same M, 8-bit keys / 4-bit values unpacked: the kernel (interpret mode) against xla
    kb = jnp.asarray(rng.normal(size=(HKV, 4, 256, 2)), jnp.float32)
    vb = jnp.asarray(rng.normal(size=(HKV, 4, 16, 2)), jnp.float32)
    kc = jnp.asarray(rng.integers(0, 256, size=(B, HKV, n, 4)), jnp.uint8)
    vc = jnp.asarray(rng.integers(0, 16, size=(B, HKV, n, 4)), jnp.uint8)
    assert kernel_plan("pallas", q, kc, vc, kb, vb) is not None
    got = pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl="pallas")
    want = pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl="xla")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-2, atol=2e-2)
    # packed values: the kernel reads them as stored, with the same result as unpacked
    vp = pack_codes(vc, 4)
    assert kernel_plan("pallas", q, kc, vp, kb, vb).dims.v_packed_bits == 4
    np.testing.assert_array_equal(np.asarray(pq_code_attention(q, kc, vp, kb, vb, lo, hi, impl="pallas")[0]),
                                  np.asarray(got[0]))
    np.testing.assert_array_equal(np.asarray(pq_code_attention(q, kc, vp, kb, vb, lo, hi, impl="xla")[0]),
                                  np.asarray(want[0]))
    # different M for keys and values: "auto" takes the xla path, "pallas" names the reason
    vb2 = jnp.asarray(rng.normal(size=(HKV, 2, 256, 4)), jnp.float32)
    vc2 = jnp.asarray(rng.integers(0, 256, size=(B, HKV, n, 2)), jnp.uint8)
    with pytest.raises(ValueError, match="impl='pallas' cannot run: keys and values have different M"):
        kernel_plan("pallas", q, kc, vc2, kb, vb2)


def test_query_stats_cache_sums_real_queries():
    rng = np.random.default_rng(3)
    cache = QueryStatsCache.create(L, B, HKV, T, D)
    layer = jax.tree.map(lambda x: x[0], cache.layers)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, HKV, HKV))
    n_new = np.array([T, 3])
    _, new = layer.append(None, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.zeros((B,), jnp.int32),
                          jnp.asarray(n_new, jnp.int32))
    stacked = QueryStatsCache(layers=jax.tree.map(lambda x: x[None], new), lengths=jnp.asarray(n_new, jnp.int32))
    gram, count = collect_query_gram(stacked)
    grp = H // HKV
    for hk in range(HKV):
        rows = np.concatenate([q[b, : n_new[b], hk * grp:(hk + 1) * grp].reshape(-1, D) for b in range(B)])
        np.testing.assert_allclose(gram[0, hk], rows.T @ rows, rtol=1e-4, atol=1e-4)
        assert count[0, hk] == len(rows)


def test_codebook_file_keeps_budgets_and_transforms(tmp_path):
    rng = np.random.default_rng(5)
    books = _books(rng, 4, 3, 2, 5, True)
    path = tmp_path / "cb.safetensors"
    save_kv_codebooks(path, books, {"recipe": "test"})
    got, meta = load_kv_codebooks(path)
    assert (got.key_M, got.key_nbits, got.value_M, got.value_nbits) == (4, 3, 2, 5) and meta["recipe"] == "test"
    for name in ("key_transform", "query_transform", "value_transform", "output_transform"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(books, name)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.query_transform[0, 1]).T @ np.asarray(got.key_transform[0, 1]),
                               np.eye(D), atol=1e-4)
    with pytest.raises(ValueError, match="key_transform"):
        books.with_transforms(np.zeros((L, HKV, D + 1, D + 1), np.float32))
    with pytest.raises(ValueError, match="different M"):
        _ = books.M
    with pytest.raises(ValueError, match="do not match the cache"):
        PQCache.create(L, B, HKV, T, D, M=4, nbits=3).layer_consts(books)


def test_extreme_pairing_puts_the_ith_widest_beside_the_ith_narrowest():
    from million_jax.quant.kv_transforms import extreme_pairing

    for d in (2, 8, 64):
        order = extreme_pairing(d)
        assert sorted(order) == list(range(d))
        pairs = order.reshape(-1, 2)
        assert (pairs.sum(1) == d - 1).all() and (pairs[:, 0] == np.arange(d // 2)).all()
    with pytest.raises(ValueError, match="even d"):
        extreme_pairing(7)


def test_value_pca_transform_decorrelates_and_pairs_the_axes():
    """B = Pi U^T is orthogonal; the coded values B v have a diagonal second moment, sub-space m
    holding the m-th widest and the m-th narrowest axis."""
    from million_jax.quant.kv_transforms import value_pca_transform

    rng = np.random.default_rng(3)
    L, hkv, d, n = 2, 3, 6, 4000
    mix = rng.normal(size=(L, hkv, d, d)) * np.geomspace(3.0, 0.05, d)  # correlated, spread values
    v = np.einsum("lhij,lhnj->lhni", mix, rng.normal(size=(L, hkv, n, d)))
    b = value_pca_transform(v)
    assert b.shape == (L, hkv, d, d) and b.dtype == np.float32
    np.testing.assert_allclose(b @ np.swapaxes(b, -1, -2), np.broadcast_to(np.eye(d), b.shape), atol=1e-5)
    z = np.einsum("lhij,lhnj->lhni", b.astype(np.float64), v)
    m2 = np.einsum("lhni,lhnj->lhij", z, z) / n
    var = np.diagonal(m2, axis1=-2, axis2=-1)
    assert np.abs(m2 - var[..., None] * np.eye(d)).max() < 1e-3 * var.max()
    ranked = np.sort(var, axis=-1)[..., ::-1]  # widest first
    np.testing.assert_allclose(var[..., 0::2], ranked[..., : d // 2], rtol=1e-4)
    np.testing.assert_allclose(var[..., 1::2], ranked[..., ::-1][..., : d // 2], rtol=1e-4)
    np.testing.assert_allclose(ranked.sum(-1), np.einsum("lhni,lhni->lh", v, v) / n, rtol=1e-6)  # all of it
    with pytest.raises(ValueError, match="NaN"):
        value_pca_transform(np.where(v > 2, np.nan, v))
    with pytest.raises(ValueError, match=r"float\[L, Hkv, N >= 1, d\]"):
        value_pca_transform(v[:, :, :0])


def test_recipe_names_a_rotation_of_the_values_vr_and_any_other_value_transform_ow():
    from million_jax.quant.kv_transforms import value_pca_transform

    rng = np.random.default_rng(5)
    books = _books(rng, 4, 4, 4, 4, transforms=False)
    rot = value_pca_transform(rng.normal(size=(L, HKV, 50, D)) * np.geomspace(2.0, 0.1, D))
    assert books.with_transforms(value_transform=rot).recipe.endswith(" vr")
    wo = rng.normal(size=(L, H * D, 12))
    assert books.with_transforms(value_transform=output_value_transform(wo, H, HKV)).recipe.endswith(" ow")
    assert " vr" not in books.recipe and " ow" not in books.recipe

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax.cache.dense import DenseCache, DenseLayer
from million_jax.calibration.fit import collect_kv, fit_kv_codebooks


def test_collect_kv_takes_valid_tokens_only():
    rng = np.random.default_rng(0)
    c = DenseCache.create(2, 3, 2, 6, 4, dtype=jnp.float32)
    k = rng.standard_normal(c.layers.k.shape).astype(np.float32)
    c = DenseCache(layers=DenseLayer(k=jnp.asarray(k), v=jnp.asarray(-k)), lengths=jnp.array([2, 0, 5], jnp.int32))
    ks, vs = collect_kv(c)
    assert ks.shape == (2, 2, 7, 4)
    np.testing.assert_array_equal(ks[:, :, :2], k[:, 0, :, :2])
    np.testing.assert_array_equal(ks[:, :, 2:], k[:, 2, :, :5])
    np.testing.assert_array_equal(vs, -ks)
    with pytest.raises(ValueError, match="empty calibration"):
        collect_kv(DenseCache.create(1, 1, 1, 4, 4))


@pytest.mark.parametrize(
    "granularity, shape",
    [("shared", (4, 16, 2)), ("layer", (3, 4, 16, 2)), ("layer_head", (3, 2, 4, 16, 2))],  # fitted form
)
def test_granularity_shapes(granularity, shape):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, 2, 100, 8)).astype(np.float32)
    books = fit_kv_codebooks(k, k * 2, M=4, nbits=4, granularity=granularity, key=jax.random.PRNGKey(0), iters=3)
    per_layer = (3, 2 if granularity == "layer_head" else 1, 4, 16, 2)
    assert books.key.centroids.shape == per_layer and books.value.centroids.shape == per_layer
    kc, vc = books.compact()
    assert kc.centroids.shape == shape and vc.centroids.shape == shape
    assert books.granularity == granularity
    books.check(3, 2, 8)


def test_per_head_codebooks_fit_per_head_distributions():
    # head 1 is head 0 shifted by +50: per-head codebooks follow each head.
    rng = np.random.default_rng(2)
    base = rng.standard_normal((1, 1, 400, 4)).astype(np.float32)
    k = np.concatenate([base, base + 50.0], axis=1)
    books = fit_kv_codebooks(k, k, M=2, nbits=3, granularity="layer_head", key=jax.random.PRNGKey(0), iters=5)
    c = np.asarray(books.key.centroids)
    assert abs(c[0, 0].mean()) < 5 and abs(c[0, 1].mean() - 50) < 5


def test_subsampling_bounds_vectors_and_errors():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 1, 5000, 4)).astype(np.float32)
    books = fit_kv_codebooks(k, k, M=2, nbits=2, key=jax.random.PRNGKey(0), max_vectors=300, iters=2)
    assert books.key.centroids.shape == (1, 1, 2, 4, 2)
    with pytest.raises(ValueError, match="fewer than"):
        fit_kv_codebooks(k[:, :, :10], k[:, :, :10], M=2, nbits=4, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="NaN"):
        bad = k.copy()
        bad[0, 0, 3, 1] = np.nan
        fit_kv_codebooks(bad, k, M=2, nbits=2, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="N = 0"):
        fit_kv_codebooks(k[:, :, :0], k[:, :, :0], M=2, nbits=2, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="granularity"):
        fit_kv_codebooks(k, k, M=2, nbits=2, granularity="head", key=jax.random.PRNGKey(0))


def test_fit_in_chunks_reports_progress_and_matches_one_fit():
    from million_jax.calibration.fit import fit_in_chunks
    from million_jax.quant.pq import fit_codebooks

    rng = np.random.default_rng(3)
    pooled = rng.standard_normal((5, 2, 64, 4)).astype(np.float32)           # G = (5, 2)
    key = jax.random.PRNGKey(0)
    calls = []
    one = fit_in_chunks(pooled, 2, 2, key=key, groups_per_fit=10, progress=lambda: calls.append(1), iters=2)
    ref = fit_codebooks(pooled, 2, 2, key=key, iters=2)
    np.testing.assert_array_equal(np.asarray(one.centroids), np.asarray(ref.centroids))
    assert calls == [1]
    calls.clear()
    many = fit_in_chunks(pooled, 2, 2, key=key, groups_per_fit=5, progress=lambda: calls.append(1), iters=2)
    assert many.centroids.shape == ref.centroids.shape and len(calls) == 2   # 10 = 2 x 5 groups
    # every group is fitted on its own data: its centroids lie in its points' range
    c = np.asarray(many.centroids)                                            # [5, 2, M, K, dsub]
    assert np.all(c.max(axis=(2, 3, 4)) <= pooled.max(axis=(2, 3)) + 1e-5)
    calls.clear()
    odd = fit_in_chunks(pooled.reshape(10, 64, 4)[:7], 2, 2, key=key, groups_per_fit=5,
                        progress=lambda: calls.append(1), iters=2)           # 7: 4 + 3 (padded)
    assert odd.centroids.shape == (7, 2, 4, 2) and len(calls) == 2
    steps = []
    fit_kv_codebooks(pooled, pooled, M=2, nbits=2, key=key, iters=2, groups_per_fit=5,
                     progress=lambda d, t: steps.append((d, t)))
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]                        # 10 groups -> 2 fits each


@pytest.mark.parametrize("max_vectors", [440, 300])
def test_sample_weights_steer_kmeans_and_follow_their_rows(max_vectors):
    """Points at -1 (200), +1 (200) and 20 (40), K = 2: unweighted k-means puts the centroids
    at about 0 and 20; with the -1 cluster weighted 0 at 1 and 20 (also after subsampling, which
    must keep each weight with its vector). Value weights are independent of key weights."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.full(200, -1.0), np.full(200, 1.0), np.full(40, 20.0)]) + 0.01 * rng.normal(size=440)
    perm = rng.permutation(440)
    pts = np.stack([x, np.zeros_like(x)], -1)[perm].astype(np.float32)[None, None]  # [1, 1, 440, 2]
    w = (x > -0.5).astype(np.float32)[perm][None, None]
    fit = lambda **kw: fit_kv_codebooks(pts, pts, M=1, nbits=1, key=jax.random.PRNGKey(1),  # noqa: E731
                                        max_vectors=max_vectors, iters=20, **kw)
    books = fit(key_weights=w)
    key_c = np.sort(np.asarray(books.key.centroids)[..., 0].ravel())
    value_c = np.sort(np.asarray(books.value.centroids)[..., 0].ravel())
    np.testing.assert_allclose(key_c, [1.0, 20.0], atol=0.05)
    np.testing.assert_allclose(value_c, [0.0, 20.0], atol=0.15)
    plain = np.sort(np.asarray(fit().key.centroids)[..., 0].ravel())
    np.testing.assert_allclose(plain, [0.0, 20.0], atol=0.15)
    for bad, match in ((-w, ">= 0"), (w[..., :-1], r"float\[L, Hkv, N\]"), (0 * w, "all zero"),
                       (np.where(w > 0, np.nan, 0), "finite")):
        with pytest.raises(ValueError, match=match):
            fit(key_weights=bad)

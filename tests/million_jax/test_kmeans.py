import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from million_jax.quant.kmeans import assign, kmeans


def _blobs(seed, n_per=200, k=4, d=3, spread=10.0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((k, d)) * spread
    x = centres[:, None, :] + rng.standard_normal((k, n_per, d)) * 0.1
    return x.reshape(-1, d).astype(np.float32), centres


def test_recovers_separated_clusters():
    x, centres = _blobs(0)
    res = kmeans(x, 4, key=jax.random.PRNGKey(1), iters=20)
    got = np.asarray(res.centroids)
    # every true centre has a fitted centroid within 0.1
    d = np.linalg.norm(got[:, None, :] - centres[None], axis=-1)
    assert d.min(axis=0).max() < 0.1


@settings(max_examples=6)  # each example compiles new shapes (~2 s on 2 cores)
@given(
    seed=st.integers(0, 2**16),
    k=st.sampled_from([2, 8, 32]),
    d=st.sampled_from([1, 2, 5, 8]),
    batch=st.integers(1, 3),
)
@pytest.mark.slow
def test_objective_never_increases(seed, k, d, batch):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=(batch, 300, d)).astype(np.float32)
    res = kmeans(x, k, key=jax.random.PRNGKey(seed), iters=12, chunk_size=64)
    h = np.asarray(res.inertia)
    assert np.isfinite(h).all()
    assert (np.diff(h, axis=-1) <= 1e-4 * h[..., :-1] + 1e-6).all(), h


def test_inertia_matches_assignment_objective():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((500, 6)).astype(np.float32)
    res = kmeans(x, 16, key=jax.random.PRNGKey(0), iters=5)
    # one more assignment with the final centroids equals or beats the last recorded inertia
    _, mind = assign(jnp.asarray(x), res.centroids)
    assert float(mind.sum()) <= float(res.inertia[-1]) * (1 + 1e-5)
    # the objective computed by hand agrees with assign's distances
    full = ((x[:, None, :] - np.asarray(res.centroids)[None]) ** 2).sum(-1).min(-1)
    np.testing.assert_allclose(np.asarray(mind), full, rtol=1e-4, atol=1e-5)


def test_deterministic_for_key_and_key_sensitive():
    x = np.random.default_rng(0).standard_normal((2, 400, 4)).astype(np.float32)
    a = kmeans(x, 16, key=jax.random.PRNGKey(7), iters=5).centroids
    b = kmeans(x, 16, key=jax.random.PRNGKey(7), iters=5).centroids
    c = kmeans(x, 16, key=jax.random.PRNGKey(8), iters=5).centroids
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_batched_equals_individual():
    x = np.random.default_rng(1).standard_normal((3, 256, 2)).astype(np.float32)
    key = jax.random.PRNGKey(0)
    batched = kmeans(x, 8, key=key, iters=6)
    keys = jax.random.split(key, 3)
    from million_jax.quant.kmeans import _kmeans_single

    for i in range(3):
        single = _kmeans_single(keys[i], jnp.asarray(x[i]), jnp.ones(256), 8, 6, None, 8192, 256)
        np.testing.assert_allclose(np.asarray(batched.centroids[i]), np.asarray(single.centroids), rtol=1e-5, atol=1e-6)


def test_chunk_size_does_not_change_result():
    x = np.random.default_rng(2).standard_normal((1000, 3)).astype(np.float32)
    key = jax.random.PRNGKey(0)
    a = kmeans(x, 8, key=key, iters=5, chunk_size=97)
    b = kmeans(x, 8, key=key, iters=5, chunk_size=4096)
    np.testing.assert_allclose(np.asarray(a.centroids), np.asarray(b.centroids), rtol=1e-5, atol=1e-5)


def test_empty_clusters_are_reseeded():
    # 10 distinct points, many duplicates: plain Lloyd would leave clusters empty.
    base = np.arange(10, dtype=np.float32)[:, None] * 5.0
    x = np.repeat(base, 30, axis=0)
    res = kmeans(x, 10, key=jax.random.PRNGKey(0), iters=10)
    # all 10 distinct values become centroids: objective reaches 0
    assert float(res.inertia[-1]) < 1e-6
    assert sorted(np.round(np.asarray(res.centroids)[:, 0], 3).tolist()) == base[:, 0].tolist()


def test_weights_zero_points_ignored():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((400, 2)).astype(np.float32)
    x[:200] += 100.0  # far cluster with zero weight
    w = np.ones(400, np.float32)
    w[:200] = 0.0
    res = kmeans(x, 4, key=jax.random.PRNGKey(0), iters=10, weights=w)
    assert np.abs(np.asarray(res.centroids)).max() < 10.0


def test_weights_scale_like_duplicates():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((300, 2)).astype(np.float32)
    w = rng.integers(1, 4, size=300).astype(np.float32)
    xd = np.repeat(x, w.astype(int), axis=0)
    # with the same init (all points seeded alike is not possible), compare objectives:
    rw = kmeans(x, 8, key=jax.random.PRNGKey(0), iters=30, weights=w)
    rd = kmeans(xd, 8, key=jax.random.PRNGKey(0), iters=30)
    _, mw = assign(jnp.asarray(xd), rw.centroids)
    _, md = assign(jnp.asarray(xd), rd.centroids)
    # both are local optima of the same weighted objective: within 15%
    assert abs(float(mw.sum()) - float(md.sum())) / float(md.sum()) < 0.15


def test_tolerance_stops_early():
    x, _ = _blobs(1)
    res = kmeans(x, 4, key=jax.random.PRNGKey(0), iters=50, tol=1e-4)
    assert int(res.iterations) < 50
    assert np.isnan(np.asarray(res.inertia)[int(res.iterations):]).all()


@pytest.mark.parametrize(
    "x, k, kw, match",
    [
        (np.full((10, 2), np.nan, np.float32), 2, {}, "NaN/Inf"),
        (np.array([[0.0, np.inf]] * 10, np.float32), 2, {}, "NaN/Inf"),
        (np.zeros((5, 2), np.float32), 8, {}, "at least k=8"),
        (np.zeros((5,), np.float32), 2, {}, r"\[\.\.\., N, d\]"),
        (np.zeros((10, 2), np.int32), 2, {}, "floating"),
        (np.zeros((10, 2), np.float32), 2, {"weights": -np.ones(10, np.float32)}, ">= 0"),
        (np.zeros((10, 2), np.float32), 2, {"weights": np.ones(9, np.float32)}, "weights must have shape"),
        (np.zeros((10, 2), np.float32), 0, {}, "positive int"),
    ],
)
def test_bad_inputs(x, k, kw, match):
    with pytest.raises(ValueError, match=match):
        kmeans(x, k, key=jax.random.PRNGKey(0), **kw)


def test_zero_iterations_returns_the_seeding():
    x = np.random.default_rng(9).standard_normal((2, 200, 3)).astype(np.float32)
    res = kmeans(x, 8, key=jax.random.PRNGKey(0), iters=0)
    assert res.centroids.shape == (2, 8, 3) and res.inertia.shape == (2, 0)
    assert np.asarray(res.iterations).tolist() == [0, 0]
    # k-means++ seeds are data points
    c = np.asarray(res.centroids)
    assert all(np.isclose(x[b], c[b, j]).all(-1).any() for b in range(2) for j in range(8))

"""Batched, jit-compiled k-means (Lloyd) with k-means++ initialisation.

One call fits many independent problems at once: every leading axis of ``x``
is a batch axis (e.g. layers x heads x subspaces), handled by ``vmap``. The
whole fit (init, iterations, optional early stop) is one XLA program.

Design choices:
- Initialisation: greedy-free k-means++ (D^2 sampling, weighted by the sample
  weights) on a uniform random subsample of at most ``init_sample`` points.
  Seeding on a subsample keeps the sequential K-step init cheap for millions
  of vectors; Lloyd iterations then run on every point.
- Assignment is chunked (``chunk_size`` points at a time, fewer when many
  problems run at once, see ``DIST_BUDGET``) so memory is
  O(min(problems * chunk_size * K, DIST_BUDGET) + N) whatever N is. On CPU, small
  sub-vectors (d <= 8, PQ's case) are assigned by a loop over the K centroids that keeps a
  running (distance, index) per point: elementwise work that XLA vectorises over points and
  problems, about an order of magnitude faster there than an argmin reduce over [K, n].
- Long reductions and the k-means++ draws run over [n / c, c] layouts (major-axis first),
  which vectorise on CPU where a minor-axis chain does not.
- Empty clusters are re-seeded with the points farthest from their current
  centroid (deterministic; it never increases the objective).
- ``inertia[i]`` is the weighted sum of squared distances of the assignment
  made with the centroids at the start of iteration i; Lloyd steps and the
  re-seeding never increase it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["centroids", "inertia", "iterations"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KMeansResult:
    """Output of :func:`kmeans`.

    centroids:  float32[..., K, d]
    inertia:    float32[..., iters]  objective per iteration (NaN after an early stop)
    iterations: int32[...]           Lloyd iterations actually run
    """

    centroids: jax.Array
    inertia: jax.Array
    iterations: jax.Array


def _check_inputs(x, k: int, weights, iters: int, tol) -> None:
    if x.ndim < 2:
        raise ValueError(f"kmeans: x must be [..., N, d], got shape {x.shape}")
    n = x.shape[-2]
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"kmeans: k must be a positive int, got {k!r}")
    if n < k:
        raise ValueError(
            f"kmeans: need at least k={k} vectors per problem, got N={n} "
            "(collect more calibration data or use fewer bits)"
        )
    if iters < 0:
        raise ValueError(f"kmeans: iters must be >= 0, got {iters}")
    if tol is not None and tol < 0:
        raise ValueError(f"kmeans: tol must be >= 0 or None, got {tol}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"kmeans: x must be floating point, got {x.dtype}")
    if weights is not None and weights.shape != x.shape[:-1]:
        raise ValueError(
            f"kmeans: weights must have shape {x.shape[:-1]} (x without d), got {weights.shape}"
        )
    # Finite checks need concrete values; under an outer jit they are skipped.
    for name, arr in (("x", x), ("weights", weights)):
        if arr is None or isinstance(arr, jax.core.Tracer):
            continue
        finite = np.isfinite(np.asarray(arr))
        if not finite.all():
            bad = int((~finite).sum())
            raise ValueError(f"kmeans: {name} contains {bad} NaN/Inf values")
    if weights is not None and not isinstance(weights, jax.core.Tracer):
        w = np.asarray(weights)
        if (w < 0).any():
            raise ValueError("kmeans: weights must be >= 0")
        if (np.sum(w > 0, axis=-1) < k).any():
            raise ValueError(f"kmeans: fewer than k={k} vectors with positive weight")


def _sq_dists_t(x: jax.Array, c: jax.Array) -> jax.Array:
    """Squared distances float32[K, n] between x [n, d] and c [K, d] (matmul form, d > 8).

    Laid out centroid-major so the reduction over K runs along the major axis.
    """
    xt = x.T  # [d, n]
    x2 = jnp.sum(xt * xt, axis=0)
    c2 = jnp.sum(c * c, axis=-1)
    d = c2[:, None] - 2.0 * (c @ xt) + x2[None, :]
    return jnp.maximum(d, 0.0)


def _sq_to_point(xt: jax.Array, p: jax.Array) -> jax.Array:
    """Squared distances f32[n] of points xt [d, n] (dims-major) to one point p [d], by exact
    per-dimension differences (elementwise over the points, reduced over the major axis for
    larger d; both vectorise on CPU)."""
    if xt.shape[0] > SMALL_DIM:
        return jnp.sum((xt - p[:, None]) ** 2, axis=0)
    return sum((xt[j] - p[j]) ** 2 for j in range(xt.shape[0]))


def _nearest_broadcast(x: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(index int32[n], sq_dist f32[n]) of x [n, d] against c [K, d], all K at once."""
    if x.shape[-1] <= SMALL_DIM:
        # exact per-dimension differences; a matmul with an inner dim of 2 is wasted work
        d = sum((x[:, j][None, :] - c[:, j][:, None]) ** 2 for j in range(x.shape[-1]))
    else:
        d = _sq_dists_t(x, c)
    return jnp.argmin(d, axis=0).astype(jnp.int32), jnp.min(d, axis=0)


def _nearest_scan(x: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """As :func:`_nearest_broadcast` for small d, as a loop over the K centroids.

    Each step updates the running (best distance, index) of every point with one centroid:
    plain elementwise work that XLA's CPU backend vectorises over the points (and over every
    vmapped problem at once), where a variadic argmin reduce over K is not vectorised. Strict
    ``<`` keeps the first of equal distances, as argmin does.
    """
    n = x.shape[0]
    xt = x.T  # [d, n]

    def body(k, carry):
        best, idx = carry
        dk = _sq_to_point(xt, c[k])
        return jnp.minimum(best, dk), jnp.where(dk < best, k, idx)

    init = (jnp.full((n,), jnp.inf, jnp.float32), jnp.zeros((n,), jnp.int32))
    best, idx = jax.lax.fori_loop(0, c.shape[0], body, init, unroll=8)
    return idx, best


# Sub-vectors of at most this many dims use exact differences instead of the matmul form.
SMALL_DIM = 8
# With at least this many points per chunk (and small d, on CPU) the K-loop form is used.
SCAN_MIN_POINTS = 256


def _nearest(x: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Nearest centroid of each row: x float32[n, d], c float32[K, d] -> (int32[n], f32[n])."""
    if x.shape[-1] <= SMALL_DIM and x.shape[0] >= SCAN_MIN_POINTS and jax.default_backend() == "cpu":
        return _nearest_scan(x, c)
    return _nearest_broadcast(x, c)


# Upper bound on distance-matrix elements alive at once across a vmapped batch
# (2**26 float32 = 256 MiB): the per-problem chunk shrinks as the batch grows.
DIST_BUDGET = 2**26


def batched_chunk(chunk_size: int, num_problems: int, k: int) -> int:
    """Per-problem chunk so that num_problems * k * chunk stays within DIST_BUDGET."""
    return max(1, min(chunk_size, DIST_BUDGET // max(1, num_problems * k)))


def _chunks(x: jax.Array, w: jax.Array, chunk_size: int):
    """Pad N up to a multiple of chunk_size; padding rows get weight 0."""
    n, d = x.shape
    chunk = min(chunk_size, n)
    n_pad = -n % chunk
    xp = jnp.pad(x, ((0, n_pad), (0, 0)))
    wp = jnp.pad(w, (0, n_pad))
    return xp.reshape(-1, chunk, d), wp.reshape(-1, chunk)


def assign(x: jax.Array, centroids: jax.Array, chunk_size: int = 8192):
    """Nearest centroid for each row, in chunks.

    x: float[N, d], centroids: float[K, d] -> (index int32[N], sq_dist float32[N])
    """
    n = x.shape[0]
    xc, _ = _chunks(x.astype(jnp.float32), jnp.zeros((n,), jnp.float32), chunk_size)
    c = centroids.astype(jnp.float32)
    idx, mind = jax.lax.map(lambda xb: _nearest(xb, c), xc)
    return idx.reshape(-1)[:n], mind.reshape(-1)[:n]


def _lloyd_stats(x, w, centroids, chunk_size):
    """One assignment pass: per-cluster weighted sums/counts, point distances, inertia."""
    n = x.shape[0]
    k = centroids.shape[0]
    xc, wc = _chunks(x, w, chunk_size)

    def body(carry, xs):
        sums, counts = carry
        xb, wb = xs
        idx, mind = _nearest(xb, centroids)
        sums = sums + jax.ops.segment_sum(xb * wb[:, None], idx, num_segments=k)
        counts = counts + jax.ops.segment_sum(wb, idx, num_segments=k)
        return (sums, counts), mind

    init = (jnp.zeros_like(centroids), jnp.zeros((k,), jnp.float32))
    (sums, counts), mind = jax.lax.scan(body, init, (xc, wc))
    mind = mind.reshape(-1)[:n]
    inertia = _sum(mind * w)
    return sums, counts, mind, inertia


def _lanes(n: int) -> int:
    """A lane count for :func:`_sum` / :func:`_sample`: a divisor of n near sqrt(n)."""
    c = 1
    while c * c < n:
        c *= 2
    while n % c:
        c //= 2
    return c


def _sum(a: jax.Array) -> jax.Array:
    """Sum of a float[n] as a reduction over the major axis of [n / c, c] first.

    A long minor-axis float sum is a sequential chain on CPU; this form vectorises.
    """
    c = _lanes(a.shape[0])
    return jnp.sum(jnp.sum(a.reshape(-1, c), axis=0))


def _sample(p: jax.Array, u: jax.Array) -> jax.Array:
    """Index j drawn with probability p[j] / sum(p) (p float[n] >= 0, sum > 0; u ~ U[0, 1)).

    Two-level inverse CDF on p laid out as [n / c, c]: pick a column by its mass, then a row
    of that column. Costs one vectorised pass over p plus O(sqrt n) sequential work.
    """
    n = p.shape[0]
    c = _lanes(n)
    grid = p.reshape(-1, c)  # [R, c]
    col_mass = jnp.sum(grid, axis=0)  # [c]
    col_cdf = jnp.cumsum(col_mass)
    t = u * col_cdf[-1]
    # the first column whose CDF passes t has mass > 0; round-off past the end takes the last
    # column (row) with mass, never a zero-mass point
    col = jnp.minimum(jnp.sum(col_cdf <= t), _last_positive(col_mass))
    before = jnp.where(col > 0, col_cdf[jnp.maximum(col - 1, 0)], 0.0)
    column = grid[:, col]  # [R]
    row = jnp.minimum(jnp.sum(jnp.cumsum(column) <= t - before), _last_positive(column))
    return (row * c + col).astype(jnp.int32)


def _last_positive(a: jax.Array) -> jax.Array:
    """Index of the last a[i] > 0 (0 if none)."""
    return jnp.max(jnp.where(a > 0, jnp.arange(a.shape[0], dtype=jnp.int32), 0))


def _kmeans_pp(key, x, w, k: int):
    """k-means++ seeding: each new centre drawn with probability ~ w * D^2."""
    n = x.shape[0]
    k0, k1 = jax.random.split(key)
    us = jax.random.uniform(k1, (k,))
    first = _sample(w, us[0])
    cents = jnp.zeros((k, x.shape[1]), x.dtype).at[0].set(x[first])
    xt = x.T  # [d, n]
    d2 = _sq_to_point(xt, x[first])

    def body(i, carry):
        cents, d2 = carry
        p = d2 * w
        # All mass on chosen points (duplicates): fall back to the weights.
        p = jnp.where(_sum(p) > 0, p, w)
        j = _sample(p, us[i])
        return cents.at[i].set(x[j]), jnp.minimum(d2, _sq_to_point(xt, x[j]))

    cents, _ = jax.lax.fori_loop(1, k, body, (cents, d2))
    return cents


def _kmeans_single(key, x, w, k, iters, tol, chunk_size, init_sample):
    x = x.astype(jnp.float32)
    w = w.astype(jnp.float32)
    n = x.shape[0]
    kinit, _ = jax.random.split(key)
    if n > init_sample:
        # Uniform subsample (without replacement) among points with weight > 0.
        g = jax.random.gumbel(kinit, (n,)) + jnp.log(jnp.where(w > 0, 1.0, 0.0))
        _, sel = jax.lax.top_k(g, init_sample)
        cents = _kmeans_pp(jax.random.fold_in(kinit, 1), x[sel], w[sel], k)
    else:
        cents = _kmeans_pp(jax.random.fold_in(kinit, 1), x, w, k)

    history = jnp.full((iters,), jnp.nan, jnp.float32)
    if iters == 0:  # seeding only
        return KMeansResult(centroids=cents, inertia=history, iterations=jnp.int32(0))

    def cond(carry):
        i, _, _, prev, cur = carry
        go = i < iters
        if tol is not None:
            improved = (prev - cur) > tol * jnp.maximum(jnp.abs(prev), 1e-30)
            go = go & ((i < 2) | improved)
        return go

    def body(carry):
        i, cents, history, _, cur = carry
        sums, counts, mind, inertia = _lloyd_stats(x, w, cents, chunk_size)
        history = history.at[i].set(inertia)
        empty = counts <= 0
        means = sums / jnp.where(empty, 1.0, counts)[:, None]
        # Farthest points (by distance to their own centroid) re-seed empty clusters.
        # Points with weight 0 are never chosen.
        _, far = jax.lax.top_k(jnp.where(w > 0, mind, -1.0), min(k, n))
        rank = jnp.cumsum(empty) - 1
        new = jnp.where(empty[:, None], x[far[jnp.clip(rank, 0, far.shape[0] - 1)]], means)
        return i + 1, new, history, cur, inertia

    inf = jnp.float32(jnp.inf)
    i, cents, history, _, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cents, history, inf, inf)
    )
    return KMeansResult(centroids=cents, inertia=history, iterations=i)


@functools.partial(
    jax.jit, static_argnames=("k", "iters", "tol", "chunk_size", "init_sample")
)
def _kmeans_batched(key, x, w, *, k, iters, tol, chunk_size, init_sample):
    batch_shape = x.shape[:-2]
    n, d = x.shape[-2:]
    nb = int(np.prod(batch_shape)) if batch_shape else 1
    xf = x.reshape(nb, n, d)
    wf = w.reshape(nb, n)
    keys = jax.random.split(key, nb)
    fit = functools.partial(
        _kmeans_single, k=k, iters=iters, tol=tol, chunk_size=batched_chunk(chunk_size, nb, k),
        init_sample=init_sample,
    )
    res = jax.vmap(fit)(keys, xf, wf)
    return jax.tree.map(lambda a: a.reshape(batch_shape + a.shape[1:]), res)


def kmeans(
    x: jax.Array,
    k: int,
    *,
    key: jax.Array,
    iters: int = 25,
    tol: float | None = None,
    weights: jax.Array | None = None,
    chunk_size: int = 8192,
    init_sample: int | None = None,
) -> KMeansResult:
    """Fit k centroids to each independent problem in ``x``.

    Args:
      x: float[..., N, d]; leading axes are independent problems.
      k: number of centroids (<= N).
      key: PRNG key; the result is a deterministic function of (x, key, settings).
      iters: maximum Lloyd iterations.
      tol: stop a problem once the relative objective improvement of an
        iteration falls below ``tol`` (None: always run ``iters``).
      weights: optional float[..., N] non-negative sample weights.
      chunk_size: points per assignment chunk (bounds memory).
      init_sample: points used for k-means++ seeding (default ``max(16 * k, 4096)``).

    Returns:
      KMeansResult with centroids float32[..., k, d].
    """
    x = jnp.asarray(x)
    if weights is not None:
        weights = jnp.asarray(weights)
    _check_inputs(x, k, weights, iters, tol)
    if weights is None:
        weights = jnp.ones(x.shape[:-1], jnp.float32)
    if init_sample is None:
        init_sample = max(16 * k, 4096)
    return _kmeans_batched(
        key,
        x,
        weights,
        k=int(k),
        iters=int(iters),
        tol=None if tol is None else float(tol),
        chunk_size=int(chunk_size),
        init_sample=int(min(init_sample, x.shape[-2])),
    )

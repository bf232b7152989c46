"""Calibration: K/V samples (keys after or before RoPE) -> PQ codebooks at a chosen granularity.

The model side (running calibration text through a model with a DenseCache)
lives in the CLI layer; this module only needs the filled caches:

    k, v = collect_kv(dense_cache)                 # float32[L, Hkv, N, d] valid tokens only
    books = fit_kv_codebooks(k, v, M=32, nbits=8, granularity="layer_head", key=key)

Keys and values may get their own budgets (``value_M`` / ``value_nbits``) and transforms
(``key_transform`` A, ``value_transform`` B, float[L, Gt, d, d]; :mod:`million_jax.quant.kv_transforms`):
the codebooks are then fitted on A k and B v and the returned PQCodebooks carry A and B.
The query Gram of the query-aware A comes from a filled ``QueryStatsCache`` (``collect_query_gram``).

Sampling: for each k-means problem (one per codebook group and subspace) at
most ``max_vectors`` vectors are drawn uniformly without replacement from the
group's pool: all layers and heads for ``shared``, all heads of a layer for
``layer``, one (layer, head) for ``layer_head``. Every pooled token is equally
likely, so positions, heads and layers are sampled uniformly.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from million_jax import rope
from million_jax.cache.dense import DenseCache
from million_jax.cache.query_stats import QueryStatsCache
from million_jax.quant.kv_transforms import transform_rows
from million_jax.quant.pq import Codebooks, check_nbits, check_subspaces, fit_codebooks
from million_jax.quant.kv_codebooks import GRANULARITIES, PQCodebooks, check_pre_rope_keys, per_layer_centroids
from million_jax.quant.residual_pq import check_stage_count, fit_stages

__all__ = ["check_max_vectors", "collect_kv", "collect_query_gram", "fit_kv_codebooks", "fit_pair_key_centroids",
           "fit_value_centroids", "codebook_groups",
           "fit_in_chunks", "DEFAULT_MAX_VECTORS",
           "GROUPS_PER_FIT"]

DEFAULT_MAX_VECTORS = 65536
GROUPS_PER_FIT = 8  # codebook groups per jitted k-means call (a chance to stop in between)


def collect_kv(cache: DenseCache, *, rope_inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Valid tokens of a filled DenseCache as float32[L, Hkv, N, d] (N = sum of lengths).

    The cache holds keys after RoPE. With ``rope_inv_freq`` float[d/2] (the model's,
    ``million_jax.rope.rope_inv_freq``) the keys come back *before* RoPE: each row is rotated
    back by its position (row t of a sequence is position t), so the same calibration forward
    serves pre-RoPE codebooks.
    """
    k = np.asarray(cache.layers.k, np.float32)
    v = np.asarray(cache.layers.v, np.float32)
    lengths = np.asarray(cache.lengths)
    if rope_inv_freq is not None:
        cos, sin = rope.rope_cos_sin(np.arange(k.shape[3]), rope_inv_freq)  # f32[T, d/2]
        k = np.asarray(rope.unrotate(k, cos, sin), np.float32)  # k: [L, B, Hkv, T, d]
    ks = [k[:, b, :, : lengths[b]] for b in range(k.shape[1]) if lengths[b] > 0]
    vs = [v[:, b, :, : lengths[b]] for b in range(v.shape[1]) if lengths[b] > 0]
    if not ks:
        raise ValueError("collect_kv: the cache holds no tokens (empty calibration data)")
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)


def collect_query_gram(cache: QueryStatsCache) -> tuple[np.ndarray, np.ndarray]:
    """(q_gram float64[L, Hkv, d, d], q_count float64[L, Hkv]) of a filled QueryStatsCache."""
    if not isinstance(cache, QueryStatsCache):
        raise ValueError(f"collect_query_gram needs a QueryStatsCache, got {type(cache).__name__}")
    return np.asarray(cache.layers.q_gram, np.float64), np.asarray(cache.layers.q_count, np.float64)


def _pool(x: np.ndarray, granularity: str) -> np.ndarray:
    """float[L, Hkv, N, d] -> float[*groups, P, d] pooled per codebook group."""
    L, hkv, n, d = x.shape
    if granularity == "shared":
        return x.reshape(L * hkv * n, d)
    if granularity == "layer":
        return x.reshape(L, hkv * n, d)
    return x


def _subsample(x: np.ndarray, max_vectors: int, rng: np.random.Generator,
               weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(x, weights) with at most ``max_vectors`` of the P vectors of each group, drawn uniformly
    (x float[*G, P, d], weights float[*G, P] or None: the same rows kept)."""
    p = x.shape[-2]
    if p <= max_vectors:
        return x, weights
    # one uniform draw per group (groups are independent problems)
    groups = x.shape[:-2]
    flat = x.reshape((-1, p, x.shape[-1]))
    rows = [np.sort(rng.choice(p, size=max_vectors, replace=False)) for _ in flat]
    picked = np.stack([f[r] for f, r in zip(flat, rows)]).reshape(groups + (max_vectors, x.shape[-1]))
    if weights is None:
        return picked, None
    wf = weights.reshape((-1, p))
    return picked, np.stack([w[r] for w, r in zip(wf, rows)]).reshape(groups + (max_vectors,))


def _check_weights(name: str, w: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """float32[L, Hkv, N] sample weights (ValueError unless finite, >= 0 and not all zero per head)."""
    if w is None:
        return None
    w = np.asarray(w, np.float32)
    if w.shape != shape:
        raise ValueError(f"fit_kv_codebooks: {name} must be float[L, Hkv, N] = {list(shape)}, got {list(w.shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"fit_kv_codebooks: {name} must be finite and >= 0")
    if (w.sum(axis=-1) <= 0).any():
        raise ValueError(f"fit_kv_codebooks: {name} are all zero for some layer / KV head")
    return w


def fit_kv_codebooks(
    keys: np.ndarray,
    values: np.ndarray,
    *,
    M: int,
    nbits: int,
    granularity: str = "layer_head",
    key: jax.Array,
    max_vectors: int = DEFAULT_MAX_VECTORS,
    iters: int = 25,
    chunk_size: int = 8192,
    value_M: int | None = None,
    value_nbits: int | None = None,
    key_transform: np.ndarray | None = None,
    value_transform: np.ndarray | None = None,
    groups_per_fit: int = GROUPS_PER_FIT,
    progress: Callable[[int, int], None] | None = None,
    stages: int = 1,
    key_weights: np.ndarray | None = None,
    value_weights: np.ndarray | None = None,
    rope_inv_freq: np.ndarray | None = None,
) -> PQCodebooks:
    """Fit key and value codebooks from calibration samples.

    keys, values: float[L, Hkv, N, d] (post-RoPE keys). Returns PQCodebooks fitted as
    one codebook per model (shared), layer (layer) or layer and KV head (layer_head),
    laid out per layer: centroids [L, G, M, K, dsub], G = Hkv or 1. M / nbits are the keys'
    budget, value_M / value_nbits the values' (default: the keys'); transforms see the module
    docstring.

    ``stages`` > 1: residual PQ (:mod:`million_jax.quant.residual_pq`), M sub-vectors per stage,
    each stage fitted on what the previous ones leave; the result holds S * M codes per vector.

    ``key_weights`` / ``value_weights``: float[L, Hkv, N] per-vector k-means weights (e.g. the
    attention each token receives: ``benchmarks/attention_mass_weights.py``), pooled and
    subsampled with their vectors; None: every vector counts once.

    ``rope_inv_freq`` float[d/2]: ``keys`` are *pre-RoPE* keys (``collect_kv(...,
    rope_inv_freq=...)``); the key sub-spaces are whole RoPE pairs (``M`` divides d/2: M = d/2,
    one pair each; M = d/4, pairs m and m + d/4, :func:`million_jax.rope.to_pair_layout`) and the result is marked
    ``key_rope == "pre"`` (:meth:`PQCodebooks.with_pre_rope_keys`). No key transform then.

    The codebook groups are fitted ``groups_per_fit`` at a time (:func:`fit_in_chunks`);
    ``progress(done, total)`` is called after each such fit (it may raise to stop).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    keys = np.asarray(keys, np.float32)
    values = np.asarray(values, np.float32)
    if keys.ndim != 4 or keys.shape != values.shape:
        raise ValueError(f"keys/values must both be [L, Hkv, N, d], got {keys.shape} and {values.shape}")
    value_M = M if value_M is None else value_M
    value_nbits = nbits if value_nbits is None else value_nbits
    for m, nb in ((M, nbits), (value_M, value_nbits)):
        check_nbits(nb)
        check_subspaces(keys.shape[-1], m)
    if keys.shape[2] == 0:
        raise ValueError("fit_kv_codebooks: no calibration vectors (N = 0)")
    for name, arr in (("keys", keys), ("values", values)):
        if not np.isfinite(arr).all():
            raise ValueError(f"fit_kv_codebooks: calibration {name} contain NaN/Inf")
    for nb in (nbits, value_nbits):
        check_max_vectors(max_vectors, nb)
    if rope_inv_freq is not None:
        check_pre_rope_keys(keys.shape[-1], M, key_transform is not None)
        keys = rope.to_pair_layout(keys, keys.shape[-1] // (2 * M))  # sub-spaces of whole RoPE pairs
    key_weights = _check_weights("key_weights", key_weights, keys.shape[:3])
    value_weights = _check_weights("value_weights", value_weights, keys.shape[:3])
    if key_transform is not None:
        keys = transform_rows(keys, key_transform)
    if value_transform is not None:
        values = transform_rows(values, value_transform)
    kk, kv = jax.random.split(key)
    rng = np.random.default_rng(int(jax.random.randint(kk, (), 0, 2**31 - 1)))
    stages = check_stage_count(stages)
    per_set = stages * fits_needed(codebook_groups(granularity, *keys.shape[:2]), groups_per_fit)
    done = [0]

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], 2 * per_set)

    out = [_fit_side(x, wts, m, nb, granularity=granularity, key=sub, rng=rng, max_vectors=max_vectors, stages=stages,
                     iters=iters, chunk_size=chunk_size, groups_per_fit=groups_per_fit, progress=step)
           for sub, x, wts, m, nb in ((kk, keys, key_weights, M, nbits), (kv, values, value_weights, value_M, value_nbits))]
    books = PQCodebooks.from_centroids(out[0].centroids, out[1].centroids, granularity, num_layers=keys.shape[0],
                                       stages=stages)
    books = books.with_transforms(key_transform, value_transform)
    return books if rope_inv_freq is None else books.with_pre_rope_keys(rope_inv_freq)


def _fit_side(x: np.ndarray, wts: np.ndarray | None, M: int, nbits: int, *, granularity: str, key: jax.Array,
              rng: np.random.Generator, max_vectors: int, stages: int, iters: int, chunk_size: int,
              groups_per_fit: int, progress: Callable[[], None] | None) -> Codebooks:
    """Codebooks float32[*G, S * M, K, dsub] of one side (keys or values) float32[L, Hkv, N, d],
    as laid out for fitting (pair layout, transformed), pooled by ``granularity``."""
    pooled, wts = _subsample(_pool(x, granularity), max_vectors, rng,
                             None if wts is None else _pool(wts[..., None], granularity)[..., 0])
    if pooled.shape[-2] < 2**nbits:
        raise ValueError(
            f"calibration gives {pooled.shape[-2]} vectors per {granularity} codebook, fewer than "
            f"K=2**{nbits}={2**nbits}; use more calibration tokens or fewer bits"
        )
    fit = functools.partial(fit_in_chunks, groups_per_fit=groups_per_fit, progress=progress)
    return fit_stages(pooled, M, nbits, stages, key=key, fit=fit, iters=iters, chunk_size=chunk_size, weights=wts)


def fit_pair_key_centroids(keys: np.ndarray, nbits: int, *, granularity: str = "layer_head", key: jax.Array,
                           max_vectors: int = DEFAULT_MAX_VECTORS, iters: int = 25, chunk_size: int = 8192,
                           groups_per_fit: int = GROUPS_PER_FIT,
                           progress: Callable[[], None] | None = None) -> np.ndarray:
    """Key centroids float32[L, G, d/2, 2**nbits, 2] of pre-RoPE keys float[L, Hkv, N, d], one
    2-dim sub-space per RoPE pair (what ``fit_kv_codebooks(..., M=d/2, rope_inv_freq=...)`` fits for
    the keys, without the values): the codebooks of one width of a per-pair allocation
    (:mod:`million_jax.calibration.pair_bits`). ``progress()`` after each chunk of groups."""
    return _fit_two_dim(keys, nbits, pair_layout=True, granularity=granularity, key=key, max_vectors=max_vectors,
                        iters=iters, chunk_size=chunk_size, groups_per_fit=groups_per_fit, progress=progress,
                        what="fit_pair_key_centroids: calibration keys")


def fit_value_centroids(values: np.ndarray, nbits: int, *, granularity: str = "layer_head", key: jax.Array,
                        max_vectors: int = DEFAULT_MAX_VECTORS, iters: int = 25, chunk_size: int = 8192,
                        groups_per_fit: int = GROUPS_PER_FIT,
                        progress: Callable[[], None] | None = None) -> np.ndarray:
    """Value centroids float32[L, G, d/2, 2**nbits, 2] of values float[L, Hkv, N, d] in 2-dim
    sub-spaces (dims 2m, 2m + 1; what ``fit_kv_codebooks(..., value_M=d/2)`` fits for the values,
    without the keys): one width of a per-sub-space value allocation."""
    return _fit_two_dim(values, nbits, pair_layout=False, granularity=granularity, key=key, max_vectors=max_vectors,
                        iters=iters, chunk_size=chunk_size, groups_per_fit=groups_per_fit, progress=progress,
                        what="fit_value_centroids: calibration values")


def _fit_two_dim(x: np.ndarray, nbits: int, *, pair_layout: bool, granularity: str, key: jax.Array,
                 max_vectors: int, iters: int, chunk_size: int, groups_per_fit: int,
                 progress: Callable[[], None] | None, what: str) -> np.ndarray:
    """Centroids float32[L, G, d/2, 2**nbits, 2] of x float[L, Hkv, N, d] in 2-dim sub-spaces (RoPE
    pairs with ``pair_layout``, else dims 2m, 2m + 1)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    x = np.asarray(x, np.float32)
    if x.ndim != 4 or x.shape[2] == 0 or x.shape[3] % 2:
        raise ValueError(f"{what} must be float[L, Hkv, N >= 1, d] with d even, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{what} contain NaN/Inf")
    check_nbits(nbits)
    check_max_vectors(max_vectors, nbits)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    books = _fit_side(rope.to_pair_layout(x, 1) if pair_layout else x, None, x.shape[-1] // 2, nbits,
                      granularity=granularity, key=jax.random.fold_in(key, 1), rng=rng, max_vectors=max_vectors,
                      stages=1, iters=iters, chunk_size=chunk_size, groups_per_fit=groups_per_fit, progress=progress)
    return np.asarray(per_layer_centroids(books.centroids, granularity, x.shape[0]), np.float32)


def codebook_groups(granularity: str, num_layers: int, num_kv_heads: int) -> int:
    """How many codebooks (k-means problems per sub-space) a granularity fits for a model."""
    return {"shared": 1, "layer": num_layers, "layer_head": num_layers * num_kv_heads}[granularity]


def check_max_vectors(max_vectors: int, nbits: int) -> None:
    """ValueError when ``max_vectors`` (vectors sampled per k-means problem) is below K = 2**nbits."""
    if max_vectors < 2**nbits:
        raise ValueError(f"max_vectors={max_vectors} is below the K=2**{nbits}={2**nbits} centroids")


def chunk_groups(g: int, groups_per_fit: int) -> int:
    """Groups per fit for G = ``g`` groups (see :func:`fit_in_chunks`)."""
    gpf = max(1, int(groups_per_fit))
    if g <= gpf:
        return g
    return next((s for s in range(gpf, max(1, gpf // 2) - 1, -1) if g % s == 0), -(-g // -(-g // gpf)))


def fits_needed(g: int, groups_per_fit: int) -> int:
    """How many fits :func:`fit_in_chunks` makes for ``g`` groups."""
    return -(-g // chunk_groups(g, groups_per_fit))


def fit_in_chunks(pooled: np.ndarray, M: int, nbits: int, *, key: jax.Array,
                  groups_per_fit: int = GROUPS_PER_FIT, progress: Callable[[], None] | None = None,
                  weights: np.ndarray | None = None, **kmeans_options: Any):
    """``fit_codebooks`` over pooled float32[*G, N, d], ``groups_per_fit`` groups per call.

    Splitting the work gives the caller a chance to report progress or stop between calls
    (``progress()`` runs after each; it may raise). One call (G <= groups_per_fit) is exactly
    ``fit_codebooks(pooled, key=key)``; otherwise chunk i uses ``fold_in(key, i)``. Chunks
    are equal (a divisor of G in [groups_per_fit / 2, groups_per_fit] when there is one, else
    the last chunk is padded with copies of its last group, discarded) so one compiled
    program serves every chunk. ``weights``: float[*G, N] per-vector weights, chunked alike.
    Returns Codebooks with centroids float32[*G, M, K, dsub].
    """
    lead = pooled.shape[:-2]
    g = int(np.prod(lead)) if lead else 1
    size = chunk_groups(g, groups_per_fit)
    if size >= g:
        res = fit_codebooks(pooled, M, nbits, key=key, weights=weights, **kmeans_options)
        if progress is not None:
            progress()
        return res
    n_chunks = -(-g // size)
    flat = pooled.reshape((g,) + pooled.shape[-2:])
    wflat = None if weights is None else np.asarray(weights).reshape((g, -1))
    parts = []
    for i in range(n_chunks):
        chunk = flat[i * size: (i + 1) * size]
        wchunk = None if wflat is None else wflat[i * size: (i + 1) * size]
        real = chunk.shape[0]
        if real < size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], size - real, axis=0)])
            wchunk = None if wchunk is None else np.concatenate([wchunk, np.repeat(wchunk[-1:], size - real, axis=0)])
        books = fit_codebooks(chunk, M, nbits, key=jax.random.fold_in(key, i), weights=wchunk, **kmeans_options)
        parts.append(np.asarray(books.centroids)[:real])
        if progress is not None:
            progress()
    cents = np.concatenate(parts, axis=0)
    return Codebooks(centroids=cents.reshape(lead + cents.shape[1:]))

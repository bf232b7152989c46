"""Residual (multi-stage) product quantization, laid out so attention reads it as plain PQ.

A vector x float[d] is encoded in S stages: stage 1 is PQ with M sub-vectors of dsub = d / M
dims; stage s + 1 quantizes what stages 1..s left over (x minus their reconstruction) with
its own codebook of the same M x dsub layout. The reconstruction is the sum of the stages:

    x_hat = sum_s concat_m C_s,m[c_s,m]

The S codebooks are stored as ONE codebook of S * M sub-spaces, float32[*G, S * M, K, dsub]
(stage s owns sub-spaces s*M .. (s+1)*M - 1), and a code vector is the stages' codes side by
side, uint[..., S * M]. Read as plain PQ, that codebook describes vectors of S * d dims: the
concatenation [stage 1 part, ..., stage S part]. Hence, with the query tiled S times,

    q . x_hat = [q, ..., q] . concat_s(stage s part)      (a plain PQ score over S * M codes)
    sum_t p_t x_hat_t = sum over the S blocks of d of (sum_t p_t concat_s(...))

so every PQ attention path (LUT scores, centroid gathers, the Pallas kernel) serves residual
codes unchanged: :func:`tile_query` before, :func:`fold_output` after (the score scale stays
1 / sqrt(d), passed explicitly). S = 1 is plain PQ and every function here is the identity.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.quant.pq import Codebooks, encode, fit_codebooks
from pallas_kernels.pq_math import gather_centroids

__all__ = ["check_stage_count", "check_stages", "stage_codebooks", "encode_stages", "decode_stages", "tile_query", "fold_output",
           "fit_stages"]


def check_stage_count(stages: int) -> int:
    """``stages`` as an int (ValueError unless it is an integer >= 1)."""
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    return int(stages)


def check_stages(num_subspaces: int, stages: int) -> int:
    """The per-stage M of a codebook with ``num_subspaces`` sub-spaces in ``stages`` stages."""
    check_stage_count(stages)
    if num_subspaces % stages:
        raise ValueError(f"a codebook of {num_subspaces} sub-spaces cannot hold {stages} equal stages")
    return num_subspaces // stages


def stage_codebooks(codebooks: Codebooks, stages: int) -> list[Codebooks]:
    """The S per-stage codebooks [*G, M, K, dsub] of a stacked [*G, S * M, K, dsub] one."""
    m = check_stages(codebooks.num_subspaces, stages)
    c = codebooks.centroids
    return [Codebooks(c[..., s * m:(s + 1) * m, :, :]) for s in range(stages)]


def encode_stages(codebooks: Codebooks, x: jax.Array, stages: int) -> jax.Array:
    """x float[*G', N, d] -> codes [*broadcast(G', G), N, S * M], stage after stage on the residual."""
    if stages == 1:
        return encode(codebooks, x)
    residual = jnp.asarray(x, jnp.float32)
    codes = []
    for s, books in enumerate(stage_codebooks(codebooks, stages)):
        codes.append(encode(books, residual))
        if s + 1 < stages:  # the last stage's residual is not needed
            residual = residual - gather_centroids(books.centroids, codes[-1])
    return jnp.concatenate(codes, axis=-1)


def decode_stages(codebooks: Codebooks, codes: jax.Array, stages: int) -> jax.Array:
    """codes [*G', N, S * M] -> float32[*broadcast(G', G), N, d]: the sum of the stages."""
    return fold_output(gather_centroids(codebooks.centroids, codes), stages)  # [..., N, S * d] -> d


def tile_query(q: jax.Array, stages: int) -> jax.Array:
    """q float[..., d] -> float[..., S * d] ([q, ..., q]): the query of residual codes read as PQ."""
    return q if stages == 1 else jnp.tile(q, (1,) * (q.ndim - 1) + (stages,))


def fold_output(out: jax.Array, stages: int) -> jax.Array:
    """Attention output over residual value codes float[..., S * d] -> float[..., d] (sum of blocks)."""
    if stages == 1:
        return out
    return out.reshape(out.shape[:-1] + (stages, out.shape[-1] // stages)).sum(-2)


def fit_stages(x: np.ndarray, M: int, nbits: int, stages: int, *, key: jax.Array, fit=None,
               **kmeans_options: Any) -> Codebooks:
    """Fit S stages of PQ on pooled vectors x float32[*G, N, d] -> Codebooks [*G, S * M, K, dsub].

    Stage 1 is fitted on x, stage s + 1 on what stages 1..s leave (same vectors). ``fit``:
    the fitting function ``fit(x, M, nbits, key=..., **kmeans_options) -> Codebooks``
    (default :func:`million_jax.quant.pq.fit_codebooks`; calibration passes its chunked fit).
    """
    fit = fit_codebooks if fit is None else fit
    residual = np.asarray(x, np.float32)
    parts = []
    for s in range(stages):
        books = fit(residual, M, nbits, key=jax.random.fold_in(key, s) if s else key, **kmeans_options)
        parts.append(np.asarray(books.centroids))
        if s + 1 < stages:
            recon = gather_centroids(books.centroids, encode(books, residual))
            residual = residual - np.asarray(recon)
    return Codebooks(jnp.asarray(np.concatenate(parts, axis=-3)))

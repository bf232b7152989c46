"""Per-head linear transforms of keys and values before PQ (query-aware keys, output-aware values,
values in a paired principal basis).

A PQ codebook fitted by k-means minimises ``||x - x_hat||^2``. What attention cares about is
different:

* keys: the score error ``q . (k - k_hat)``. With ``A = (E[q q^T])^(1/2)`` over the queries
  that read a KV head, ``E[(q . e)^2] = ||A e||^2``: fitting PQ on ``A k`` makes k-means
  minimise the expected squared score error. At decode the query becomes ``A^-T q`` so that
  ``(A^-T q) . (A k) = q . k`` (one d x d product per query head and step, before the LUT).
* values: the error of the layer output ``sum_h Wo_h^T (v - v_hat)``. With
  ``B = (sum_h Wo_h Wo_h^T)^(1/2)`` over the query heads of a KV head, PQ is fitted on
  ``B v`` and the attention output read from codes is mapped back by ``B^-1``.
* values, in a paired principal basis (:func:`value_pca_transform`): ``B = Pi U^T``, U the
  principal axes of the values, ordered so that each 2-dim sub-space pairs the i-th widest axis
  with the i-th narrowest (Pi). A 2-dim k-means sub-space shares its bits between its two axes by
  itself, so pairing the widest with the narrowest spreads the variance evenly over the
  sub-spaces: an allocation of bits across the axes without codes of several widths. B is
  orthogonal (``B^-1 = B^T``, norms kept).

Transforms are per-layer constants: float32[L, Gt, d, d] with Gt = Hkv (or 1: one for all
heads), applied as ``y_h = T[h // (H / Gt)] @ x_h`` to head vectors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["sqrt_psd", "query_aware_key_transform", "output_gram", "output_value_transform", "value_pca_transform",
           "extreme_pairing", "apply_head_transform",
           "transform_rows", "check_transform", "inverse_transpose", "inverse"]

# Eigenvalues are floored at this fraction of the mean eigenvalue (a never-seen direction
# would otherwise make A singular and A^-T q explode).
EIG_FLOOR = 1e-4


def sqrt_psd(gram: np.ndarray, floor: float = EIG_FLOOR) -> np.ndarray:
    """Symmetric square root of PSD matrices float[..., d, d] (eigenvalues floored) -> float32."""
    g = np.asarray(gram, np.float64)
    if g.ndim < 2 or g.shape[-1] != g.shape[-2]:
        raise ValueError(f"sqrt_psd: expected [..., d, d] matrices, got shape {g.shape}")
    if not np.isfinite(g).all():
        raise ValueError("sqrt_psd: the Gram matrix contains NaN/Inf")
    g = 0.5 * (g + np.swapaxes(g, -1, -2))
    w, u = np.linalg.eigh(g)
    mean = np.maximum(w.mean(axis=-1, keepdims=True), np.finfo(np.float64).tiny)
    w = np.maximum(w, floor * mean)
    return ((u * np.sqrt(w)[..., None, :]) @ np.swapaxes(u, -1, -2)).astype(np.float32)


def query_aware_key_transform(q_gram: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """A = (E[q q^T])^(1/2) per layer and KV head.

    q_gram: float[L, Hkv, d, d] sums of q q^T over the (post-RoPE) queries of each KV head's
    query heads; counts: optional float[L, Hkv] (the scale of A does not change the codebook
    assignment, so it only normalises). Returns float32[L, Hkv, d, d].
    """
    g = np.asarray(q_gram, np.float64)
    if g.ndim != 4:
        raise ValueError(f"q_gram must be float[L, Hkv, d, d], got shape {g.shape}")
    if counts is not None:
        g = g / np.maximum(np.asarray(counts, np.float64), 1.0)[..., None, None]
    return sqrt_psd(g)


def output_gram(wo: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """G = sum_{h in group} Wo_h Wo_h^T float64[L, Hkv, d, d] per layer and KV head: how a value
    error e of the KV head moves the layer output of its query heads, sum_h |Wo_h^T e|^2 = e^T G e.

    wo: float[L, H*d, D] (the output projection, ``y = x @ wo``)."""
    wo = np.asarray(wo, np.float64)
    if wo.ndim != 3 or wo.shape[1] % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"wo must be float[L, H*d, D] with H={n_heads} a multiple of Hkv={n_kv_heads}, "
                         f"got shape {wo.shape}")
    L, hd, D = wo.shape
    d = hd // n_heads
    w = wo.reshape(L, n_kv_heads, n_heads // n_kv_heads, d, D)
    return np.einsum("lkgid,lkgjd->lkij", w, w)


def output_value_transform(wo: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """B = G^(1/2) (:func:`output_gram`) per layer and KV head: float32[L, Hkv, d, d].

    wo: float[L, H*d, D] (the output projection, ``y = x @ wo``).
    """
    return sqrt_psd(output_gram(wo, n_heads, n_kv_heads))


def extreme_pairing(d: int) -> np.ndarray:
    """int[d]: axes ordered by decreasing variance (0 the widest) placed so that sub-space m of
    dims (2m, 2m + 1) holds axes m and d - 1 - m."""
    if d < 2 or d % 2:
        raise ValueError(f"extreme_pairing needs an even d >= 2, got {d}")
    m = np.arange(d // 2)
    return np.stack([m, d - 1 - m], axis=1).reshape(-1)


def value_pca_transform(values: np.ndarray) -> np.ndarray:
    """B = Pi U^T per layer and KV head (module docstring): float32[L, Hkv, d, d], orthogonal.

    values: float[L, Hkv, N, d], the calibration values as the codebooks will code them (unit
    vectors for unit codes). U: eigenvectors of their second moment E[v v^T]; Pi:
    :func:`extreme_pairing`. Weighting the values by the output projection first (``B_o v``, as
    output-aware values) measured worse on SmolLM2 (benchmarks/results/frontier/key_bits/README.md (6)).
    """
    x = np.asarray(values, np.float64)
    if x.ndim != 4 or x.shape[2] == 0:
        raise ValueError(f"values must be float[L, Hkv, N >= 1, d], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("value_pca_transform: the calibration values contain NaN/Inf")
    _, u = np.linalg.eigh(np.einsum("lhni,lhnj->lhij", x, x) / x.shape[2])  # ascending eigenvalues
    axes = u[..., ::-1][..., extreme_pairing(x.shape[-1])]  # columns: the axes in sub-space order
    return np.swapaxes(axes, -1, -2).astype(np.float32)


def check_transform(t, num_layers: int | None, head_dim: int, name: str) -> jax.Array:
    """t as float32[L, Gt, d, d] (ValueError naming ``name`` if it is not)."""
    t = jnp.asarray(t, jnp.float32)
    if t.ndim != 4 or t.shape[-2:] != (head_dim, head_dim):
        raise ValueError(f"{name} must be float[L, Gt, d={head_dim}, d], got shape {tuple(t.shape)}")
    if num_layers is not None and t.shape[0] != num_layers:
        raise ValueError(f"{name} is for {t.shape[0]} layers, the codebooks for {num_layers}")
    return t


def inverse_transpose(t) -> np.ndarray:
    """A^-T of each matrix of float[..., d, d] (float64 inversion) -> float32."""
    return np.swapaxes(np.linalg.inv(np.asarray(t, np.float64)), -1, -2).astype(np.float32)


def inverse(t) -> np.ndarray:
    """A^-1 of each matrix of float[..., d, d] (float64 inversion) -> float32."""
    return np.linalg.inv(np.asarray(t, np.float64)).astype(np.float32)


def apply_head_transform(x: jax.Array, t: jax.Array) -> jax.Array:
    """y[b, s, h] = t[h // (H / Gt)] @ x[b, s, h].

    x: float[B, T, H, d]; t: float[Gt, d, d] with H a multiple of Gt. Returns float32[B, T, H, d].
    """
    b, s, h, d = x.shape
    gt = t.shape[0]
    if t.shape[1:] != (d, d) or h % gt:
        raise ValueError(f"transform {tuple(t.shape)} does not fit head vectors {tuple(x.shape)}")
    xg = x.astype(jnp.float32).reshape(b, s, gt, h // gt, d)
    y = jnp.einsum("gij,bsgrj->bsgri", t.astype(jnp.float32), xg, precision=lax.Precision.HIGHEST)
    return y.reshape(b, s, h, d)


def transform_rows(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Calibration vectors x float[L, Hkv, N, d] mapped by t float[L, Gt, d, d] -> float32."""
    x = np.asarray(x, np.float32)
    t = np.asarray(t, np.float32)
    if t.ndim != 4 or t.shape[0] != x.shape[0] or x.shape[1] % t.shape[1] or t.shape[-1] != x.shape[-1]:
        raise ValueError(f"transform {t.shape} does not fit calibration vectors {x.shape}")
    L, hkv, n, d = x.shape
    xg = x.reshape(L, t.shape[1], hkv // t.shape[1], n, d)
    return np.einsum("lgij,lgrnj->lgrni", t, xg).reshape(x.shape).astype(np.float32)

"""TurboQuant (Zandieh et al., ICLR 2026, arXiv 2504.19874): calibration-free vector quantization.

A vector x in R^d is stored as its norm ||x|| (in the cache dtype, bf16 by default) and the
codes of its rotated unit vector u = R x / ||x||, R a seeded random orthogonal matrix (QR of a
Gaussian, one per layer). Every coordinate of a uniformly random unit vector in d dimensions
has the density

    f_d(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - t^2)^((d-3)/2),   t in [-1, 1]

(close to N(0, 1/d) for large d), and the rotation makes any fixed x look like such a vector,
so each coordinate is quantized independently with the Lloyd-Max levels of f_d: no data, no
calibration. Reconstruction ``x_hat = ||x|| R^T levels[codes]``; its expected relative error
``||x - x_hat||^2 / ||x||^2`` is ``d * E_f[(t - q(t))^2]`` (:func:`lloyd_max_mse`), close to the
Gaussian Lloyd-Max figures 0.1175 (2 b), 0.0345 (3 b), 0.0095 (4 b).

Fractional budgets (2.5, 3.5 b/elem) split the d rotated coordinates in two halves, the first at
ceil(b) bits and the second at floor(b) bits (:func:`bit_parts`). The paper gives its outlier
channels more bits; after a random rotation no coordinate is an outlier, and a calibration-free
cache cannot know the model's outlier channels, so here the split is a mixed-precision allocation
over rotated coordinates (one norm and one rotation per vector).

QJL residual (keys, optional): with ``qjl`` a key spends b - 1 bits on the levels and 1 bit per
coordinate on ``sign(S r)``, r the rotated residual and S a seeded Gaussian d x d matrix, plus
||r||; the inner-product estimate ``<q, k> ~ ||k|| <R q, levels[c]> + ||r|| sqrt(pi/2)/d
<S R q, sign(S r)>`` is unbiased (the paper's TurboQuant_prod). The dequantized key is
``R^T (||k|| levels[c] + ||r|| sqrt(pi/2)/d S^T sign(S r))``.

Everything here is pure jnp / numpy; the cache is :mod:`million_jax.cache.turboquant_cache`,
attention from the codes :mod:`million_jax.attention.turboquant_xla`.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.code_packing import pack_codes, pack_parts, parts_width, unpack_codes, unpack_parts

__all__ = ["TURBOQUANT_BITS", "QJL_SCALE", "Part", "bit_parts", "check_bits", "coordinate_pdf", "lloyd_max_levels",
           "lloyd_max_mse", "random_rotation", "layer_rotations", "qjl_matrices", "stored_bits", "encode",
           "decode_rotated", "unit_levels", "level_table", "pack_parts", "unpack_parts", "qjl_encode", "qjl_decode_rotated", "unpack_signs"]

# budgets a turboquant cache offers (bits per coordinate, norms not counted)
TURBOQUANT_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 8)
QJL_SCALE = math.sqrt(math.pi / 2)


class Part(NamedTuple):
    """``n`` consecutive rotated coordinates quantized with ``bits``-bit Lloyd-Max levels."""

    n: int
    bits: int


def check_bits(bits, head_dim: int | None = None, *, qjl: bool = False) -> float:
    """``bits`` as a float if it is a turboquant budget (:data:`TURBOQUANT_BITS`), else ValueError.

    With ``qjl`` one of the bits goes to the sign of the residual, so the levels get bits - 1:
    bits >= 2 and an integer. ``head_dim`` (if given) must be even (the fractional split halves it,
    and codes are packed whole bytes per token).
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, float, np.integer, np.floating)):
        raise ValueError(f"turboquant bits must be a number in {TURBOQUANT_BITS}, got {bits!r}")
    b = float(bits)
    if b not in TURBOQUANT_BITS:
        raise ValueError(f"turboquant bits must be one of {TURBOQUANT_BITS}, got {bits!r}")
    if qjl and (b < 2 or b != int(b)):
        raise ValueError(f"turboquant with the QJL residual needs integer bits >= 2 (bits - 1 for the levels, "
                         f"1 for the residual's sign), got {bits!r}")
    if head_dim is not None:
        if head_dim < 2 or head_dim % 8:
            raise ValueError(f"turboquant needs a head_dim that is a positive multiple of 8 "
                             f"(codes packed whole bytes per token), got {head_dim}")
    return b


def bit_parts(bits: float, head_dim: int) -> tuple[Part, ...]:
    """The coordinate split of a budget: integer b -> one part of d coordinates at b bits;
    b + 0.5 -> d/2 coordinates at b + 1 bits, then d/2 at b bits."""
    b = check_bits(bits, head_dim)
    if b == int(b):
        return (Part(head_dim, int(b)),)
    lo = int(math.floor(b))
    return (Part(head_dim // 2, lo + 1), Part(head_dim // 2, lo))


def stored_bits(parts: tuple[Part, ...]) -> int:
    """Bits the packed codes of ``parts`` take per vector (whole bytes per part)."""
    return 8 * parts_width(parts)


# ------------------------------------------------------------------ Lloyd-Max levels
def coordinate_pdf(t: np.ndarray, d: int) -> np.ndarray:
    """f_d(t): density of one coordinate of a uniformly random unit vector in R^d (module docstring)."""
    t = np.asarray(t, np.float64)
    logc = math.lgamma(d / 2) - math.lgamma((d - 1) / 2) - 0.5 * math.log(math.pi)
    inside = np.abs(t) < 1
    out = np.zeros_like(t)
    out[inside] = np.exp(logc + (d - 3) / 2 * np.log1p(-t[inside] ** 2))
    return out


@functools.lru_cache(maxsize=None)
def _lloyd_max(d: int, bits: int) -> tuple[np.ndarray, float]:
    """(levels float64[2^bits] ascending, per-coordinate MSE) of f_d, by Lloyd's iteration on
    a fine grid (symmetric about 0; converged to 1e-12 in the levels)."""
    if d < 2:
        raise ValueError(f"the coordinate density needs d >= 2, got {d}")
    k = 1 << bits
    sd = 1.0 / math.sqrt(d)
    lim = min(1.0, 12.0 * sd)  # f_d is negligible beyond 12 standard deviations
    n = 400001
    t = np.linspace(-lim, lim, n)
    w = coordinate_pdf(t, d)
    w /= w.sum()
    tw = t * w
    cw, ctw = np.concatenate([[0.0], np.cumsum(w)]), np.concatenate([[0.0], np.cumsum(tw)])
    # start from the quantiles' centres
    cdf = np.cumsum(w)
    levels = np.interp((np.arange(k) + 0.5) / k, cdf, t)
    for _ in range(2000):
        mids = (levels[1:] + levels[:-1]) / 2
        edges = np.concatenate([[0], np.searchsorted(t, mids), [n]])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        new = (ctw[edges[1:]] - ctw[edges[:-1]]) / np.maximum(mass, 1e-300)
        new = (new - new[::-1]) / 2  # exact symmetry
        done = np.max(np.abs(new - levels)) < 1e-12 * sd
        levels = new
        if done:
            break
    mids = (levels[1:] + levels[:-1]) / 2
    q = levels[np.searchsorted(mids, t)]
    mse = float(np.sum(w * (t - q) ** 2))
    return levels, mse


def lloyd_max_levels(d: int, bits: int) -> np.ndarray:
    """float32[2^bits]: the Lloyd-Max levels of f_d (ascending)."""
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"level bits must be an integer in 1..8, got {bits!r}")
    return _lloyd_max(int(d), int(bits))[0].astype(np.float32)


def lloyd_max_mse(d: int, bits: int) -> float:
    """E_f[(t - q(t))^2] of the Lloyd-Max quantizer of f_d; d times it is the expected relative
    error ||x - x_hat||^2 / ||x||^2 of a vector (norm exact)."""
    return _lloyd_max(int(d), int(bits))[1]


# ------------------------------------------------------------------ rotations
def random_rotation(key: jax.Array, d: int) -> jax.Array:
    """float32[d, d]: a Haar-random orthogonal matrix (QR of a Gaussian, signs of R's diagonal
    folded into Q), reproducible from ``key``."""
    g = jax.random.normal(key, (d, d), jnp.float32)
    q, r = jnp.linalg.qr(g)
    return q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0)[None, :]


def layer_rotations(seed: int, num_layers: int, d: int) -> jax.Array:
    """float32[L, d, d]: layer i's rotation from ``fold_in(PRNGKey(seed), i)``."""
    base = jax.random.PRNGKey(seed)
    return jnp.stack([random_rotation(jax.random.fold_in(base, i), d) for i in range(num_layers)])


def qjl_matrices(seed: int, num_layers: int, d: int) -> jax.Array:
    """float32[L, d, d]: layer i's Gaussian QJL projection S (entries N(0, 1)), seeded apart
    from the rotations."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), 1 << 20)
    return jnp.stack([jax.random.normal(jax.random.fold_in(base, i), (d, d), jnp.float32)
                      for i in range(num_layers)])


# ------------------------------------------------------------------ encode / decode
def _part_slices(parts: tuple[Part, ...]):
    start = 0
    for p in parts:
        yield start, p
        start += p.n


def encode(x: jax.Array, rotation: jax.Array, parts: tuple[Part, ...], norm_dtype) -> tuple[list, jax.Array, jax.Array]:
    """x float[..., d] -> (codes: one uint8[..., n_p] per part, norm norm_dtype[..., 1],
    y float32[..., d] the rotated x).

    rotation float32[d, d] (or broadcastable [..., d, d]): y = R x. Coordinates of u = y / ||x||
    go to the nearest level (ties to the lower one); a zero vector gets norm 0.
    """
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    y = jnp.einsum("...ij,...j->...i", rotation, xf, precision=jax.lax.Precision.HIGHEST)
    n = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
    u = y / jnp.where(n > 0, n, 1.0)
    codes = []
    for s, p in _part_slices(parts):
        lv = lloyd_max_levels(d, p.bits)
        mids = jnp.asarray((lv[1:] + lv[:-1]) / 2)
        codes.append(jnp.sum(u[..., s:s + p.n, None] > mids, axis=-1).astype(jnp.uint8))
    return codes, n.astype(norm_dtype), y


def unit_levels(codes: list, parts: tuple[Part, ...], d: int) -> jax.Array:
    """float32[..., d]: ``levels[c]`` of every coordinate (the unit vector's reconstruction)."""
    return jnp.concatenate([jnp.asarray(lloyd_max_levels(d, p.bits))[c.astype(jnp.int32)]
                            for c, p in zip(codes, parts)], axis=-1)


def level_table(parts: tuple[Part, ...], d: int) -> jax.Array:
    """float32[d, K]: row j holds the levels of rotated coordinate j's part (K = 2^(widest part's
    bits); a narrower part's row is padded with zeros its codes never name). Read as PQ codebooks
    of d one-dim sub-spaces (``[None, :, :, None]``), the Pallas kernel scores TurboQuant codes with
    its centroid gather (:mod:`million_jax.attention.pq_dispatch`)."""
    k = 1 << max(p.bits for p in parts)
    rows = [np.broadcast_to(np.pad(lloyd_max_levels(d, p.bits), (0, k - (1 << p.bits))), (p.n, k)) for p in parts]
    return jnp.asarray(np.concatenate(rows, axis=0), jnp.float32)


def decode_rotated(codes: list, norm: jax.Array, parts: tuple[Part, ...], d: int) -> jax.Array:
    """float32[..., d]: ``norm * levels[codes]``, the reconstruction in rotated coordinates."""
    return unit_levels(codes, parts, d) * norm.astype(jnp.float32)


def qjl_encode(residual: jax.Array, s: jax.Array, norm_dtype) -> tuple[jax.Array, jax.Array]:
    """(packed sign bits uint8[..., d/8], ||r|| norm_dtype[..., 1]) of the rotated residual r
    float32[..., d]; bit j = 1 where (S r)_j >= 0."""
    proj = jnp.einsum("...ij,...j->...i", s, residual, precision=jax.lax.Precision.HIGHEST)
    bits = (proj >= 0).astype(jnp.uint8)
    rn = jnp.sqrt(jnp.sum(residual * residual, axis=-1, keepdims=True))
    return pack_codes(bits, 1), rn.astype(norm_dtype)


def unpack_signs(packed: jax.Array, d: int) -> jax.Array:
    """float32[..., d] of +-1 from the packed QJL bits."""
    return unpack_codes(packed, d, 1).astype(jnp.float32) * 2.0 - 1.0


def qjl_decode_rotated(packed: jax.Array, rnorm: jax.Array, s: jax.Array) -> jax.Array:
    """float32[..., d]: ``||r|| sqrt(pi/2)/d S^T sign``, the residual's reconstruction (rotated)."""
    d = s.shape[-1]
    signs = unpack_signs(packed, d)
    back = jnp.einsum("...ji,...j->...i", s, signs, precision=jax.lax.Precision.HIGHEST)
    return back * (QJL_SCALE / d) * rnorm.astype(jnp.float32)

"""Rotary position embedding: the one home of the frequencies and the rotation.

The model rotates queries and keys with these functions, and a cache that stores keys
*before* RoPE (``PQCodebooks.key_rope == "pre"``) rotates their reconstructions with the very
same frequencies, so the two can never disagree.

Layout: HF's rotate-half. Pair i of a head vector x float[..., d] is (x[i], x[i + d/2]); at
angle a it becomes (x1 cos a - x2 sin a, x2 cos a + x1 sin a). The angle of pair i at
position t is ``t * inv_freq[i]`` (float32, as every LLaMA implementation computes it; the model
and the un-rotation of new keys use this). Attention over pre-RoPE *codes* turns code row t by
the same angle computed without rounding (``pallas_kernels.pq_math.rope_cos_sin``: fixed-point
turns, 2e-7 rad at 128K against 4e-3 for the float32 product).

Pre-RoPE key codebooks use sub-spaces made of whole RoPE pairs, so a rotation never leaves its
sub-space. With P pairs per sub-space (dsub = 2P, M = d / 2P sub-spaces),
:func:`to_pair_layout` puts pair m + p M at dims (2(mP + p), 2(mP + p) + 1) of sub-space m: P = 1
orders the d dims as (0, d/2, 1, d/2 + 1, ...), sub-space m is pair m; P = 2 groups a fast pair m
with the slow pair m + d/4 (at 2 b/elem their 256 centroids code keys with a third less error
than 16 per pair: benchmarks/results/frontier/README.md (C)). :func:`subspace_freqs` gives the
frequencies in that order. Attention then needs two lookup tables per pair
(``pallas_kernels.pq_math``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeScaling", "ROPE_SCALING_KINDS", "rope_inv_freq", "rope_cos_sin", "rotate", "unrotate",
           "rotate_pair_layout", "to_pair_layout", "from_pair_layout", "subspace_freqs", "order_pairs"]

ROPE_SCALING_KINDS = ("llama3", "linear", "freq_factors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``kind`` is ``"llama3"`` (LLaMA-3.1's smooth low/high-frequency blend, the other fields as
    in HF ``rope_parameters``), ``"linear"`` (positions divided by ``factor``) or
    ``"freq_factors"`` (each of the d/2 inverse frequencies divided by ``freq_factors[i]``, as
    llama.cpp's ``rope_freqs.weight`` tensor stores LLaMA-3.1 scaling).
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float32[d/2] inverse frequencies of a head of size ``head_dim``, with ``scaling`` applied."""
    d = int(head_dim)
    if d <= 0 or d % 2:
        raise ValueError(f"RoPE needs an even head_dim > 0, got {head_dim}")
    inv = 1.0 / (float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = scaling
    if s is None:
        pass
    elif s.kind == "freq_factors":
        factors = np.asarray(s.freq_factors, np.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"rope freq_factors has {factors.size} entries, head_dim {d} needs {d // 2}")
        inv = inv / factors
    elif s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen = old / s.low_freq_factor
        high_wavelen = old / s.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    else:
        raise ValueError(f"unsupported rope scaling kind {s.kind!r} (one of {ROPE_SCALING_KINDS})")
    return inv.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int[...] and inv_freq float32[P] -> (cos, sin) float32[..., P]."""
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x float[..., d] rotated pair-wise (rotate-half layout); cos / sin float32 broadcastable to
    x[..., :d/2]. Computed in float32, returned in x.dtype."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def unrotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The inverse of :func:`rotate` at the same angles (rotation by -angle)."""
    return rotate(x, cos, -sin)


def rotate_pair_layout(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x float[..., 2P] in pair layout (pair m at dims 2m, 2m + 1) rotated by pair; cos / sin
    float32 broadcastable to [..., P]. Computed in float32, returned in x.dtype."""
    pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2)).astype(jnp.float32)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape).astype(x.dtype)


def _xp(x):
    """numpy for NumPy arrays (calibration pools stay on the host), jax.numpy otherwise."""
    return np if isinstance(x, np.ndarray) else jnp


def _pairs_per_subspace(d: int, pairs: int) -> int:
    if not isinstance(pairs, (int, np.integer)) or isinstance(pairs, bool) or pairs < 1 or d % (2 * pairs):
        raise ValueError(f"RoPE pairs per sub-space must be an integer >= 1 dividing head_dim / 2 = {d // 2}, "
                         f"got {pairs!r}")
    return int(pairs)


def to_pair_layout(x: jax.Array, pairs: int = 1) -> jax.Array:
    """x float[..., d] (rotate-half layout) -> float[..., d] in pair layout with ``pairs`` (P) RoPE
    pairs per sub-space of 2P dims: pair m + p * d/(2P) at dims 2(mP + p), 2(mP + p) + 1."""
    d = x.shape[-1]
    p = _pairs_per_subspace(d, pairs)
    xp = _xp(x)
    half = d // 2
    out = xp.stack([x[..., :half], x[..., half:]], axis=-1)  # [..., d/2 (= P x M), 2]
    out = out.reshape(x.shape[:-1] + (p, half // p, 2))
    return xp.swapaxes(out, -3, -2).reshape(x.shape)


def from_pair_layout(x: jax.Array, pairs: int = 1) -> jax.Array:
    """The inverse of :func:`to_pair_layout` (same ``pairs``)."""
    d = x.shape[-1]
    p = _pairs_per_subspace(d, pairs)
    xp = _xp(x)
    half = d // 2
    out = xp.swapaxes(x.reshape(x.shape[:-1] + (half // p, p, 2)), -3, -2).reshape(x.shape[:-1] + (half, 2))
    return xp.concatenate([out[..., 0], out[..., 1]], axis=-1)


def subspace_freqs(inv_freq, pairs: int = 1) -> np.ndarray:
    """inv_freq float[d/2] (natural pair order) -> float32[M, P]: the frequency of pair p of
    sub-space m in :func:`to_pair_layout` (inv_freq[m + p M], M = d / 2P)."""
    inv = np.asarray(inv_freq, np.float32)
    p = _pairs_per_subspace(2 * inv.shape[-1], pairs)
    return np.ascontiguousarray(inv.reshape(p, inv.shape[-1] // p).T)


def ordered_freqs(inv_freq, order):
    """inv_freq float[d/2] (natural pair order), order int[..., M = d/2] -> float32[..., M, 1]: the
    frequency of the one RoPE pair of each key sub-space when sub-space s codes pair ``order[..., s]``
    (the per-head form of :func:`subspace_freqs` with one pair per sub-space)."""
    return jnp.asarray(inv_freq, jnp.float32)[order][..., None]


def order_pairs(x, order):
    """x float[..., H, d] in pair layout (one pair per sub-space: pair m at dims 2m, 2m + 1) with
    each head's pairs put in its own order: out[..., h, 2s:2s + 2] = x[..., h, 2 order[g, s]:...],
    g = h // (H / G). order: int[G, d/2], G dividing H (KV heads, or 1 for every head). numpy in,
    numpy out (calibration samples); else jnp."""
    xp = _xp(x)
    *lead, h, d = x.shape
    g = order.shape[0]
    if order.ndim != 2 or order.shape[1] != d // 2 or h % g:
        raise ValueError(f"order must be int[G, d/2 = {d // 2}] with G dividing the {h} heads, got shape "
                         f"{tuple(order.shape)}")
    idx = xp.repeat(xp.asarray(order), h // g, axis=0)  # [H, P]
    pairs = x.reshape(tuple(lead) + (h, d // 2, 2))
    idx = xp.broadcast_to(idx[..., None], tuple(lead) + (h, d // 2, 2))
    return xp.take_along_axis(pairs, idx, axis=-2).reshape(x.shape)

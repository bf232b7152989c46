"""Product-quantization math in pure jnp: one home for reading vectors and scores from codes.

A PQ codebook has ``M`` subspaces of ``dsub`` dims with ``K`` centroids each; a vector of
``d = M * dsub`` dims is stored as M codes. Codebooks carry leading group axes (``[G, ...]``:
one codebook per KV head, or ``G = 1`` shared) that broadcast against the codes' leading axes.

    gather_centroids   codes -> the centroids they name (decode, value side of attention)
    build_lut          LUT[m, j] = q_m . C_m[j] for each query row (MILLION's lookup table)
    lut_scores         score = sum_m LUT[m, code_m] for each key (no dequantization)

Keys quantized *before* RoPE (pre-RoPE codebooks; each sub-space is P whole RoPE pairs,
dsub = 2P, the caller's head dims permuted so each pair is adjacent; frequencies float32[M] for
P = 1 or [M, P], pair p of sub-space m, or [G, M, P] with G in {1, Hkv}: a frequency per KV head,
for codebooks whose heads order their pairs each their own way). Stored code row t is the key of absolute position t;
each of its pairs is rotated by the angle t * inv_freq of that pair in rotate-half convention,
R(a) c = cos(a) c + sin(a) J c with J (c1, c2) = (-c2, c1). For a query q (rotated at its own
position already): q_i . R(a) c_i = cos(a) (q_i . c_i) + sin(a) (q_i . J c_i) for each pair i,
i.e. two tables over the M * P pairs (a sub-space's code picks the entry of each of its pairs):

    pair_subspaces     centroids [M, K, 2P] -> [M * P, K, 2]: one table row per pair
    quarter_turn       J c for every centroid (so build_lut(q, quarter_turn(C)) is the q.Jc table)
    rope_lut_scores    score = sum_i cos_ti LUT[i, code_m(i)] + sin_ti LUTJ[i, code_m(i)]
    rotate_pairs       R(a) applied pair-wise (dequantized keys of a tile, the kernel's tiles)
    rope_turns         inv_freq -> turns per position as 64-bit fixed point (hi, lo uint32)
    rope_phase         position -> angle mod 2 pi as uint32 turns, exact integer arithmetic
    phase_cos_sin      uint32 turns -> (cos, sin) in float32
    turn_cos_sin       positions, turns -> (cos, sin) float32[(G,) ..., M] (the two above)
    rope_cos_sin       positions, inv_freq -> (cos, sin) float32[(G,) ..., M] (the three above)

Why fixed-point turns: the naive float32 ``t * inv_freq`` is off by up to half an ulp of the
angle (4e-3 rad at t = 128K), far above what attention in float32 tolerates. Here the
frequency is converted once to turns per position with 64 fractional bits (exact float32
pieces of f and 1 / (2 pi), summed as integers), the angle of position t is ``t * U mod 1``
in wrapping uint32 arithmetic (no rounding at all), and only the final angle in [-pi, pi) is
a float: about 3e-7 rad for any position < 2**31 (tests/pallas_kernels/test_pre_rope.py
measures it against float64). All integer / elementwise, so the Pallas kernel runs the same
functions on its tiles.

Used by ``million_jax.quant.pq`` (encode/decode), the xla attention-from-codes path and the Pallas
kernel's reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["gather_centroids", "build_lut", "lut_scores", "quarter_turn", "rope_lut_scores", "rotate_pairs",
           "rope_turns", "rope_phase", "phase_cos_sin", "turn_cos_sin", "rope_cos_sin", "check_rope_inv_freq", "pair_subspaces",
           "pair_freqs"]


def gather_centroids(centroids: jax.Array, codes: jax.Array) -> jax.Array:
    """The vectors that codes name.

    centroids: float[*G, M, K, dsub]; codes: int[*L, N, M] with ``*G`` broadcastable against
    ``*L`` (e.g. centroids [Hkv, M, K, dsub] or [1, M, K, dsub] with codes [B, Hkv, N, M]).
    Returns float32[*broadcast(L, G), N, M * dsub]. The codebook is indexed, never broadcast
    in memory (an XLA gather with iota indices for the group axes).
    """
    m, k, dsub = centroids.shape[-3:]
    if codes.shape[-1] != m:
        raise ValueError(f"codes have {codes.shape[-1]} subspaces, the codebook {m}")
    groups = centroids.shape[:-3]
    flat = centroids.astype(jnp.float32).reshape(groups + (m * k, dsub))
    idx = codes.astype(jnp.int32) + jnp.arange(m, dtype=jnp.int32) * k  # [*L, N, M]
    lead = jnp.broadcast_shapes(codes.shape[:-2], groups)
    # one index array per group axis, aligned with the trailing axes of `lead`
    index = []
    for i, size in enumerate(groups):
        shape = [1] * (len(lead) + 2)
        shape[len(lead) - len(groups) + i] = size
        index.append(jnp.arange(size, dtype=jnp.int32).reshape(shape) if size > 1 else
                     jnp.zeros(shape, jnp.int32))
    sub = flat[tuple(index) + (idx,)]  # [*lead, N, M, dsub]
    return sub.reshape(sub.shape[:-2] + (m * dsub,))


def build_lut(q: jax.Array, centroids: jax.Array) -> jax.Array:
    """LUT[b, h, r, m, j] = q[b, h, r, m-th sub-vector] . C_m[j].

    q: float[B, Hkv, R, d] (R query rows per KV head: GQA heads x tokens);
    centroids: float[G, M, K, dsub], G = 1 or Hkv. Returns f32[B, Hkv, R, M, K].
    """
    b, hkv, r, d = q.shape
    g, m, k, dsub = centroids.shape
    qs = q.astype(jnp.float32).reshape(b, hkv, r, m, dsub)
    cb = jnp.broadcast_to(centroids.astype(jnp.float32), (hkv, m, k, dsub))
    return jnp.einsum("bhrms,hmks->bhrmk", qs, cb, precision=lax.Precision.HIGHEST)


def lut_scores(lut: jax.Array, codes: jax.Array) -> jax.Array:
    """scores[b, h, r, n] = sum_m lut[b, h, r, m, codes[b, h, n, m]].

    lut: f32[B, Hkv, R, M, K]; codes: int[B, Hkv, N, M]. Returns f32[B, Hkv, R, N].
    Codes >= K are clipped (memory safety; encode never writes them).
    """
    idx = jnp.swapaxes(codes.astype(jnp.int32), -1, -2)[:, :, None]  # [B, Hkv, 1, M, N]
    idx = jnp.broadcast_to(idx, lut.shape[:3] + idx.shape[3:])
    picked = jnp.take_along_axis(lut, idx, axis=-1, mode="clip")  # [B, Hkv, R, M, N]
    return jnp.sum(picked, axis=-2)


# --------------------------------------------------------------------------- pre-RoPE keys


def pair_subspaces(centroids: jax.Array) -> jax.Array:
    """Pre-RoPE key centroids float[..., M, K, 2P] -> float32[..., M * P, K, 2]: pair p of
    sub-space m as sub-space m * P + p (the tables of `rope_lut_scores` have one row per pair)."""
    *lead, m, k, dsub = centroids.shape
    if dsub % 2:
        raise ValueError(f"pre-RoPE key centroids are whole RoPE pairs (even dsub), got dsub {dsub}")
    c = centroids.astype(jnp.float32).reshape(*lead, m, k, dsub // 2, 2)
    return jnp.swapaxes(c, -3, -2).reshape(*lead, m * (dsub // 2), k, 2)


def pair_freqs(rope_inv_freq: jax.Array) -> jax.Array:
    """float32[M] or [M, P] (pair p of sub-space m) -> float32[M * P], pairs in layout order;
    per KV head float32[G, M, P] -> float32[G, M * P]."""
    f = jnp.asarray(rope_inv_freq, jnp.float32)
    return jnp.reshape(f, (f.shape[0], -1) if f.ndim == 3 else (-1,))


def quarter_turn(centroids: jax.Array) -> jax.Array:
    """J c = (-c2, c1) for pair sub-vectors: centroids float[..., 2] -> float32[..., 2]."""
    if centroids.shape[-1] != 2:
        raise ValueError(f"pre-RoPE key centroids are RoPE pairs (dsub = 2), got dsub {centroids.shape[-1]}")
    c = centroids.astype(jnp.float32)
    return jnp.stack([-c[..., 1], c[..., 0]], axis=-1)


def rope_lut_scores(lut: jax.Array, lut_j: jax.Array, codes: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """scores[b, h, r, n] = sum_i cos[n, i] lut[.., i, c_n,i//P] + sin[n, i] lut_j[.., i, c_n,i//P].

    lut, lut_j: f32[B, Hkv, R, M * P, K], one row per RoPE pair (q.c and q.Jc: `build_lut` with
    `pair_subspaces` of the centroids and with `quarter_turn` of those); codes: int[B, Hkv, N, M]
    (pair i read by code i // P); cos, sin: f32[N, M * P], per KV head [G, N, M * P] (G in {1, Hkv})
    or [B, Hkv, N, M * P] (the rotation of each pair of key row n). Returns f32[B, Hkv, R, N]
    (= q . R(angles_n) c_n).
    """
    pairs = lut.shape[-2] // codes.shape[-1]
    if pairs * codes.shape[-1] != lut.shape[-2]:
        raise ValueError(f"a table of {lut.shape[-2]} pair rows does not fit codes of {codes.shape[-1]} sub-spaces")
    if pairs > 1:
        codes = jnp.repeat(codes, pairs, axis=-1)
    idx = jnp.swapaxes(codes.astype(jnp.int32), -1, -2)[:, :, None]  # [B, Hkv, 1, M * P, N]
    idx = jnp.broadcast_to(idx, lut.shape[:3] + idx.shape[3:])
    pick = lambda t: jnp.take_along_axis(t, idx, axis=-1, mode="clip")  # noqa: E731  [B, Hkv, R, M, N]
    cs = jnp.swapaxes(cos, -1, -2)[..., None, :, :]  # [(B, G,) 1, M * P, N]: R broadcast
    sn = jnp.swapaxes(sin, -1, -2)[..., None, :, :]
    return jnp.sum(cs * pick(lut) + sn * pick(lut_j), axis=-2)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x float[..., N, 2M] in pair layout (pair m = dims 2m, 2m + 1), cos / sin f32[N, M]
    (broadcastable to x[..., N, M]) -> float32[..., N, 2M], pair m rotated by its angle."""
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def check_rope_inv_freq(rope_inv_freq, num_subspaces: int, sub_dim: int, num_kv_heads: int | None = None) -> None:
    """ValueError unless ``rope_inv_freq`` fits a key codebook of M sub-spaces of P = dsub / 2 whole
    RoPE pairs: float[M] (P = 1) or float[M, P], or per KV head float[G, M, P] with G = 1 or
    ``num_kv_heads`` (any G when it is None)."""
    if sub_dim % 2:
        raise ValueError(f"rope_inv_freq (keys quantized before RoPE) needs key sub-spaces of whole RoPE pairs "
                         f"(even dsub), got dsub {sub_dim}")
    pairs = sub_dim // 2
    shape = tuple(getattr(rope_inv_freq, "shape", ()))
    dtype = getattr(rope_inv_freq, "dtype", None)
    per_head = len(shape) == 3 and shape[1:] == (num_subspaces, pairs) and (
        num_kv_heads is None or shape[0] in (1, num_kv_heads))
    fits = per_head or shape == (num_subspaces, pairs) or (pairs == 1 and shape == (num_subspaces,))
    if not fits or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        want = f"float32[M={num_subspaces}]" if pairs == 1 else f"float32[M={num_subspaces}, P={pairs}]"
        heads = "G" if num_kv_heads is None else f"G=1 or Hkv={num_kv_heads}"
        raise ValueError(f"rope_inv_freq must be {want} or, per KV head, float32[{heads}, M={num_subspaces}, "
                         f"P={pairs}] (a frequency per RoPE pair of each key sub-space), got {dtype}{list(shape)}")
    if not isinstance(rope_inv_freq, jax.core.Tracer):  # concrete: the values can be checked too
        vals = np.asarray(rope_inv_freq, np.float64).reshape(-1)
        if not (np.isfinite(vals).all() and (vals > 0).all()):
            first = int(np.flatnonzero(~(np.isfinite(vals) & (vals > 0)))[0])
            head, bad = divmod(first, num_subspaces * pairs)
            where = (f"KV head {head}, " if len(shape) == 3 else "") + (
                f"sub-space {bad}" if pairs == 1 else f"sub-space {bad // pairs}, pair {bad % pairs}")
            raise ValueError(f"rope_inv_freq must be finite and > 0 (RoPE inverse frequencies), got {float(vals[first]):.6g} "
                             f"at {where}")


# 2 / pi in binary, 24 bits per entry (fdlibm's ipio2 table): 1 / (2 pi) = this / 4.
_TWO_OVER_PI_24 = (0xA2F983, 0x6E4E44, 0x1529FC, 0x2757D1, 0xF534DD, 0xC0DB62, 0x95993C)
_PIECE_BITS = 12  # a 12-bit piece of f times a 12-bit piece of 1 / (2 pi) is exact in float32


def _inv_two_pi_pieces(count: int = 5) -> tuple[float, ...]:
    """1 / (2 pi) as ``count`` float32-exact pieces of 12 significant bits (sum: 60 bits)."""
    n = len(_TWO_OVER_PI_24) * 24
    x = 0
    for chunk in _TWO_OVER_PI_24:
        x = (x << 24) | chunk  # 1 / (2 pi) = x * 2**-(n + 2); x's top bit is bit n - 1
    pieces, pos = [], n
    for _ in range(count):
        pos -= _PIECE_BITS
        top = x >> pos
        x -= top << pos
        pieces.append(float(top) * 2.0 ** (pos - n - 2))
    return tuple(pieces)


_INV_TWO_PI = _inv_two_pi_pieces()


def _u32(x) -> jax.Array:
    return jnp.asarray(x, jnp.uint32)


def _fixed64(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x float32 >= 0 (its exact value) -> (hi, lo) uint32 with x mod 1 = hi 2**-32 + lo 2**-64
    (truncated below 2**-64)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    e = (bits >> 23).astype(jnp.int32) & 0xFF
    m = (bits & _u32(0x7FFFFF)) | jnp.where(e > 0, _u32(0x800000), _u32(0))
    sh = jnp.maximum(e, 1) - 86  # x * 2**64 = m * 2**sh
    right = jnp.where(sh <= -24, _u32(0), m >> jnp.clip(-sh, 0, 31).astype(jnp.uint32))
    s1 = jnp.clip(sh, 0, 31).astype(jnp.uint32)
    lo_1 = m << s1
    hi_1 = jnp.where(s1 == 0, _u32(0), m >> jnp.maximum(_u32(32) - s1, _u32(1)))
    hi_2 = m << jnp.clip(sh - 32, 0, 31).astype(jnp.uint32)
    lo = jnp.where(sh < 0, right, jnp.where(sh < 32, lo_1, _u32(0)))
    hi = jnp.where(sh < 0, _u32(0), jnp.where(sh < 32, hi_1, jnp.where(sh < 64, hi_2, _u32(0))))
    return hi, lo


def rope_turns(inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """inv_freq float32[M] (> 0, radians per position) -> (hi, lo) uint32[M]: inv_freq / (2 pi)
    mod 1 as 64-bit fixed point, U = hi 2**-32 + lo 2**-64 turns per position (error < 2**-60).

    f is split exactly into two pieces of 12 significant bits, 1 / (2 pi) is five such pieces;
    every product of two pieces is exact in float32 and is added as a 64-bit integer.
    """
    f = jnp.asarray(inv_freq, jnp.float32)
    f_hi = lax.bitcast_convert_type(lax.bitcast_convert_type(f, jnp.uint32) & _u32(0xFFFFF000), jnp.float32)
    hi, lo = jnp.zeros(f.shape, jnp.uint32), jnp.zeros(f.shape, jnp.uint32)
    for part in (f_hi, f - f_hi):  # f - f_hi is exact: the low 12 mantissa bits
        for c in _INV_TWO_PI:
            p_hi, p_lo = _fixed64(part * jnp.float32(c))
            lo = lo + p_lo
            hi = hi + p_hi + (lo < p_lo).astype(jnp.uint32)
    return hi, lo


def rope_phase(positions: jax.Array, turns_hi: jax.Array, turns_lo: jax.Array) -> jax.Array:
    """Angle of each position mod 2 pi, as uint32 turns (2**32 = one turn): floor(t * U) mod 2**32.

    positions: int[...] (0 <= t < 2**31); turns_hi, turns_lo: uint32 from `rope_turns`,
    broadcastable against positions (e.g. positions [N, 1] with turns [M] -> [N, M]).
    Exact wrapping integer arithmetic (16-bit limbs for the high word of t * lo).
    """
    t = jnp.asarray(positions).astype(jnp.uint32)
    th, tl = t >> 16, t & _u32(0xFFFF)
    a, b = turns_lo >> 16, turns_lo & _u32(0xFFFF)
    x1, x2, x3 = th * b, tl * a, tl * b
    mid = (x1 & _u32(0xFFFF)) + (x2 & _u32(0xFFFF)) + (x3 >> 16)
    carry = th * a + (x1 >> 16) + (x2 >> 16) + (mid >> 16)  # floor(t * lo / 2**32)
    return t * turns_hi + carry


_RAD_PER_UNIT = 2.0 * math.pi / 2.0**32


def phase_cos_sin(phase: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 turns -> (cos, sin) float32 of the angle, taken in [-pi, pi)."""
    signed = lax.bitcast_convert_type(phase, jnp.int32)
    low = signed & 0xFF  # the high 24 bits convert to float32 exactly, the low 8 apart
    angle = (signed - low).astype(jnp.float32) * jnp.float32(_RAD_PER_UNIT) + low.astype(jnp.float32) * jnp.float32(
        _RAD_PER_UNIT)
    return jnp.cos(angle), jnp.sin(angle)


def turn_cos_sin(positions: jax.Array, turns_hi: jax.Array, turns_lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int[...] (>= 0), turns uint32[M] or [G, M] (`rope_turns`) -> (cos, sin)
    float32[..., M] or [G, ..., M] of the angles positions * inv_freq."""
    pos = jnp.asarray(positions)
    lead = turns_hi.ndim - 1  # group axes of the turns go first
    pos = pos.reshape((1,) * lead + pos.shape + (1,))
    fit = lambda x: x.reshape(x.shape[:-1] + (1,) * (pos.ndim - lead - 1) + x.shape[-1:])  # noqa: E731
    return phase_cos_sin(rope_phase(pos, fit(turns_hi), fit(turns_lo)))


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int[...] (>= 0), inv_freq float32[M] (or [G, M]) -> (cos, sin) float32[..., M]
    (or [G, ..., M]) of the angles positions * inv_freq, computed without float rounding of the
    angle (module docstring)."""
    return turn_cos_sin(positions, *rope_turns(inv_freq))

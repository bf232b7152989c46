"""Uniform asymmetric integer quantization (KIVI-style) and bit packing.

A group of values x (which elements form a group is the caller's choice) is
stored as b-bit codes plus one scale and one zero point per group:

    qmax  = 2**b - 1
    zero  = min(x)                              stored in the model dtype
    scale = (max(x) - min(x)) * float32(1/qmax)  stored in the model dtype
    code  = clip(round((x - zero) * inv), 0, qmax),  inv = 1/scale (0 where scale == 0)
    x_hat = code * scale + zero

Scale and zero are rounded to the storage dtype (bf16 by default) *before*
the codes are computed, so codes are always consistent with what is stored.
All arithmetic is float32; ``round`` is round-half-to-even. The scale uses a
multiplication by the float32 reciprocal of qmax (not a division) so the
result is bit-identical wherever it is computed (XLA rewrites a division by a
constant into a multiplication, numpy does not).

Codes of 2 and 4 bits are packed along the last (channel) axis into uint8,
little end first: for 4 bits ``byte = c[2i] | c[2i+1] << 4``, for 2 bits
``byte = c[4i] | c[4i+1] << 2 | c[4i+2] << 4 | c[4i+3] << 6``. 8-bit codes are
stored unpacked. So ``codes: uint8[..., d]`` packs to ``uint8[..., d*bits/8]``.

Granularities used by :class:`million_jax.cache.uniform_cache.UniformCache`:

    kivi        keys:   per channel over groups of G tokens (stats [.., T/G, d])
                values: per token over groups of G channels (stats [.., T, d/G])
    token       keys and values per token over all d channels (stats [.., T, 1])
    int8_token  ``token`` with 8 bits
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.code_packing import pack_codes, unpack_codes

__all__ = [
    "BITS",
    "MODES",
    "KVBits",
    "bits_per_element",
    "check_mode",
    "check_settings",
    "decode",
    "dequantize_token_groups",
    "encode",
    "expand_stats",
    "pack",
    "packed_width",
    "qmax",
    "quantize_token_groups",
    "scale_zero",
    "unpack",
]

BITS = (2, 4, 8)
MODES = ("kivi", "token", "int8_token")


class KVBits(NamedTuple):
    """Bits per stored element of keys and values, codes + scales + zeros."""

    key: float
    value: float

    @property
    def mean(self) -> float:
        """Average over keys and values (equal element counts)."""
        return (self.key + self.value) / 2


def qmax(bits: int) -> int:
    """Largest code: 2**bits - 1."""
    return (1 << bits) - 1


def _check_bits(bits: int) -> None:
    if bits is None:
        raise ValueError(f"bits not given: choose one of {BITS}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes per token per head of packed codes: head_dim * bits / 8."""
    _check_bits(bits)
    if (head_dim * bits) % 8:
        raise ValueError(f"head_dim {head_dim} * bits {bits} is not a whole number of bytes")
    return head_dim * bits // 8


def check_mode(mode: str, bits: int, group_size: int) -> None:
    """Raise a clear ValueError unless (mode, bits, group_size) is valid for any head_dim."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_bits(bits)
    if mode == "int8_token" and bits != 8:
        raise ValueError(f"mode 'int8_token' stores 8-bit codes, got bits={bits} (use mode='token')")
    if mode == "kivi" and (not isinstance(group_size, (int, np.integer)) or group_size < 1):
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")


def check_settings(mode: str, bits: int, group_size: int, head_dim: int) -> None:
    """Raise a clear ValueError unless (mode, bits, group_size, head_dim) is valid."""
    check_mode(mode, bits, group_size)
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if mode == "kivi":
        if head_dim % group_size:
            raise ValueError(
                f"head_dim {head_dim} is not divisible by group_size {group_size} "
                "(values are quantized per token in groups of group_size channels)"
            )
    packed_width(head_dim, bits)


def bits_per_element(mode: str, bits: int, group_size: int, head_dim: int, dtype: Any = jnp.bfloat16) -> KVBits:
    """Stored bits per key / value element: codes + one scale and one zero per group.

    kivi:   bits + 2 * dtype_bits / group_size   (keys: a group is G tokens of one
            channel; values: G channels of one token)
    token:  bits + 2 * dtype_bits / head_dim
    The fixed-size parts of the cache (exact sinks, ring, the key staging buffer
    of G tokens) are not per element; ``UniformCache.nbytes`` counts them.
    """
    check_settings(mode, bits, group_size, head_dim)
    sb = jnp.dtype(dtype).itemsize * 8
    per = group_size if mode == "kivi" else head_dim
    b = bits + 2 * sb / per
    return KVBits(float(b), float(b))


# ------------------------------------------------------------------ packing
def pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8[..., d] codes < 2**bits -> uint8[..., d*bits/8] (the PQ codes' bit layout,
    :mod:`pallas_kernels.code_packing`; 8-bit codes as they are)."""
    _check_bits(bits)
    codes = jnp.asarray(codes).astype(jnp.uint8)
    if bits == 8:
        return codes
    if (codes.shape[-1] * bits) % 8:
        raise ValueError(f"last axis {codes.shape[-1]} is not a multiple of {8 // bits} ({bits}-bit codes per byte)")
    return pack_codes(codes, bits)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """uint8[..., n] packed bytes -> uint8[..., n*8/bits] codes (inverse of :func:`pack`)."""
    _check_bits(bits)
    packed = jnp.asarray(packed)
    if bits == 8:
        return packed
    return unpack_codes(packed, packed.shape[-1] * 8 // bits, bits)


# ------------------------------------------------------------------ quantization
def scale_zero(mn: jax.Array, mx: jax.Array, bits: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(scale, zero) in ``dtype`` from float32 group minima / maxima of any shape."""
    inv_q = np.float32(1.0) / np.float32(qmax(bits))
    mn = mn.astype(jnp.float32)
    scale = (mx.astype(jnp.float32) - mn) * inv_q
    return scale.astype(dtype), mn.astype(dtype)


def encode(x: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """uint8 codes of x (float, any shape) given broadcastable stored scale / zero."""
    s = scale.astype(jnp.float32)
    z = zero.astype(jnp.float32)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    c = jnp.round((x.astype(jnp.float32) - z) * inv)
    return jnp.clip(c, 0, qmax(bits)).astype(jnp.uint8)


def decode(codes: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """float32 x_hat = code * scale + zero (broadcasting scale / zero)."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32) + zero.astype(jnp.float32)


def expand_stats(stats: jax.Array, rows: int, cols: int, n: int, d: int) -> jax.Array:
    """Per-group stats [..., ceil(n/rows), d/cols] -> per-element [..., n, d].

    ``rows`` consecutive tokens and ``cols`` consecutive channels share a stat.
    """
    if rows > 1:
        stats = jnp.repeat(stats, rows, axis=-2)[..., :n, :]
    if cols > 1:
        stats = jnp.repeat(stats, cols, axis=-1)
    return jnp.broadcast_to(stats, stats.shape[:-2] + (n, d))


def quantize_token_groups(
    x: jax.Array, bits: int, group: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token quantization in groups of ``group`` channels.

    x: float[..., d] -> (codes uint8[..., d] unpacked, scale dtype[..., d/group],
    zero dtype[..., d/group]).
    """
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"last axis {d} is not divisible by group {group}")
    xf = x.astype(jnp.float32)
    xg = xf.reshape(x.shape[:-1] + (d // group, group))
    scale, zero = scale_zero(jnp.min(xg, axis=-1), jnp.max(xg, axis=-1), bits, dtype)
    codes = encode(xg, scale[..., None], zero[..., None], bits).reshape(x.shape)
    return codes, scale, zero


def dequantize_token_groups(codes: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """Inverse of :func:`quantize_token_groups`: float32[..., d]."""
    d = codes.shape[-1]
    g = d // scale.shape[-1]
    s = jnp.repeat(scale, g, axis=-1)
    z = jnp.repeat(zero, g, axis=-1)
    return decode(codes, s, z)


"""Sub-byte PQ codes stored at their real width: M codes of nbits < 8 bits in ceil(M*nbits/8) bytes.

Layout (little-endian bit stream per token): code m occupies bits ``[m*nbits, (m+1)*nbits)``
of the token's byte row, bit ``o`` of the row being bit ``o % 8`` of byte ``o // 8``. So two
4-bit codes share a byte (code 0 in the low nibble), four 2-bit codes a byte, and 3-, 5-, 6-,
7-bit codes straddle byte boundaries (e.g. four 6-bit codes in 3 bytes).

    pack_codes(codes uint[..., M], nbits)      -> uint8[..., packed_width(M, nbits)]
    unpack_codes(packed uint8[..., P], M, nbits) -> uint8[..., M]

Codes of 8 bits and more are stored unpacked (uint8 / uint16). Whether a stored code array is
packed is read from its width: ``stored_width(M, nbits)`` (a single 8-bit-or-narrower code
per token, M = 1, reads the same packed or not).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["packed_width", "stored_width", "is_packed", "pack_codes", "unpack_codes", "maybe_unpack"]


def packed_width(M: int, nbits: int) -> int:
    """Bytes per token for M codes of ``nbits`` bits packed (nbits < 8)."""
    if not 1 <= nbits < 8:
        raise ValueError(f"only codes of 1..7 bits are packed, got nbits={nbits}")
    return -(-M * nbits // 8)


def stored_width(M: int, nbits: int, pack: bool = True) -> int:
    """Last-axis width of the stored code array: packed bytes (nbits < 8 and ``pack``) or M."""
    return packed_width(M, nbits) if pack and nbits < 8 else M


def is_packed(width: int, M: int, nbits: int) -> bool:
    """Whether a code array of last-axis ``width`` holds M packed codes; ValueError if it fits neither."""
    if width == M:
        return False
    if nbits < 8 and width == packed_width(M, nbits):
        return True
    raise ValueError(f"code array of width {width} holds neither M={M} codes nor M={M} packed "
                     f"{nbits}-bit codes" + (f" ({packed_width(M, nbits)} bytes)" if nbits < 8 else ""))


def _offsets(M: int, nbits: int) -> tuple[np.ndarray, np.ndarray]:
    o = np.arange(M) * nbits
    return o // 8, o % 8


def pack_codes(codes: jax.Array, nbits: int) -> jax.Array:
    """codes int[..., M] (each < 2**nbits) -> uint8[..., ceil(M * nbits / 8)] (module docstring)."""
    M = codes.shape[-1]
    P = packed_width(M, nbits)
    byte, shift = _offsets(M, nbits)
    lo = np.zeros((M, P), np.int32)
    hi = np.zeros((M, P + 1), np.int32)
    lo[np.arange(M), byte] = 1
    hi[np.arange(M), byte + 1] = 1
    c = (codes.astype(jnp.int32) & ((1 << nbits) - 1)) << jnp.asarray(shift, jnp.int32)
    # bit fields of different codes never overlap, so a sum is an OR; exact in int32
    out = jnp.dot(c & 0xFF, jnp.asarray(lo), preferred_element_type=jnp.int32)
    out = out + jnp.dot(c >> 8, jnp.asarray(hi), preferred_element_type=jnp.int32)[..., :P]
    return out.astype(jnp.uint8)


def unpack_codes(packed: jax.Array, M: int, nbits: int) -> jax.Array:
    """uint8[..., ceil(M * nbits / 8)] -> uint8[..., M] (module docstring)."""
    P = packed_width(M, nbits)
    if packed.shape[-1] != P:
        raise ValueError(f"packed codes must have {P} bytes per token for M={M} x {nbits} bits, "
                         f"got {packed.shape[-1]}")
    byte, shift = _offsets(M, nbits)
    b = packed.astype(jnp.int32)
    b = jnp.concatenate([b, jnp.zeros(b.shape[:-1] + (1,), jnp.int32)], axis=-1)
    word = jnp.take(b, byte, axis=-1) | (jnp.take(b, byte + 1, axis=-1) << 8)
    return ((word >> jnp.asarray(shift, jnp.int32)) & ((1 << nbits) - 1)).astype(jnp.uint8)


def maybe_unpack(codes: jax.Array, M: int, nbits: int) -> jax.Array:
    """Codes uint[..., M] as they are, or packed uint8[..., P] unpacked to uint8[..., M]."""
    return unpack_codes(codes, M, nbits) if is_packed(codes.shape[-1], M, nbits) else codes

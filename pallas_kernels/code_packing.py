"""PQ codes stored at their real width: M codes of nbits bits in ceil(M * nbits / 8) bytes.

Layout (little-endian bit stream per token): code m occupies bits ``[m*nbits, (m+1)*nbits)``
of the token's byte row, bit ``o`` of the row being bit ``o % 8`` of byte ``o // 8``. So two
4-bit codes share a byte (code 0 in the low nibble), four 2-bit codes a byte, four 6-bit codes
fill 3 bytes, two 12-bit codes 3 bytes; codes that do not divide 8 straddle byte boundaries.

    pack_codes(codes uint[..., M], nbits)        -> uint8[..., packed_width(M, nbits)]
    unpack_codes(packed uint8[..., P], M, nbits) -> uint8|uint16[..., M]
    code_bytes(M, nbits)                         -> (first byte, shift) of each code, window
    assemble_codes(window_bytes, shift, nbits)   -> the codes, from the bytes each code touches
    pack_layout / unpack_layout / part_bit_layout  -> a layout of several parts of different widths
    pack_parts / unpack_parts    -> the same with one code array per part

``assemble_codes`` is the one formula that reads a code out of its bytes: :func:`unpack_codes`
(jnp gathers) and the Pallas kernel (pointer loads of the same bytes) both call it.

Codes of 8 and 16 bits are never packed; every other width in 1..15 bits is packed when the
cache asks for it (``stored_width(M, nbits, pack)``), else stored one per uint8 / uint16. Whether
a stored code array is packed is read from its width (``is_packed``; a single code of < 8 bits
per token, M = 1, reads the same packed or not). Leaf module: imports no project code.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_PACKED_BITS", "packed_width", "stored_width", "is_packed", "codebook_nbits", "code_bytes",
           "assemble_codes", "pack_codes", "unpack_codes", "maybe_unpack", "Parts", "check_parts", "parts_width",
           "parts_window", "part_bit_layout", "pack_parts", "unpack_parts", "pack_layout", "unpack_layout", "check_layout",
           "check_layout_codes"]

MAX_PACKED_BITS = 15  # a code plus its bit offset (< 8) spans at most 3 bytes


def _check_packable(nbits: int) -> None:
    if not isinstance(nbits, (int, np.integer)) or not 1 <= nbits <= MAX_PACKED_BITS or nbits == 8:
        raise ValueError(f"codes of 1..{MAX_PACKED_BITS} bits other than 8 are packed, got nbits={nbits!r}")


def packed_width(M: int, nbits: int) -> int:
    """Bytes per token for M packed codes of ``nbits`` bits."""
    _check_packable(nbits)
    return -(-M * nbits // 8)


def _packable(nbits: int) -> bool:
    return 1 <= nbits <= MAX_PACKED_BITS and nbits != 8


def stored_width(M: int, nbits: int, pack: bool = True) -> int:
    """Last-axis width of the stored code array: packed bytes (``pack`` and nbits packable) or M."""
    return packed_width(M, nbits) if pack and _packable(nbits) else M


def is_packed(width: int, M: int, nbits: int) -> bool:
    """Whether a code array of last-axis ``width`` holds M packed codes; ValueError if it fits neither."""
    if width == M:
        return False
    if _packable(nbits) and width == packed_width(M, nbits):
        return True
    raise ValueError(f"code array of width {width} holds neither M={M} codes nor M={M} packed "
                     f"{nbits}-bit codes" + (f" ({packed_width(M, nbits)} bytes)" if _packable(nbits) else ""))


def codebook_nbits(num_centroids: int) -> int:
    """Code width of a codebook of K centroids: ceil(log2 K) (K = 2**nbits for fitted codebooks)."""
    return max(1, (int(num_centroids) - 1).bit_length())


def _window(first: np.ndarray, widths) -> int:
    """The most bytes one code touches: codes at bits [first, first + widths) of the stream."""
    return int(np.max(-(-(first % 8 + widths) // 8))) if len(first) else 1


def code_bytes(M: int, nbits: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(byte int32[M], shift int32[M], window): code m starts at bit ``shift[m]`` of byte
    ``byte[m]`` and lies within bytes ``byte[m] .. byte[m] + window - 1``."""
    offset = np.arange(M, dtype=np.int64) * nbits
    return (offset // 8).astype(np.int32), (offset % 8).astype(np.int32), _window(offset, nbits)


def assemble_codes(window_bytes: Sequence[jax.Array], shift: jax.Array, nbits: int) -> jax.Array:
    """int32 codes from the bytes they touch: ``window_bytes[j]`` is byte ``byte[m] + j`` of each
    code (any int array, broadcast with ``shift``); bytes past a code's last bit may hold anything.
    ``nbits``: an int, or an int32 array broadcast with ``shift`` (codes of several widths)."""
    word = window_bytes[0].astype(jnp.int32)
    for j, b in enumerate(window_bytes[1:], start=1):
        word = word | (b.astype(jnp.int32) << (8 * j))
    return (word >> shift) & ((1 << nbits) - 1)


def _pack_stream(codes: jax.Array, first: np.ndarray, widths: np.ndarray, P: int) -> jax.Array:
    """codes int[..., M] -> uint8[..., P]: code m at bits [first[m], first[m] + widths[m]) of the
    token's little-endian bit stream (the one packer of :func:`pack_codes` and :func:`pack_layout`)."""
    M = codes.shape[-1]
    byte, shift, window = first // 8, first % 8, _window(first, widths)
    c = (codes.astype(jnp.int32) & jnp.asarray((1 << widths) - 1, jnp.int32)) << jnp.asarray(shift, jnp.int32)
    out = None
    for j in range(window):
        # one-hot [M, P]: code m's j-th byte lands in byte[m] + j (bit fields never overlap,
        # so the sum is an OR; exact in int32)
        onehot = np.zeros((M, P + window), np.int32)
        onehot[np.arange(M), byte + j] = 1
        part = jnp.dot((c >> (8 * j)) & 0xFF, jnp.asarray(onehot[:, :P]), preferred_element_type=jnp.int32)
        out = part if out is None else out + part
    return out.astype(jnp.uint8)


def _unpack_stream(packed: jax.Array, first: np.ndarray, widths: np.ndarray) -> jax.Array:
    """Inverse of :func:`_pack_stream`: int32[..., M] from uint8[..., P]."""
    P = packed.shape[-1]
    shift = first % 8
    b = packed.astype(jnp.int32)
    taken = [jnp.take(b, np.minimum(first // 8 + j, P - 1), axis=-1) for j in range(_window(first, widths))]
    nbits = int(widths[0]) if len(set(widths.tolist())) == 1 else jnp.asarray(widths, jnp.int32)
    return assemble_codes(taken, jnp.asarray(shift, jnp.int32), nbits)


def _uniform_bits(M: int, nbits: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(M, dtype=np.int64) * nbits, np.full(M, nbits, np.int64)


def pack_codes(codes: jax.Array, nbits: int) -> jax.Array:
    """codes int[..., M] (each < 2**nbits) -> uint8[..., ceil(M * nbits / 8)] (module docstring)."""
    M = codes.shape[-1]
    return _pack_stream(codes, *_uniform_bits(M, nbits), packed_width(M, nbits))


def unpack_codes(packed: jax.Array, M: int, nbits: int) -> jax.Array:
    """uint8[..., ceil(M * nbits / 8)] -> uint8[..., M] (uint16 for nbits > 8; module docstring)."""
    P = packed_width(M, nbits)
    if packed.shape[-1] != P:
        raise ValueError(f"packed codes must have {P} bytes per token for M={M} x {nbits} bits, "
                         f"got {packed.shape[-1]}")
    return _unpack_stream(packed, *_uniform_bits(M, nbits)).astype(jnp.uint8 if nbits < 8 else jnp.uint16)


def maybe_unpack(codes: jax.Array, M: int, nbits: int) -> jax.Array:
    """Codes uint[..., M] as they are, or packed uint8[..., P] unpacked to one code per entry."""
    return unpack_codes(codes, M, nbits) if is_packed(codes.shape[-1], M, nbits) else codes


# ------------------------------------------------------------------ layouts of several parts
# A code layout of several parts, ``parts = ((n_0, bits_0), (n_1, bits_1), ...)``: n_0 codes of
# bits_0 bits, then n_1 codes of bits_1 bits, ... (M = sum n_p), in one little-endian bit stream per
# token as above (code m at the sum of the widths before it; ceil(sum n_p bits_p / 8) bytes). A single
# part ``((M, nbits),)`` is the plain packed layout (one code per byte for 8 bits). TurboQuant's
# fractional budgets (half the coordinates at b + 1 bits, half at b) and PQ keys of per-pair widths
# (``million_jax.quant.kv_codebooks.PQCodebooks.key_parts``) are stored this way, and the kernel
# reads them with :func:`part_bit_layout`.
Parts = tuple[tuple[int, int], ...]


def check_parts(parts: Parts) -> Parts:
    """``parts`` as a tuple of (count >= 1, bits in 1..15) int pairs, else ValueError."""
    try:
        out = tuple((int(n), int(b)) for n, b in parts)
    except (TypeError, ValueError):
        raise ValueError(f"code parts must be (count, bits) pairs, got {parts!r}") from None
    if not out or any(n < 1 or not 1 <= b <= MAX_PACKED_BITS for n, b in out):
        raise ValueError(f"code parts must be (count >= 1, bits in 1..{MAX_PACKED_BITS}) pairs, got {parts!r}")
    return out


def _layout_bits(parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    """(first bit int64[M], width int64[M]) of every code of the layout."""
    widths = np.concatenate([np.full(n, b, np.int64) for n, b in check_parts(parts)])
    return np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64), widths


def parts_width(parts: Parts) -> int:
    """Bytes per token of a layout of several parts: ceil(sum n_p bits_p / 8)."""
    return -(-sum(n * b for n, b in check_parts(parts)) // 8)


def parts_window(parts: Parts) -> int:
    """The most bytes one code of the layout touches."""
    return _window(*_layout_bits(parts))


def part_bit_layout(m: jax.Array, parts: Parts) -> tuple[jax.Array, jax.Array]:
    """(first bit int32, width int32) of code index ``m`` (an int32 array, e.g. an iota) in the
    layout ``parts``: one ``where`` per part, so it also runs inside the Pallas kernel (no array
    constants). For one part this is (m * nbits, nbits), :func:`code_bytes`' layout."""
    bit = jnp.zeros_like(m)
    width = jnp.zeros_like(m)
    start, bit0 = 0, 0
    for n, b in check_parts(parts):
        inside = (m >= start) & (m < start + n)
        bit = jnp.where(inside, bit0 + (m - start) * b, bit)
        width = jnp.where(inside, b, width)
        start, bit0 = start + n, bit0 + n * b
    return bit, width


def check_layout(parts: Parts, M: int, nbits: int, name: str = "key_parts") -> Parts:
    """``parts`` checked (:func:`check_parts`) as the layout of M codes for codebooks of ``nbits``
    bits (K = 2**nbits): the counts sum to M and the widest part has nbits bits; else ValueError."""
    try:
        parts = check_parts(parts)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    held, widest = sum(n for n, _ in parts), max(b for _, b in parts)
    if held != M:
        raise ValueError(f"{name} {parts} hold {held} codes, but the layout must hold M={M} codes")
    if widest != nbits:
        raise ValueError(f"{name} {parts}: the widest part has {widest} bits, the codebooks {nbits} (K={2 ** nbits})")
    return parts


def check_layout_codes(parts: Parts, M: int, width: int, dtype, codes_name: str = "codes",
                       books_name: str = "the codebook") -> Parts:
    """``parts`` checked as the layout of code arrays [..., width] of ``dtype`` that hold M codes
    (uint8[..., parts_width(parts)]); else ValueError naming ``codes_name`` / ``books_name``."""
    parts = check_parts(parts)
    held = sum(n for n, _ in parts)
    if held != M:
        raise ValueError(f"{codes_name} parts {parts} hold {held} codes, {books_name} has M={M}")
    if np.dtype(dtype) != np.uint8 or width != parts_width(parts):
        raise ValueError(f"{codes_name} in the layout {parts} must be uint8[..., {parts_width(parts)}], "
                         f"got {np.dtype(dtype)}[..., {width}]")
    return parts


def pack_layout(codes: jax.Array, parts: Parts) -> jax.Array:
    """codes int[..., M] (M = sum n_p; each code of part p < 2**bits_p) -> uint8[..., parts_width(parts)]."""
    parts = check_parts(parts)
    M = sum(n for n, _ in parts)
    if codes.shape[-1] != M:
        raise ValueError(f"layout {parts} holds {M} codes per token, got {codes.shape[-1]}")
    return _pack_stream(codes, *_layout_bits(parts), parts_width(parts))


def unpack_layout(packed: jax.Array, parts: Parts) -> jax.Array:
    """Inverse of :func:`pack_layout`: uint8[..., M] (uint16 when a part is wider than 8 bits)."""
    parts = check_parts(parts)
    if packed.shape[-1] != parts_width(parts):
        raise ValueError(f"codes of layout {parts} take {parts_width(parts)} bytes per token, got {packed.shape[-1]}")
    dtype = jnp.uint16 if max(b for _, b in parts) > 8 else jnp.uint8
    return _unpack_stream(packed, *_layout_bits(parts)).astype(dtype)


def pack_parts(codes: Sequence[jax.Array], parts: Parts) -> jax.Array:
    """One code array int[..., n_p] per part -> uint8[..., parts_width(parts)] (:func:`pack_layout`)."""
    parts = check_parts(parts)
    if len(codes) != len(parts):
        raise ValueError(f"{len(codes)} code arrays for {len(parts)} parts")
    return pack_layout(jnp.concatenate([jnp.asarray(c).astype(jnp.int32) for c in codes], axis=-1), parts)


def unpack_parts(packed: jax.Array, parts: Parts) -> list[jax.Array]:
    """Inverse of :func:`pack_parts`: one uint8|uint16[..., n_p] per part."""
    parts = check_parts(parts)
    codes = unpack_layout(packed, parts)
    cuts = np.cumsum([n for n, _ in parts])[:-1]
    return [c.astype(jnp.uint8 if b <= 8 else jnp.uint16) for c, (_, b) in zip(jnp.split(codes, cuts, axis=-1), parts)]

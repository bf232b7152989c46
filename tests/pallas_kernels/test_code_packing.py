"""Codes at their real width: pack / unpack against an independent bit-string packer."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.code_packing import (code_bytes, is_packed, maybe_unpack, pack_codes, pack_layout, pack_parts,
                                         packed_width, part_bit_layout, parts_width, parts_window, stored_width,
                                         unpack_codes, unpack_layout, unpack_parts)

PACKED_BITS = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 15]


def _np_pack(codes: np.ndarray, nbits: int) -> np.ndarray:
    """Reference packer: a little-endian bit string per row."""
    *lead, m = codes.shape
    bits = ((codes[..., None].astype(np.int64) >> np.arange(nbits)) & 1).reshape(*lead, m * nbits)
    p = -(-m * nbits // 8)
    bits = np.concatenate([bits, np.zeros((*lead, p * 8 - m * nbits), bits.dtype)], -1)
    return (bits.reshape(*lead, p, 8) << np.arange(8)).sum(-1).astype(np.uint8)


@pytest.mark.parametrize("nbits", PACKED_BITS)
def test_pack_matches_bitstream_and_roundtrips(nbits):
    rng = np.random.default_rng(nbits)
    m = int(rng.integers(1, 40))
    codes = rng.integers(0, 2**nbits, size=(3, 5, m)).astype(np.uint8 if nbits < 8 else np.uint16)
    packed = np.asarray(pack_codes(jnp.asarray(codes), nbits))
    assert packed.dtype == np.uint8 and packed.shape[-1] == packed_width(m, nbits) == -(-m * nbits // 8)
    np.testing.assert_array_equal(packed, _np_pack(codes, nbits))
    back = unpack_codes(jnp.asarray(packed), m, nbits)
    assert back.dtype == (jnp.uint8 if nbits < 8 else jnp.uint16)
    np.testing.assert_array_equal(np.asarray(back), codes)
    # the bytes each code touches: inside the row, and the window covers its last bit
    byte, shift, window = code_bytes(m, nbits)
    assert (byte < packed.shape[-1]).all() and ((shift + nbits + 7) // 8 <= window).all()


def test_widths_and_layout_decisions():
    assert packed_width(4, 6) == 3 and packed_width(2, 12) == 3 and packed_width(3, 4) == 2
    assert stored_width(64, 8) == 64 and stored_width(64, 4) == 32 and stored_width(64, 4, pack=False) == 64
    assert stored_width(32, 12) == 48 and stored_width(32, 16) == 32
    assert is_packed(48, 32, 12) and not is_packed(32, 32, 12) and not is_packed(64, 64, 8)
    with pytest.raises(ValueError, match="width 40 holds neither"):
        is_packed(40, 32, 12)
    with pytest.raises(ValueError, match="other than 8"):
        packed_width(4, 8)
    with pytest.raises(ValueError, match="other than 8"):
        packed_width(4, 16)
    with pytest.raises(ValueError, match="6 bytes per token"):
        unpack_codes(jnp.zeros((2, 5), jnp.uint8), 4, 12)
    c = jnp.asarray(np.arange(8, dtype=np.uint8).reshape(2, 4))
    np.testing.assert_array_equal(np.asarray(maybe_unpack(c, 4, 3)), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(maybe_unpack(pack_codes(c, 3), 4, 3)), np.asarray(c))


def test_layout_of_parts_is_one_bit_stream():
    """pack_layout: the codes of every part in one little-endian bit stream (code m at the sum of the
    widths before it), as the independent bit-string packer gives; unpack_layout / pack_parts /
    unpack_parts agree; the kernel's per-code (first bit, width) and byte window cover every code."""
    rng = np.random.default_rng(5)
    parts = ((5, 6), (3, 8), (2, 3), (4, 10), (1, 7))
    widths = np.concatenate([np.full(n, b) for n, b in parts])
    codes = np.concatenate([rng.integers(0, 2**b, size=(3, 7, n)) for n, b in parts], -1).astype(np.uint16)
    packed = np.asarray(pack_layout(jnp.asarray(codes), parts))
    total = int(widths.sum())
    assert packed.dtype == np.uint8 and packed.shape[-1] == parts_width(parts) == -(-total // 8)
    bits = np.concatenate([((codes[..., m:m + 1].astype(np.int64) >> np.arange(w)) & 1) for m, w in enumerate(widths)],
                          -1)
    bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (8 * packed.shape[-1] - total,), bits.dtype)], -1)
    want = (bits.reshape(*bits.shape[:-1], -1, 8) << np.arange(8)).sum(-1).astype(np.uint8)
    np.testing.assert_array_equal(packed, want)
    back = unpack_layout(jnp.asarray(packed), parts)
    assert back.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(back), codes)
    cuts = np.cumsum([n for n, _ in parts])[:-1]
    split = [jnp.asarray(c) for c in np.split(codes, cuts, -1)]
    np.testing.assert_array_equal(np.asarray(pack_parts(split, parts)), packed)
    for got, c in zip(unpack_parts(jnp.asarray(packed), parts), split):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(c))
    first, w = (np.asarray(x) for x in part_bit_layout(jnp.arange(len(widths), dtype=jnp.int32), parts))
    np.testing.assert_array_equal(w, widths)
    np.testing.assert_array_equal(first, np.concatenate([[0], np.cumsum(widths)[:-1]]))
    assert parts_window(parts) == (-(-(first % 8 + w) // 8)).max() == 2
    with pytest.raises(ValueError, match="holds 15 codes per token, got 14"):
        pack_layout(jnp.asarray(codes[..., :14]), parts)

"""Codes at their real width: pack / unpack against an independent bit-string packer."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.code_packing import (code_bytes, is_packed, maybe_unpack, pack_codes, pack_layout, packed_width,
                                         parts_width, stored_width, unpack_codes, unpack_layout)

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


def test_layout_of_parts_packs_each_run_at_its_width():
    """pack_layout: each run of the layout packed on its own (8-bit runs one code per byte), side by
    side, as the independent bit-string packer gives per part; unpack_layout inverts it."""
    rng = np.random.default_rng(5)
    parts = ((5, 6), (3, 8), (2, 3), (4, 10))
    codes = np.concatenate([rng.integers(0, 2**b, size=(3, 7, n)) for n, b in parts], -1).astype(np.uint16)
    packed = np.asarray(pack_layout(jnp.asarray(codes), parts))
    assert packed.dtype == np.uint8 and packed.shape[-1] == parts_width(parts) == 4 + 3 + 1 + 5
    want, m0 = [], 0
    for n, b in parts:
        c = codes[..., m0:m0 + n]
        want.append(c.astype(np.uint8) if b == 8 else _np_pack(c, b))
        m0 += n
    np.testing.assert_array_equal(packed, np.concatenate(want, -1))
    back = unpack_layout(jnp.asarray(packed), parts)
    assert back.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(back), codes)
    with pytest.raises(ValueError, match="holds 14 codes per token, got 13"):
        pack_layout(jnp.asarray(codes[..., :13]), parts)

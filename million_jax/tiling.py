"""The token-tile loop shared by the attention-from-codes paths (PQ and uniform, xla).

Codes are walked in tiles of ``tile`` tokens under ``lax.scan`` with the online softmax of
:mod:`pallas_kernels.softmax`, so only one tile is ever dequantized: memory is
O(B * H * T * tile) whatever the context length. Each caller supplies only how a tile's
scores and values are computed from its slices of the stored arrays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.softmax import OnlineSoftmax, ungroup_heads

__all__ = ["tiled_attention"]

# (tile index, per-array tile slices) -> (scores f32[B, Hkv, G, T, tile], values f32[B, Hkv, tile, d])
TileFn = Callable[[jax.Array, tuple[jax.Array, ...]], tuple[jax.Array, jax.Array]]


def _tiles(x: jax.Array, n_tiles: int, rows: int) -> jax.Array:
    """x [B, Hkv, N', ...] zero-padded to n_tiles*rows rows -> [n_tiles, B, Hkv, rows, ...]."""
    b, hkv, n = x.shape[:3]
    pad = n_tiles * rows - n
    if pad > 0:
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    return jnp.moveaxis(x.reshape((b, hkv, n_tiles, rows) + x.shape[3:]), 2, 0)


def tiled_attention(
    group_shape: tuple[int, int, int, int],
    d: int,
    tile: int,
    lo: jax.Array,
    hi: jax.Array,
    arrays: Sequence[tuple[jax.Array, int]],
    tile_fn: TileFn,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention over N stored tokens, one tile at a time.

    group_shape: (B, Hkv, G, T) of the grouped queries; d: value width.
    tile: tokens per tile (a multiple of every array's ``rows_per_entry``).
    lo, hi: int32[B, T]: query t of sequence b sees tokens lo <= s < hi.
    arrays: (x [B, Hkv, N / rows_per_entry, ...], rows_per_entry) pairs; N is taken from the
      first (rows_per_entry 1). Each is cut into tiles and handed to ``tile_fn``.
    Returns (out f32[B, T, H, d], lse f32[B, T, H]); 0 / -inf for a query that sees nothing.
    """
    n = arrays[0][0].shape[2]
    tile = max(1, tile)
    n_tiles = max(1, -(-n // tile))
    xs = tuple(_tiles(x, n_tiles, tile // per) for x, per in arrays)

    def body(state: OnlineSoftmax, x):
        i, parts = x
        scores, values = tile_fn(i, parts)
        s_pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
        vis = (s_pos[None, None, :] >= lo[:, :, None]) & (s_pos[None, None, :] < hi[:, :, None])
        return state.step(scores, vis[:, None, None], values), None

    state, _ = jax.lax.scan(body, OnlineSoftmax.init(group_shape, d), (jnp.arange(n_tiles, dtype=jnp.int32), xs))
    out, lse = state.finish()
    return ungroup_heads(out), ungroup_heads(lse)

"""The token-tile loop shared by every xla attention path over a cache (dense, PQ, uniform).

Stored tokens are walked in tiles of ``tile`` tokens with the online softmax of
:mod:`pallas_kernels.softmax`, so only one tile is ever dequantized: memory is
O(B * H * T * tile) whatever the context length. The loop runs only over the tiles that
hold visible tokens (up to the longest ``hi`` in the batch), so a step costs in proportion
to the longest sequence, not to the cache's capacity ``T_max``; tiles are cut with dynamic
slices of the stored arrays (no padded or transposed copy of the cache); an array may be a
:class:`~million_jax.attention.layer_slice.LayerSlice` (one layer of a stacked cache), whose tiles are
cut straight from the stacked buffer. Each caller supplies only how a tile's scores and
values are computed from its slices of the stored arrays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from million_jax.attention.layer_slice import ArrayOrSlice, rows as row_slice
from pallas_kernels.softmax import OnlineSoftmax, ungroup_heads

__all__ = ["tiled_attention"]

# (per-array tile slices, token rows in this tile, token index of the tile's first row) ->
#     (scores f32[B, Hkv, G, T, rows], values float[B, Hkv, rows, d])
TileFn = Callable[[tuple[jax.Array, ...], int, jax.Array], tuple[jax.Array, jax.Array]]


def tiled_attention(
    group_shape: tuple[int, int, int, int],
    d: int,
    tile: int,
    lo: jax.Array,
    hi: jax.Array,
    arrays: Sequence[tuple[ArrayOrSlice, int]],
    tile_fn: TileFn,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention over N stored tokens, one tile at a time.

    group_shape: (B, Hkv, G, T) of the grouped queries; d: value width.
    tile: tokens per tile (a multiple of every array's ``rows_per_entry``).
    lo, hi: int32[B, T]: query t of sequence b sees tokens lo <= s < hi.
    arrays: (x [B, Hkv, ceil(N / rows_per_entry), ...], rows_per_entry) pairs, x an array or a
      LayerSlice; N is taken from the first (rows_per_entry 1). Each is sliced per tile and
      handed to ``tile_fn`` with the tile's row count and first token index (int32 scalar).
    Returns (out f32[B, T, H, d], lse f32[B, T, H]); 0 / -inf for a query that sees nothing.
    """
    n = arrays[0][0].shape[2]
    tile = max(1, min(tile, n))
    for x, per in arrays:
        if tile % per and tile != n:
            raise ValueError(f"tile {tile} is not a multiple of an array's rows per entry {per}")
    n_full, rem = divmod(n, tile)
    # tokens any query of the batch can see: the loop stops after the last tile holding one
    need = jnp.clip(jnp.max(hi, initial=0), 0, n)

    def step(state: OnlineSoftmax, start: jax.Array, rows: int) -> OnlineSoftmax:
        parts = tuple(row_slice(x, start // per, -(-rows // per), axis=2) for x, per in arrays)
        scores, values = tile_fn(parts, rows, start)
        s_pos = start + jnp.arange(rows, dtype=jnp.int32)
        vis = (s_pos[None, None, :] >= lo[:, :, None]) & (s_pos[None, None, :] < hi[:, :, None])
        return state.step(scores, vis[:, None, None], values)

    state = OnlineSoftmax.init(group_shape, d)
    n_tiles = jnp.minimum(n_full, -(-need // tile))
    state = jax.lax.fori_loop(0, n_tiles, lambda i, st: step(st, i * tile, tile), state)
    if rem:
        start = n_full * tile
        state = jax.lax.cond(need > start, lambda st: step(st, jnp.int32(start), rem), lambda st: st, state)
    out, lse = state.finish()
    return ungroup_heads(out), ungroup_heads(lse)

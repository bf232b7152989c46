"""One layer of a stacked cache array, read in place.

A cache keeps every layer in one stacked array ``x [L, B, Hkv, T_max, ...]``. Slicing layer
``i`` out (``x[i]``) inside the model's layer loop makes XLA copy the whole layer, which
costs O(T_max) per layer and step whatever the context length. A :class:`LayerSlice`
stands for ``x[i]`` without materialising it: the attention paths cut their tiles and rows
straight from the stacked buffer (:func:`rows`, :func:`take_rows`), and only what really
needs the whole layer (the Pallas kernel) asks for :func:`as_array`.

Every function here takes a plain array (one layer, nothing to index) or a LayerSlice.

Known limit (XLA CPU): bf16 / fp16 arithmetic is emulated in float32, and XLA hoists the
convert of a loop-invariant 16-bit cache out of the tile loop, converting the whole cache
every step. float32 caches (what a CPU user runs) and uint8 codes are read in place.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp

__all__ = ["LayerSlice", "ArrayOrSlice", "as_array", "rows", "take_rows"]


@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer ``index`` (int32 scalar, may be traced) of ``stacked [L, *shape]``."""

    stacked: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        return self.stacked.dtype

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1


ArrayOrSlice = Union[jax.Array, LayerSlice]


def as_array(x: ArrayOrSlice) -> jax.Array:
    """The layer as an array (a copy of the layer for a LayerSlice: use for small arrays only,
    or where the whole layer is needed anyway)."""
    if isinstance(x, LayerSlice):
        return jax.lax.dynamic_index_in_dim(x.stacked, x.index, axis=0, keepdims=False)
    return x


def rows(x: ArrayOrSlice, start: jax.Array, size: int, axis: int = 2) -> jax.Array:
    """x[..., start:start + size, ...] along ``axis`` of the layer (a dynamic slice, clamped
    into range like ``lax.dynamic_slice``)."""
    if not isinstance(x, LayerSlice):
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
    st = x.stacked
    starts = [jnp.zeros((), jnp.int32)] * st.ndim
    starts[0] = jnp.asarray(x.index, jnp.int32)
    starts[axis + 1] = jnp.asarray(start, jnp.int32)
    sizes = list(st.shape)
    sizes[0], sizes[axis + 1] = 1, size
    return jax.lax.dynamic_slice(st, starts, sizes)[0]


def take_rows(x: ArrayOrSlice, idx: jax.Array) -> jax.Array:
    """x [B, Hkv, N, ...], idx int[B, R] -> x[b, :, idx[b]] as [B, Hkv, R, ...] (idx clipped)."""
    n = x.shape[2]
    idx = jnp.clip(idx, 0, n - 1)
    if not isinstance(x, LayerSlice):
        return jnp.take_along_axis(x, idx.reshape(idx.shape[:1] + (1,) + idx.shape[1:] + (1,) * (x.ndim - 3)),
                                   axis=2, mode="promise_in_bounds")
    bidx = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None]
    picked = x.stacked[x.index, bidx, :, idx]  # one gather from the stacked buffer: [B, R, Hkv, ...]
    return jnp.swapaxes(picked, 1, 2)

"""PQCodebooks: the key and value codebooks of a model, normalised once to their per-layer shape.

Codebooks are fitted at one of three granularities (one codebook per ...):

    shared       ... model (MILLION's choice)       fitted as [M, K, dsub]
    layer        ... layer                          fitted as [L, M, K, dsub]
    layer_head   ... layer and KV head              fitted as [L, Hkv, M, K, dsub]

Whatever the granularity, a ``PQCodebooks`` holds them as float32[L, G, M, K, dsub] with
G = Hkv (layer_head) or 1 (shared, layer), so the model scans them with its layers and every
attention path reads ``[G, M, K, dsub]`` per layer, without reshaping or re-checking per call.
``compact()`` gives back the fitted form (what a codebook file stores).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.pq import Codebooks

__all__ = ["PQCodebooks", "GRANULARITIES"]

GRANULARITIES = ("shared", "layer", "layer_head")
_GROUP_RANK = {"shared": 0, "layer": 1, "layer_head": 2}


def _normalise(c, granularity: str, num_layers: int | None) -> jax.Array:
    c = jnp.asarray(c, jnp.float32)
    rank = c.ndim - 3
    if rank != _GROUP_RANK[granularity]:
        raise ValueError(
            f"{granularity!r} codebooks must have {_GROUP_RANK[granularity]} group axes before "
            f"[M, K, dsub], got shape {tuple(c.shape)}"
        )
    if granularity == "shared":
        if num_layers is None:
            raise ValueError("shared codebooks need num_layers to be laid out per layer")
        return jnp.broadcast_to(c[None, None], (num_layers, 1) + c.shape)
    if granularity == "layer":
        c = c[:, None]
    if num_layers is not None and c.shape[0] != num_layers:
        raise ValueError(f"codebooks are for {c.shape[0]} layers, the model has {num_layers}")
    return c


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key", "value"], meta_fields=["granularity"])
@dataclasses.dataclass(frozen=True)
class PQCodebooks:
    """key / value: Codebooks with centroids float32[L, G, M, K, dsub] ([G, M, K, dsub] per layer)."""

    key: Codebooks
    value: Codebooks
    granularity: str = "layer_head"

    @classmethod
    def from_centroids(cls, key, value, granularity: str = "layer_head", num_layers: int | None = None) -> "PQCodebooks":
        """Codebooks in their fitted form (see the module docstring) -> the per-layer form.

        ``num_layers`` is required for ``shared`` codebooks and checked for the others.
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        k = _normalise(key, granularity, num_layers)
        v = _normalise(value, granularity, num_layers)
        if k.shape != v.shape:
            raise ValueError(f"key and value codebooks differ in shape: {k.shape} vs {v.shape}")
        books = cls(Codebooks(k), Codebooks(v), granularity)
        books.key.validate()
        books.value.validate()
        return books

    def compact(self) -> tuple[Codebooks, Codebooks]:
        """(key, value) in the fitted form of the granularity (what a codebook file holds)."""

        def cut(c):
            c = np.asarray(c)
            return c[0, 0] if self.granularity == "shared" else c[:, 0] if self.granularity == "layer" else c

        return Codebooks(cut(self.key.centroids)), Codebooks(cut(self.value.centroids))

    @property
    def M(self) -> int:
        return self.key.num_subspaces

    @property
    def nbits(self) -> int:
        return self.key.nbits

    @property
    def head_dim(self) -> int:
        return self.key.dim

    @property
    def num_layers(self) -> int:
        return self.key.centroids.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct centroids (the fitted form; what a file or a device shard needs)."""
        shape = self.key.centroids.shape  # [L, G, M, K, dsub]
        per_layer = int(np.prod(shape[1:]))
        layers = 1 if self.granularity == "shared" else shape[0]
        return 2 * layers * per_layer * jnp.dtype(self.key.centroids.dtype).itemsize

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> "PQCodebooks":
        """Raise a clear ValueError unless these codebooks fit the given model shape."""
        l, g = self.key.centroids.shape[:2]
        if l != num_layers:
            raise ValueError(f"codebooks are for {l} layers, the model has {num_layers}")
        if g not in (1, num_kv_heads):
            raise ValueError(f"codebooks have {g} head groups, the model has {num_kv_heads} KV heads")
        if self.head_dim != head_dim:
            raise ValueError(f"codebooks are for head_dim {self.head_dim}, the model has {head_dim}")
        return self

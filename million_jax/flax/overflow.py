"""``cache_overflow``: one bool[B] for every PQ attention layer's sticky ``overflow`` flag.

A Flax PQ layer drops the tokens past its cache's max_length under jit and sets its cache entry
``overflow`` (bool[B]) for those sequences; eager calls raise ``CacheOverflowError`` instead
(:mod:`million_jax.flax.nnx_attention`, :mod:`million_jax.flax.linen_attention`). This reads
the flags of a whole model at once, under jit or not.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import traverse_util

from million_jax.flax.nnx_attention import pq_layers

__all__ = ["cache_overflow"]


def cache_overflow(cache: Any) -> jax.Array:
    """bool[B]: the sequences that some PQ attention layer could not hold (OR over the layers).

    ``cache``: an NNX model (its ``PQMultiHeadAttention`` layers after ``init_cache``), its
    ``nnx.state(model, nnx.Cache)``, or a Linen ``"cache"`` collection (``state["cache"]`` of
    ``model.apply(..., mutable=["cache"])``, or that whole ``state``). ValueError when it holds no
    PQ layer cache.
    """
    if isinstance(cache, nnx.Module):
        flags = [layer.overflow[...] for _, layer in pq_layers(cache) if layer.overflow is not None]
    elif isinstance(cache, nnx.State):
        flags = [v[...] for path, v in nnx.to_flat_state(cache) if path and path[-1] == "overflow"]
    elif isinstance(cache, Mapping):
        flat = traverse_util.flatten_dict(dict(cache))
        flags = [v for path, v in flat.items() if path[-1] == "overflow"]
    else:
        raise ValueError(f"cache_overflow takes an NNX model, its nnx.Cache state or a Linen 'cache' collection, "
                         f"got {type(cache).__name__}")
    if not flags:
        raise ValueError("cache_overflow: no PQ attention cache found (call init_cache, or the Linen apply with "
                         "mutable=['cache'] that creates it, first)")
    out = flags[0]
    for f in flags[1:]:
        out = out | f
    return jnp.asarray(out, bool)

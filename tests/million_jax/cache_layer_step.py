"""Test helper: drive layer 0 of a cache through the public protocol (attend + write)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def attend_layer0(cache, consts, q, k, v, n_new):
    """``KVCache.attend`` on layer 0 (read in place from the stacked state), its writes
    applied to layer 0 and the lengths advanced; returns (out, new cache)."""
    consts = cache.layer_consts(consts)
    const = jax.tree.map(lambda a: a[0], consts)
    out, writes = cache.attend(jnp.int32(0), const, q, k, v, n_new)
    layer = jax.tree.map(lambda a: a[0], cache.layers).write(writes)
    layers = jax.tree.map(lambda full, one: full.at[0].set(one), cache.layers, layer)
    return out, cache.advance(layers, n_new)

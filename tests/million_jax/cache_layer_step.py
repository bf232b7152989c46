"""Test helper: drive layer 0 of a cache through the public protocol (attend + advance)."""
from __future__ import annotations

import jax


def attend_layer0(cache, consts, q, k, v, n_new):
    """One ``LayerState.attend`` on layer 0 and one ``advance``; returns (out, new cache)."""
    consts = cache.layer_consts(consts)
    layer = jax.tree.map(lambda a: a[0], cache.layers)
    const = jax.tree.map(lambda a: a[0], consts)
    out, layer = layer.attend(const, q, k, v, cache.lengths, n_new)
    layers = jax.tree.map(lambda full, one: full.at[0].set(one), cache.layers, layer)
    return out, cache.advance(layers, n_new)

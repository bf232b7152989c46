"""HybridCache: sliding-window layers keep an exact ring, global layers keep any cache kind.

Models such as Gemma 3 interleave sliding-window layers (a query at position p reads keys
p - W < s <= p) with a few global layers that read the whole context. A sliding layer never
needs more than its last W tokens, so it keeps them exactly in a ring buffer that does not grow
with the context; only the global layers hold the long context, in whichever cache the user
chose (dense, PQ codes, uniform integers). One cache object serves the whole model and keeps the
protocol of :mod:`million_jax.cache.base`: read in place inside the layer scan, write after it.

State:
    layers.glob:   the global cache's layer state, leaves [Lg, B, Hkv, ...] (e.g. PQLayer)
    layers.local:  SlidingLayer, ring_k / ring_v float[Ls, B, Hkv, W, d]
    layers.is_sliding: static tuple[bool] of length L = Lg + Ls (which stack layer i lives in)
    lengths:       int32[B] tokens stored per sequence, shared by both kinds

``attend(i, ...)`` picks the layer's kind with ``lax.cond`` (only one branch runs) and returns
writes for both stacks (zeros for the other kind); ``write`` keeps each stack's own layers'
rows. Constants (PQ codebooks) exist for the global layers only: ``layer_consts`` spreads them
over the L scanned layers (a sliding layer gets a copy it never reads).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from million_jax.cache.base import (KVCache, LayerState, Writes, check_cache_args, kept_tokens, register_cache,
                                    tree_nbytes)
from million_jax.cache.window import exact_window_attention, window_writes
from million_jax.quant.uniform import KVBits

__all__ = ["HybridCache", "HybridLayers", "SlidingLayer", "check_layer_kinds"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlidingLayer(LayerState):
    """One sliding-window layer: ring_k, ring_v float[B, Hkv, W, d] (slot = position % W)."""

    ring_k: jax.Array
    ring_v: jax.Array

    @property
    def max_len(self) -> int:
        """W: the tokens this layer keeps (its window)."""
        return self.ring_k.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.ring_k.shape[-1]

    def attend(self, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
               n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """Exact attention of q float[B, T, H, d] over the window: the ring as stored plus the new
        k, v float[B, T, Hkv, d]; writes the last W real new tokens into the ring."""
        b, t = q.shape[:2]
        hkv, w, d = self.ring_k.shape[1:]
        chex.assert_shape([k, v], (b, t, hkv, d))
        dt = self.ring_k.dtype
        k, v = k.astype(dt), v.astype(dt)
        none = jnp.zeros((b, hkv, 0, d), dt)
        out, _ = exact_window_attention(q, none, none, self.ring_k, self.ring_v, k, v, lengths, n_new)
        writes = window_writes(0, w, k, v, lengths, n_new)
        return out.astype(q.dtype), {name: writes[name] for name in ("ring_k", "ring_v")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridLayers:
    """The two stacks of a :class:`HybridCache` (module docstring); the last two are static."""

    glob: Any  # a LayerState with leaves [Lg, ...]
    local: SlidingLayer  # leaves [Ls, ...]
    is_sliding: tuple[bool, ...] = dataclasses.field(metadata=dict(static=True))
    global_cls: type = dataclasses.field(metadata=dict(static=True))

    @property
    def max_len(self) -> int:
        """T_max of the global layers: the positions the whole cache can hold."""
        return self.glob.max_len

    @property
    def head_dim(self) -> int:
        return self.glob.head_dim

    @property
    def window(self) -> int:
        return self.local.max_len

    def stack_index(self) -> np.ndarray:
        """int32[L]: layer i's index in its own stack (global or sliding)."""
        seen = {True: 0, False: 0}
        out = []
        for s in self.is_sliding:
            out.append(seen[s])
            seen[s] += 1
        return np.asarray(out, np.int32)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


@register_cache
@dataclasses.dataclass(frozen=True)
class HybridCache(KVCache):
    """Sliding layers in an exact ring, global layers in any cache (module docstring)."""

    layers: HybridLayers
    lengths: jax.Array

    @classmethod
    def create(cls, global_cache: KVCache, is_sliding: tuple[bool, ...], window: int,
               dtype: Any = jnp.bfloat16) -> "HybridCache":
        """Wrap an empty ``global_cache`` (one layer per False in ``is_sliding``) with a ring of
        ``window`` tokens for every sliding layer."""
        is_sliding = tuple(bool(s) for s in is_sliding)
        n_glob, n_local = is_sliding.count(False), is_sliding.count(True)
        if global_cache.num_layers != n_glob:
            raise ValueError(f"the global cache has {global_cache.num_layers} layers, but the model has {n_glob} "
                             f"global layers (of {len(is_sliding)})")
        if n_local == 0:
            raise ValueError("no sliding layer: use the global cache itself")
        b, hkv, d = global_cache.batch, global_cache.num_kv_heads, global_cache.head_dim
        check_cache_args(dict(num_layers=n_local, batch=b, num_kv_heads=hkv, max_len=window, head_dim=d), dtype)
        ring = (n_local, b, hkv, window, d)
        local = SlidingLayer(ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype))
        layers = HybridLayers(glob=global_cache.layers, local=local, is_sliding=is_sliding,
                              global_cls=type(global_cache))
        return cls(layers=layers, lengths=global_cache.lengths)

    @property
    def global_part(self) -> KVCache:
        """The global layers as a cache of their own kind (same lengths; a view, not a copy)."""
        return self.layers.global_cls(layers=self.layers.glob, lengths=self.lengths)

    @property
    def window(self) -> int:
        """W: tokens each sliding layer reads (its own included)."""
        return self.layers.window

    @property
    def num_layers(self) -> int:
        return len(self.layers.is_sliding)

    @property
    def num_kv_heads(self) -> int:
        return self.global_part.num_kv_heads

    @property
    def bits_per_element(self) -> KVBits:
        """The global layers' stored bits per element: only they grow with the context."""
        return self.global_part.bits_per_element

    def bytes_per_token(self) -> float:
        """Bytes one more token of capacity costs (global layers only; the rings are fixed)."""
        return self.global_part.bytes_per_token()

    def nbytes_by_kind(self) -> dict[str, int]:
        """{"global", "sliding", "total"}: bytes of the per-step state of each kind of layer."""
        return {"global": tree_nbytes(self.layers.glob), "sliding": tree_nbytes(self.layers.local),
                "total": self.nbytes()}

    def layer_consts(self, cache_consts: Any = None) -> Any:
        """The global cache's constants (checked by it, leaves [Lg, ...]) spread over the L
        scanned layers; None when the global kind takes none."""
        consts = self.global_part.layer_consts(cache_consts)
        if consts is None:
            return None
        index = self.layers.stack_index()
        glob_of = np.where(np.asarray(self.layers.is_sliding), 0, index)
        return jax.tree.map(lambda x: x[glob_of], consts)

    def attend(self, layer: jax.Array, consts: Any, q: jax.Array, k: jax.Array, v: jax.Array,
               n_new: jax.Array) -> tuple[jax.Array, Writes]:
        """Layer ``layer`` attends through its kind (``lax.cond`` on the static layer pattern).

        Returns (out, {"global": writes, "sliding": writes}), zeros for the kind it is not.
        """
        sl = self.layers
        idx = jnp.asarray(sl.stack_index())[layer]
        sliding = jnp.asarray(sl.is_sliding)[layer]
        kept = kept_tokens(self.lengths, n_new, self.max_len)  # the ring drops what the cache drops

        def glob(_):
            return sl.glob.view(idx).attend(consts, q, k, v, self.lengths, n_new)

        def local(_):
            return sl.local.view(idx).attend(None, q, k, v, self.lengths, kept)

        shape_g, shape_l = jax.eval_shape(glob, None)[1], jax.eval_shape(local, None)[1]

        def run_glob(_):
            out, w = glob(None)
            return out, {"global": w, "sliding": _zeros_like(shape_l)}

        def run_local(_):
            out, w = local(None)
            return out, {"global": _zeros_like(shape_g), "sliding": w}

        return jax.lax.cond(sliding, run_local, run_glob, None)

    def write(self, writes: Writes, n_new: jax.Array) -> "HybridCache":
        """Each stack's rows of the scanned writes (leaves [L, ...]) applied; lengths += n_new."""
        sl = self.layers
        kinds = np.asarray(sl.is_sliding)
        pick = lambda tree, rows: jax.tree.map(lambda x: x[rows], tree)  # noqa: E731
        apply = lambda state, w: jax.vmap(lambda s, ww: s.write(ww))(state, w)  # noqa: E731
        glob = apply(sl.glob, pick(writes["global"], np.nonzero(~kinds)[0]))
        local = apply(sl.local, pick(writes["sliding"], np.nonzero(kinds)[0]))
        return self.advance(dataclasses.replace(sl, glob=glob, local=local), n_new)


def check_layer_kinds(cache: KVCache, is_sliding: tuple[bool, ...], window: int) -> None:
    """ValueError unless ``cache`` fits a model with these sliding layers and window: a
    HybridCache with the same layer pattern and ring size, or a plain cache when no layer slides."""
    if any(is_sliding):
        if not isinstance(cache, HybridCache):
            raise ValueError(f"this model has {sum(is_sliding)} sliding-window layers: its cache must be a "
                             f"HybridCache (million_jax.make_cache builds one), got {type(cache).__name__}")
        if tuple(cache.layers.is_sliding) != tuple(is_sliding) or cache.window != window:
            raise ValueError(f"the HybridCache's layer pattern / window ({cache.window}) does not match the "
                             f"model's (window {window})")
    elif isinstance(cache, HybridCache):
        raise ValueError("this model has no sliding-window layer: pass a plain cache, not a HybridCache")

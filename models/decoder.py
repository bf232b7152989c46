"""The decoder skeleton every family shares: params pytree, layer scan, cache protocol, entry points.

LLaMA (RMSNorm, RoPE + llama3 scaling, GQA, SwiGLU) and Gemma 3 (QK-norm, sandwich norms,
GeGLU, scaled embeddings, sliding and global layers with their own RoPE bases) are one block
function here, steered by the family's traits (``models/families.py``) and the config
(``layer_types``, ``rope_local_theta``, ``query_pre_attn_scalar``).

Why plain functions over a parameter pytree, with Flax only for initialisers
(rather than ``linen.Module`` or ``nnx.Module``):

* the cache protocol (``million_jax/cache/base.py``) scans the layers with
  ``lax.scan`` over params stacked on a leading ``L`` axis, each layer reading the
  stacked cache in place and returning its writes, applied once after the scan. A 20-line ``scan`` over dicts says that
  directly; Linen needs ``nn.scan`` with ``variable_axes``/``split_rngs``
  plumbing and NNX needs ``nnx.split``/``merge`` around ``nnx.scan``.
* ``generate`` threads params and a donated cache through ``jax.jit`` and a
  ``lax.while_loop``: a dict of arrays needs no ``apply``/``merge`` wrappers,
  no module state, and its tree structure is trivially stable.
* loaders build the dict straight from checkpoint tensors, and users can cast,
  shard or save it with ``jax.tree`` utilities.

Params pytree (weights are ``[in, out]``, i.e. ``y = x @ w``; ``D = hidden``,
``F = intermediate``, ``H``/``Hkv`` heads, ``d = head_dim``, ``L`` layers)::

    {"embed":      [V, D],
     "layers": {"attn_norm": [L, D],
                "wq": [L, D, H*d], "wk": [L, D, Hkv*d], "wv": [L, D, Hkv*d],
                "wo": [L, H*d, D],
                "mlp_norm": [L, D],
                "w_gate": [L, D, F], "w_up": [L, D, F], "w_down": [L, F, D],
                # only with config.attention_bias: "bq" [L, H*d], "bk", "bv" [L, Hkv*d], "bo" [L, D]
                # only with config.mlp_bias: "b_gate", "b_up" [L, F], "b_down" [L, D]
                # only gemma3 (qk_norm, sandwich_norms): "q_norm", "k_norm" [L, d],
                #   "post_attn_norm", "post_mlp_norm" [L, D]
               },
     "final_norm": [D],
     "lm_head":    [D, V]}          # absent when config.tie_word_embeddings

All leaves share one float dtype (fp32 or bf16); matmuls run in that dtype,
RMSNorm statistics, RoPE, softmax and the logits are computed in fp32.
Logits are always f32. Norm weights are the multiplier itself (Gemma's 1 + w).

Sliding layers (``config.is_sliding``) need a cache that keeps their window
(``million_jax.make_cache`` builds a ``HybridCache`` for such a config); the cache-free
``forward`` masks them itself.
"""
from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx import initializers

from million_jax import rope
from million_jax.attention.exact import attention, einsum_f32
from million_jax.cache.base import CacheOverflowError, KVCache
from million_jax.cache.hybrid import check_layer_kinds
from million_jax.cache.spec import CacheSpec, make_cache
from million_jax.quant.kv_codebooks import PQCodebooks
from models.config import LlamaConfig

Params = dict[str, Any]

__all__ = ["Params", "param_shapes", "init_params", "cast_params", "init_cache",
           "rope_inv_freq", "layer_inv_freqs", "forward", "fill_cache", "check_context", "ContextLengthError", "prefill", "decode_step", "check_room"]


# ---------------------------------------------------------------- parameters
def param_shapes(config: LlamaConfig) -> Params:
    """The params tree with shape tuples as leaves (used by loaders to validate)."""
    c = config
    L, D, F, V = c.n_layers, c.hidden, c.intermediate, c.vocab
    qd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, D), "wq": (L, D, qd), "wk": (L, D, kvd), "wv": (L, D, kvd),
        "wo": (L, qd, D), "mlp_norm": (L, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    if c.attention_bias:
        layers.update(bq=(L, qd), bk=(L, kvd), bv=(L, kvd), bo=(L, D))
    if c.mlp_bias:
        layers.update(b_gate=(L, F), b_up=(L, F), b_down=(L, D))
    for name in c.traits.extra_layer_params:
        layers[name] = (L, c.head_dim) if name in ("q_norm", "k_norm") else (L, D)
    tree: Params = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not c.tie_word_embeddings:
        tree["lm_head"] = (D, V)
    return tree


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32,
                stddev: float = 0.02) -> Params:
    """Random params (normal(stddev) weights, zero biases, unit norms) as in HF init."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    normal = initializers.normal(stddev)
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(initializers.ones(k, shape, dtype))
        elif name.startswith("b"):
            leaves.append(initializers.zeros(k, shape, dtype))
        else:
            leaves.append(normal(k, shape, dtype))
    return jax.tree.unflatten(treedef, leaves)


def cast_params(params: Params, dtype: Any) -> Params:
    """All leaves cast to ``dtype`` (e.g. jnp.bfloat16)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def init_cache(config: LlamaConfig, batch: int, max_len: int,
               dtype: Any = jnp.bfloat16) -> KVCache:
    """An empty dense cache shaped for this model (a HybridCache when it has sliding layers:
    dense global layers, a ring of ``sliding_window`` tokens per sliding layer)."""
    return make_cache(CacheSpec("dense", dtype=dtype), config, batch, max_len)[0]


# ---------------------------------------------------------------- building blocks
def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """f32[d/2] inverse frequencies of the global layers (``million_jax.rope``, scaling applied):
    the ones pre-RoPE key codebooks carry, since codes serve only global layers."""
    return rope.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def layer_inv_freqs(config: LlamaConfig) -> np.ndarray:
    """f32[L, d/2]: each layer's RoPE inverse frequencies (sliding layers: ``rope_local_theta``,
    no scaling)."""
    local = rope.rope_inv_freq(config.head_dim, config.rope_local_theta, None)
    glob = rope_inv_freq(config)
    return np.stack([local if s else glob for s in config.is_sliding]).astype(np.float32)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x float[..., D] normalised in f32, then scaled by w in x.dtype (as HF)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = x @ w
    return y if b is None else y + b


def _activation(name: str, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


def _block(config: LlamaConfig, lp: Params, h: jax.Array, cos: jax.Array, sin: jax.Array,
           attend) -> tuple[jax.Array, Any]:
    """One decoder layer. h: float[B, T, D]; attend(q, k, v) -> (out[B,T,H,d], state).

    cos, sin: f32[B, T, d/2] of this layer's RoPE. The family's traits add the QK-norm (before
    RoPE) and the norms after attention / MLP; q is pre-scaled so that attention's default
    d^-1/2 gives the model's ``attn_scale``.
    """
    c, fam = config, config.traits
    b, t, _ = h.shape
    eps = c.rms_norm_eps
    x = _rms_norm(h, lp["attn_norm"], eps)
    q = _linear(x, lp["wq"], lp.get("bq")).reshape(b, t, c.n_heads, c.head_dim)
    k = _linear(x, lp["wk"], lp.get("bk")).reshape(b, t, c.n_kv_heads, c.head_dim)
    v = _linear(x, lp["wv"], lp.get("bv")).reshape(b, t, c.n_kv_heads, c.head_dim)
    if fam.qk_norm:
        q, k = _rms_norm(q, lp["q_norm"], eps), _rms_norm(k, lp["k_norm"], eps)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # over heads
    q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
    ratio = c.attn_scale * c.head_dim ** 0.5
    if ratio != 1.0:
        q = (q.astype(jnp.float32) * ratio).astype(q.dtype)
    out, state = attend(q, k, v)
    o = _linear(out.reshape(b, t, -1).astype(h.dtype), lp["wo"], lp.get("bo"))
    h = h + (_rms_norm(o, lp["post_attn_norm"], eps) if fam.sandwich_norms else o)
    x = _rms_norm(h, lp["mlp_norm"], eps)
    gate = _activation(fam.activation, _linear(x, lp["w_gate"], lp.get("b_gate")))
    y = _linear(gate * _linear(x, lp["w_up"], lp.get("b_up")), lp["w_down"], lp.get("b_down"))
    h = h + (_rms_norm(y, lp["post_mlp_norm"], eps) if fam.sandwich_norms else y)
    return h, state


def _embed(config: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """tokens int[B, T] -> h float[B, T, D] (times sqrt(D) for families that scale it)."""
    h = params["embed"][tokens]
    if config.traits.embed_scale:
        h = h * jnp.asarray(config.hidden ** 0.5, h.dtype)
    return h


def _run_layers(config: LlamaConfig, params: Params, h: jax.Array, positions: jax.Array,
                attend, consts: Any) -> tuple[jax.Array, Any]:
    """lax.scan over the stacked layers; attend(i, const, q, k, v) -> (out, writes).

    Returns (h, the writes of every layer stacked on a leading L axis). The cache is only
    read inside the loop (in place, see million_jax/cache/base.py); the caller writes all
    layers once afterwards, so a donated cache is updated in place and never copied.
    """
    freqs = layer_inv_freqs(config)  # f32[L, d/2]
    if len({f.tobytes() for f in freqs}) == 1:  # one RoPE for every layer: computed once
        cos, sin = rope.rope_cos_sin(positions, freqs[0])  # f32[B, T, d/2]
        tables = lambda f: (cos, sin)  # noqa: E731
    else:
        tables = lambda f: rope.rope_cos_sin(positions, f)  # noqa: E731

    def body(h, xs):
        i, f, lp, const = xs
        cos, sin = tables(f)
        return _block(config, lp, h, cos, sin, lambda q, k, v: attend(i, const, q, k, v))

    xs = (jnp.arange(config.n_layers), jnp.asarray(freqs), params["layers"], consts)
    return jax.lax.scan(body, h, xs)


def _logits(config: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """h float[..., D] -> f32[..., V] (final norm + LM head)."""
    h = _rms_norm(h, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        return einsum_f32("...d,vd->...v", h, params["embed"])
    return einsum_f32("...d,dv->...v", h, params["lm_head"])


def _check_tokens(tokens: jax.Array, rank: int) -> None:
    chex.assert_rank(tokens, rank)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integers, got {tokens.dtype}")


# ---------------------------------------------------------------- entry points
@functools.partial(jax.jit, static_argnums=(0,))
def forward(config: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Cache-free causal forward. tokens int[B, T] -> logits f32[B, T, V]."""
    _check_tokens(tokens, 2)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = _embed(config, params, tokens)
    sliding = jnp.asarray(config.is_sliding)
    window = config.sliding_window or t  # the mask below is all-true where no layer slides
    pos = jnp.arange(t)
    causal = pos[None, :] <= pos[:, None]  # [T, S]: key s visible to query p
    in_window = causal & (pos[None, :] > pos[:, None] - window)

    def attend(i, const, q, k, v):
        mask = jnp.broadcast_to(jnp.where(sliding[i], in_window, causal), (b, t, t))
        return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask), None

    h, _ = _run_layers(config, params, h, positions, attend, None)
    return _logits(config, params, h)


def _with_cache(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
                n_new: jax.Array, cache_consts: Any) -> tuple[jax.Array, KVCache]:
    """Run tokens int[B, T] (n_new[b] real ones) through the model, appending to cache.

    Returns (hidden float[B, T, D] before the final norm, new cache).
    """
    b, t = tokens.shape
    chex.assert_shape(n_new, (b,))
    n_new = n_new.astype(jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if isinstance(cache_consts, PQCodebooks):  # static frequencies: a trace-time check
        cache_consts.check_rope(rope_inv_freq(config))
    consts = cache.layer_consts(cache_consts)
    if cache.num_layers != config.n_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, model has {config.n_layers}")
    check_layer_kinds(cache, config.is_sliding, config.sliding_window)
    h = _embed(config, params, tokens)

    def attend(i, const, q, k, v):
        return cache.attend(i, const, q, k, v, n_new)

    h, writes = _run_layers(config, params, h, positions, attend, consts)
    return h, cache.write(writes, n_new)


def check_room(cache: KVCache, n_new: Any) -> None:
    """The host's room check: CacheOverflowError unless every row's ``n_new`` new tokens fit.

    ``prefill`` and ``decode_step`` are jitted and check nothing (tokens past ``max_len`` are
    dropped, never written out of bounds): a host caller calls this first, once per call or
    once for a whole run (``check_room(cache, prompt_len + max_new_tokens - 1)``).
    n_new: int[B] or a number (``decode_step``: 1, or ``active`` as 0 / 1).
    Under jit use ``cache.overflow(n_new)`` (bool[B]; ``generate`` stops such a row with
    ``cache_full``). Lengths spread over other hosts cannot be read here: nothing is checked.
    """
    lengths = cache.lengths
    if any(isinstance(a, jax.core.Tracer) for a in (lengths, n_new)):
        raise TypeError("check_room runs on the host with concrete lengths; under jit test cache.overflow(n_new)")
    if not all(getattr(a, "is_fully_addressable", True) for a in (lengths, n_new)):
        return
    lens, new = np.asarray(lengths), np.broadcast_to(np.asarray(n_new), np.shape(lengths))
    over = np.nonzero(lens + new > cache.max_len)[0]
    if over.size:
        b = int(over[0])
        raise CacheOverflowError(
            f"sequence {b} holds {int(lens[b])} of the cache's {cache.max_len} positions and cannot take "
            f"{int(new[b])} more (build the cache with a larger max_len)")


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("last_only",), donate_argnums=(2,))
def prefill(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
            lengths: jax.Array, cache_consts: Any = None, *,
            last_only: bool = False) -> tuple[jax.Array, KVCache]:
    """Append a (ragged) batch of prompts to the cache (jitted; ``cache`` is donated).

    tokens: int[B, T], row b holds ``lengths[b]`` real tokens then padding.
    Tokens are placed after what the cache already holds (chunked prefill and
    multi-turn work by calling this again). Returns (logits, new cache) with
    logits f32[B, T, V] (rows past lengths[b] are meaningless), or with
    ``last_only`` f32[B, V] at each sequence's last real token (meaningless
    where lengths[b] == 0). The passed cache is donated: use the returned one.
    Nothing is checked on the host: call ``check_room(cache, lengths)`` first (tokens past
    ``max_len`` are dropped); under jit test ``cache.overflow(lengths)``.
    """
    _check_tokens(tokens, 2)
    h, cache = _with_cache(config, params, cache, tokens, lengths, cache_consts)
    if last_only:
        idx = jnp.maximum(lengths.astype(jnp.int32) - 1, 0)
        h = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
    return _logits(config, params, h), cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def fill_cache(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
               lengths: jax.Array, cache_consts: Any = None) -> KVCache:
    """``prefill`` without the output projection: only the new cache (calibration forwards,
    which need the keys and values, not the [T, V] logits). Jitted; ``cache`` is donated."""
    _check_tokens(tokens, 2)
    return _with_cache(config, params, cache, tokens, lengths, cache_consts)[1]


class ContextLengthError(ValueError):
    """More tokens than the model's context (``max_position_embeddings``)."""


def check_context(config: LlamaConfig, n_tokens: int, what: str = "the sequence") -> None:
    """ContextLengthError unless ``n_tokens`` positions fit the model's context."""
    if int(n_tokens) > config.max_position_embeddings:
        raise ContextLengthError(f"{what} needs {int(n_tokens)} positions, more than the model's context "
                                 f"(max_position_embeddings {config.max_position_embeddings})")


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode_step(config: LlamaConfig, params: Params, cache: KVCache, token: jax.Array,
                cache_consts: Any = None, *,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One new token per sequence (jitted; ``cache`` is donated). token int[B] -> (logits f32[B, V], new cache).

    active: optional bool[B]; rows where it is False write nothing and keep
    their length (their logits are meaningless). Used by ``generate`` to
    freeze finished sequences inside a batch. Nothing is checked on the host: call
    ``check_room(cache, 1)`` (or ``check_room(cache, active)``) first, or once for a whole run;
    under jit test ``cache.overflow(...)`` (``generate`` stops such a row with ``cache_full``).
    """
    _check_tokens(token, 1)
    b = token.shape[0]
    n_new = jnp.ones((b,), jnp.int32) if active is None else active.astype(jnp.int32)
    h, cache = _with_cache(config, params, cache, token[:, None], n_new, cache_consts)
    return _logits(config, params, h[:, 0]), cache

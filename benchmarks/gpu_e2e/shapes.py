"""Model shapes by name, and the bytes model: weights, caches, what one decode step reads."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from million_jax.cache.base import tree_nbytes
from models import LlamaConfig, preset

from .settings import Settings


def model_configs(tiny: bool) -> dict[str, LlamaConfig]:
    """The model shapes by name (random weights; only the shapes matter here)."""
    if tiny:
        return {"tiny-mha": preset("tiny").replace(n_kv_heads=4), "tiny-gqa": preset("tiny")}
    return {"llama2-7b": preset("llama2-7b"), "llama3.1-8b": preset("llama3.1-8b")}


def t_max_for(s: Settings, context: int) -> int:
    """Cache slots of a row: the context plus every token the decode calls add, rounded up to 64."""
    headroom = (1 + s.repeats) * s.new_tokens + 1
    return context + (-(-headroom // 64) * 64)


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves (arrays or ShapeDtypeStructs)."""
    return tree_nbytes(tree)


def param_bytes(config: LlamaConfig, dtype_bytes: int = 2) -> int:
    """Bytes of all weights."""
    c = config
    qd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = 2 * c.hidden + c.hidden * (qd + 2 * kvd) + qd * c.hidden + 3 * c.hidden * c.intermediate
    head = 0 if c.tie_word_embeddings else c.hidden * c.vocab
    return dtype_bytes * (c.n_layers * per_layer + c.vocab * c.hidden + c.hidden + head)


def weight_bytes_per_step(config: LlamaConfig, batch: int, dtype_bytes: int = 2) -> int:
    """Weights one decode step must read: everything except the embedding (a B-row gather)."""
    emb = 0 if config.tie_word_embeddings else config.vocab * config.hidden * dtype_bytes
    return param_bytes(config, dtype_bytes) - emb + batch * config.hidden * dtype_bytes


def cache_bytes_per_step(config: LlamaConfig, s: Settings, cache: str, impl: str, batch: int,
                         context: int, t_max: int) -> int:
    """KV bytes one decode step reads (see the markdown's 'where the time goes')."""
    c = config
    fp = jnp.dtype(s.dtype).itemsize
    lbh = c.n_layers * batch * c.n_kv_heads
    if cache == "bf16":  # the dense cache attends over every preallocated slot (masked)
        return 2 * lbh * t_max * c.head_dim * fp
    code_bytes = 1 if s.nbits <= 8 else 2
    tokens = context if impl == "pallas" else t_max  # the kernel stops at the length; xla tiles all
    codebooks = 2 * c.n_layers * c.n_kv_heads * s.M * 2**s.nbits * (c.head_dim // s.M) * 4
    exact = 2 * lbh * (s.window + s.sinks) * c.head_dim * fp
    return 2 * lbh * tokens * s.M * code_bytes + codebooks + exact

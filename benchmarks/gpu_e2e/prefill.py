"""Filling a row's cache: a real chunked prefill (timed) or the synthetic fill."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models import LlamaConfig, prefill

from .caches import make_synthetic_fn
from .memory import Program, compile_program
from .settings import Settings
from .state import ModelState

PQ_PREFILL_TILE = 512  # keys per step of the xla PQ attention (million_jax.attention.pq_xla's tile)


def prefill_chunk(batch: int, context: int, keys: int, n_heads: int, score_bytes: int) -> int:
    """Largest power-of-two chunk (<= 2048) dividing ``context`` whose fp32 scores fit.

    ``keys``: keys scored at once per query: T_max for the dense cache (its attention masks the
    whole preallocated cache), the tile size for PQ (an online softmax over code tiles).
    """
    chunk = min(2048, context & -context)
    while chunk > 16 and batch * n_heads * chunk * keys * 4 > score_bytes:
        chunk //= 2
    return chunk


def prefill_work(config: LlamaConfig, batch: int, context: int, t_max: int, cache: str) -> float:
    """The units a prefill's time is proportional to (B T T_max L H; PQ, which encodes, counts 2x)."""
    work = batch * context * t_max * config.n_layers * config.n_heads
    return work * (2.0 if cache == "pq" else 1.0)


def make_prefill_fn(config: LlamaConfig, chunk: int) -> Callable[..., Any]:
    """jit(params, cache, tokens int[B, T], consts) -> (last logits, cache): chunked prefill.

    T / chunk calls of ``models.prefill`` in a ``lax.fori_loop`` (one compiled program, the
    cache donated and carried in place).
    """

    def run(params, cache, tokens, consts):
        b, t = tokens.shape
        lens = jnp.full((b,), chunk, jnp.int32)

        def body(i, carry):
            cache, _ = carry
            toks = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)
            logits, cache = prefill(config, params, cache, toks, lens, consts, last_only=True)
            return cache, logits

        init = (cache, jnp.zeros((b, config.vocab), jnp.float32))
        cache, logits = jax.lax.fori_loop(0, t // chunk, body, init)
        return logits, cache

    return jax.jit(run, donate_argnums=(1,))


def compile_fill(s: Settings, m: ModelState, batch: int, context: int, t_max: int, cache: str,
                 make_empty: Callable[[], Any], cache_struct: Any, consts: Any, real: bool,
                 row: dict[str, Any]) -> Program:
    """The fill program of a row: the chunked prefill (``real``) or the synthetic fill."""
    if not real:
        return compile_program(make_synthetic_fn(make_empty, context, s.nbits))
    c = m.config
    keys = t_max if cache == "bf16" else PQ_PREFILL_TILE
    chunk = prefill_chunk(batch, context, keys, c.n_heads, s.prefill_score_bytes)
    fill = compile_program(make_prefill_fn(c, chunk), m.params, cache_struct,
                           jax.ShapeDtypeStruct((batch, context), jnp.int32), consts)
    row.update(prefill_chunk=chunk, prefill_compile_seconds=fill.compile_seconds,
               prefill_peak_bytes=fill.peak_bytes)
    return fill


def fill_cache(fill: Program, m: ModelState, batch: int, context: int, make_empty: Callable[[], Any],
               consts: Any, real: bool, row: dict[str, Any]) -> Any:
    """Run the fill program; the filled cache. Records the prefill (or synthetic fill) time."""
    if not real:
        t0 = time.perf_counter()
        filled = jax.block_until_ready(fill())
        row["fill_seconds"] = time.perf_counter() - t0
        return filled
    empty = jax.jit(make_empty)()
    toks = jax.random.randint(jax.random.key(11), (batch, context), 0, m.config.vocab, jnp.int32)
    jax.block_until_ready((empty, toks))
    t0 = time.perf_counter()
    logits, filled = fill(m.params, empty, toks, consts)
    jax.block_until_ready((logits, filled))
    dt = time.perf_counter() - t0
    del empty
    row.update(prefill_seconds=dt, prefill_tokens_per_s=batch * context / dt,
               prefill_logits_finite=bool(jnp.isfinite(logits).all()))
    return filled

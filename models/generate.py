"""Batched autoregressive generation: prefill, then one jitted ``lax.while_loop``.

``generate`` compiles prefill + the whole decode loop into one XLA program
with the cache donated, so there is no host round trip and no reallocation
per token. Every sequence in the batch stops on its own:

    STOP_EOS        it emitted one of the EOS ids (the EOS token is included)
    STOP_MAX_TOKENS it emitted ``max_new_tokens`` tokens
    STOP_CACHE_FULL the cache has no room for the token it would have to
                    append to continue (or the prompt itself did not fit);
                    nothing is ever written past ``max_len``

Finished sequences are frozen (``decode_step(active=...)`` writes nothing for
them) while the others continue. ``prefill`` / ``decode_step`` are the model's jitted entry
points (traced into this program; they check nothing on the host): a row without room is
stopped here with ``cache_full`` instead, so ``generate`` needs no ``check_room``. The last emitted token of each sequence is
not appended to the cache (as in HF): the cache holds prompt + generated
tokens minus the last, ready for a follow-up ``prefill``.

``forced``: a continuation int[B, S] to score in the same program. After the prefill, the
continuation is fed one ``decode_step`` at a time to a copy of the prompt's cache (teacher
forcing) and the log-probability of each of its tokens is returned (``forced_logp``); the
sampled answer then starts from the untouched prompt cache. One prefill serves both: a
needle test gets the greedy answer and how sure the model is of the right one, for about one
more cache of peak memory (the copy).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from million_jax.cache.base import KVCache
from models.config import LlamaConfig
from models.decoder import Params, decode_step, prefill

__all__ = ["GenerateResult", "generate", "prefill_prompt", "sample_logits", "STOP_RUNNING", "STOP_EOS",
           "STOP_MAX_TOKENS", "STOP_CACHE_FULL", "STOP_NAMES"]

STOP_RUNNING, STOP_EOS, STOP_MAX_TOKENS, STOP_CACHE_FULL = 0, 1, 2, 3
STOP_NAMES = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_MAX_TOKENS: "max_tokens",
              STOP_CACHE_FULL: "cache_full"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Output of ``generate``.

    tokens:        int32[B, max_new_tokens]; row b is valid up to num_generated[b],
                   then ``pad_id``
    num_generated: int32[B]
    stop_reason:   int32[B], one of STOP_EOS / STOP_MAX_TOKENS / STOP_CACHE_FULL
    cache:         the cache after generation (the input cache was donated)
    forced_logp:   float32[B, S] log p(forced[b, i] | prompt, forced[b, :i]) when ``generate``
                   was given ``forced`` (else None); NaN where the prompt did not fit or from
                   the first entry whose preceding forced token found no free cache row
    """

    tokens: jax.Array
    num_generated: jax.Array
    stop_reason: jax.Array
    cache: Any
    forced_logp: jax.Array | None = None

    def stop_reasons(self) -> list[str]:
        """Per-sequence stop reason names: 'eos' / 'max_tokens' / 'cache_full'."""
        return [STOP_NAMES[int(r)] for r in jax.device_get(self.stop_reason)]

    def sequences(self) -> list[list[int]]:
        """The generated token ids of each sequence, trimmed to num_generated."""
        toks, n = jax.device_get((self.tokens, self.num_generated))
        return [list(map(int, toks[b, : int(n[b])])) for b in range(toks.shape[0])]


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError for sampling settings :func:`sample_logits` / :func:`generate` cannot use."""
    if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"bad sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p} "
                         "(need temperature >= 0, top_k >= 0, 0 < top_p <= 1)")


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Pick one token per row of logits f32[B, V] -> int32[B].

    temperature == 0 is greedy (argmax; key unused). Otherwise logits are
    divided by temperature, restricted to the top_k largest (0 = all) and to
    the smallest set whose probability reaches top_p (1.0 = all), and sampled.
    The three settings must be Python numbers here; ``generate`` passes them
    as traced values so changing them does not recompile.
    """
    return _sample(logits, key, temperature, top_k, top_p, greedy=temperature == 0.0,
                   use_top_k=0 < top_k < logits.shape[-1], use_top_p=top_p < 1.0)


def _sample(logits: jax.Array, key: jax.Array, temperature: Any, top_k: Any, top_p: Any, *,
            greedy: bool, use_top_k: bool, use_top_p: bool) -> jax.Array:
    """sample_logits with traced temperature/top_k/top_p; the flags are static."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if use_top_k or use_top_p:
        srt = jnp.sort(logits, axis=-1)[:, ::-1]                          # descending
    if use_top_k:
        k = jnp.clip(jnp.asarray(top_k, jnp.int32), 1, logits.shape[-1])
        kth = jax.lax.dynamic_index_in_dim(srt, k - 1, axis=1)            # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        srt = jnp.where(srt < kth, -jnp.inf, srt)
    if use_top_p:
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                       # mass of better tokens
        keep = before < top_p                                             # always keeps the best
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _prefill_last(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
                  lengths: jax.Array, cache_consts: Any, chunk: int | None) -> tuple[jax.Array, KVCache]:
    """Prefill tokens int[B, T] (row b: lengths[b] >= 1 real ones) -> (logits f32[B, V] at each
    row's last prompt token, cache), one forward or ``ceil(T / chunk)`` forwards of ``chunk``
    tokens in a ``fori_loop``.

    Chunks bound the prefill's working memory (attention scores and activations grow with the
    tokens per forward) at the same result: each chunk is appended after the previous ones
    (rows whose prompt has ended take 0 tokens), and the logits of a row are taken from the
    chunk that holds its last token.
    """
    b, t = tokens.shape
    if chunk is None or chunk >= t:
        return prefill(config, params, cache, tokens, lengths, cache_consts, last_only=True)
    n_chunks = -(-t // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - t)))

    def body(c, carry):
        cache, last = carry
        start = c * chunk
        part = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        n_new = jnp.clip(lengths - start, 0, chunk)
        logits, cache = prefill(config, params, cache, part, n_new, cache_consts, last_only=True)
        ends_here = (n_new > 0) & (lengths <= start + chunk)
        return cache, jnp.where(ends_here[:, None], logits, last)

    shape = jax.eval_shape(lambda c: prefill(config, params, c, tokens[:, :chunk], lengths, cache_consts,
                                             last_only=True)[0], cache)
    last = jnp.zeros(shape.shape, shape.dtype)
    cache, last = jax.lax.fori_loop(0, n_chunks, body, (cache, last))
    return last, cache


def check_prefill_chunk(chunk: Any) -> int | None:
    """``chunk`` as None or an int >= 1; ValueError naming ``prefill_chunk`` otherwise."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1):
        raise ValueError(f"prefill_chunk must be None or an int >= 1, got {chunk!r}")
    return None if chunk is None else int(chunk)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("chunk",), donate_argnums=(2,))
def _prefill_prompt_jit(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
                        lengths: jax.Array, cache_consts: Any, *, chunk: int | None) -> tuple[jax.Array, KVCache]:
    return _prefill_last(config, params, cache, tokens, lengths, cache_consts, chunk)


def prefill_prompt(config: LlamaConfig, params: Params, cache: KVCache, tokens: jax.Array,
                   lengths: jax.Array, cache_consts: Any = None, *,
                   prefill_chunk: int | None = None) -> tuple[jax.Array, KVCache]:
    """Append prompts int[B, T] (row b: lengths[b] real tokens) to the cache and return
    (logits f32[B, V] at each row's last prompt token, cache): ``prefill(last_only=True)`` in
    one forward (``prefill_chunk=None``) or in forwards of ``prefill_chunk`` tokens (same
    result, working memory bounded by the chunk instead of T). Jitted, ``cache`` donated;
    nothing is checked on the host but the chunk: call ``check_room(cache, lengths)`` first.
    """
    chunk = check_prefill_chunk(prefill_chunk)
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    chex.assert_rank(tokens, 2)
    chex.assert_shape(lengths, (tokens.shape[0],))
    return _prefill_prompt_jit(config, params, cache, tokens, lengths, cache_consts, chunk=chunk)


@functools.partial(
    jax.jit,
    static_argnames=("config", "max_new_tokens", "greedy", "use_top_k", "use_top_p", "prefill_chunk"),
    donate_argnames=("cache",),
)
def _generate_jit(params: Params, cache: KVCache, prompt_tokens: jax.Array,
                  prompt_lengths: jax.Array, key: jax.Array, cache_consts: Any, forced: jax.Array | None,
                  eos: jax.Array, pad_id: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, *, config: LlamaConfig, max_new_tokens: int, greedy: bool,
                  use_top_k: bool, use_top_p: bool, prefill_chunk: int | None) -> GenerateResult:
    b = prompt_tokens.shape[0]
    max_len = cache.max_len
    fits = cache.lengths + prompt_lengths <= max_len
    logits, cache = _prefill_last(config, params, cache, prompt_tokens, prompt_lengths, cache_consts,
                                  prefill_chunk)
    forced_logp = None if forced is None else _score_forced(config, params, cache, logits, forced, fits,
                                                            cache_consts)
    sample = functools.partial(_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                               greedy=greedy, use_top_k=use_top_k, use_top_p=use_top_p)

    def emit(i, tok, active, out, n_gen, reason):
        """Record token tok[b] for active rows as their i-th token; update stop reasons."""
        out = out.at[:, i].set(jnp.where(active, tok, out[:, i]))
        n_gen = n_gen + active.astype(jnp.int32)
        is_eos = jnp.any(tok[:, None] == eos[None, :], axis=-1)
        reason = jnp.where(active & is_eos, STOP_EOS, reason)
        reason = jnp.where(active & (reason == STOP_RUNNING) & (n_gen >= max_new_tokens),
                           STOP_MAX_TOKENS, reason)
        return out, n_gen, reason

    key, sub = jax.random.split(key)
    tok = sample(logits, sub)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
    n_gen = jnp.zeros((b,), jnp.int32)
    reason = jnp.where(fits, STOP_RUNNING, STOP_CACHE_FULL).astype(jnp.int32)
    out, n_gen, reason = emit(0, tok, fits, out, n_gen, reason)

    def cond(state):
        i, _, _, _, _, reason, _ = state
        return (i < max_new_tokens) & jnp.any(reason == STOP_RUNNING)

    def body(state):
        i, cache, tok, out, n_gen, reason, key = state
        running = reason == STOP_RUNNING
        full = cache.lengths >= max_len            # no room to append `tok`
        reason = jnp.where(running & full, STOP_CACHE_FULL, reason)
        active = running & ~full
        logits, cache = decode_step(config, params, cache, tok, cache_consts, active=active)
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub)
        out, n_gen, reason = emit(i, nxt, active, out, n_gen, reason)
        tok = jnp.where(active, nxt, tok)
        return i + 1, cache, tok, out, n_gen, reason, key

    state = (jnp.int32(1), cache, tok, out, n_gen, reason, key)
    _, cache, _, out, n_gen, reason, _ = jax.lax.while_loop(cond, body, state)
    return GenerateResult(tokens=out, num_generated=n_gen, stop_reason=reason, cache=cache,
                          forced_logp=forced_logp)


def _score_forced(config: LlamaConfig, params: Params, cache: KVCache, logits: jax.Array, forced: jax.Array,
                  fits: jax.Array, cache_consts: Any) -> jax.Array:
    """float32[B, S] log p of each forced token, teacher-forced through a copy of ``cache``.

    logits: f32[B, V] at the last prompt token; forced: int32[B, S]. Token i is scored after
    prompt + forced[:, :i]; the last one is never appended, so the copy needs S - 1 free rows
    (rows without them, or whose prompt did not fit, score NaN from the first token that
    could not be appended).

    A copy, not a rollback of ``lengths``: the S - 1 appended tokens overwrite ring slots
    (slot = pos % W: a cache's exact recent tokens, a sliding-window layer) that generation still
    reads after the prompt, and resetting ``lengths`` would not bring them back.
    """
    s = forced.shape[1]

    def token_logp(lg: jax.Array, tok: jax.Array) -> jax.Array:
        lp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]

    out = jnp.full(forced.shape, jnp.nan, jnp.float32)
    out = out.at[:, 0].set(jnp.where(fits, token_logp(logits, forced[:, 0]), jnp.nan))

    def body(i, carry):
        c, ok, out = carry
        ok = ok & (c.lengths < c.max_len)
        lg, c = decode_step(config, params, c, forced[:, i - 1], cache_consts, active=ok)
        out = out.at[:, i].set(jnp.where(ok, token_logp(lg, forced[:, i]), jnp.nan))
        return c, ok, out

    _, _, out = jax.lax.fori_loop(1, s, body, (cache, fits, out))
    return out


def generate(config: LlamaConfig, params: Params, cache: KVCache, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, key: jax.Array | None = None, *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None,
             pad_id: int = 0, cache_consts: Any = None,
             prefill_chunk: int | None = None, forced: jax.Array | None = None) -> GenerateResult:
    """Generate up to ``max_new_tokens`` tokens per sequence (see module docstring).

    prompt_tokens:  int[B, T] prompts, left-aligned, row b holds prompt_lengths[b] >= 1
                    real tokens; they are appended to what ``cache`` already holds.
    key:            PRNG key (required unless temperature == 0).
    eos_id:         stop id(s); None -> config.eos_ids; () -> never stop on EOS.
    prefill_chunk:  None: the prompt in one forward; n: forwards of n tokens each, same result,
                    working memory bounded by n tokens instead of T (long prompts).
    forced:         int[B, S] (S >= 1) a continuation to score: ``result.forced_logp[b, i]`` is
                    log p(forced[b, i] | prompt, forced[b, :i]) through the same cache (teacher
                    forced on a copy of it, after the same prefill). Entry i depends only on
                    forced[:, :i + 1], so ragged continuations are padded at the end and the
                    padding's entries ignored. The cache needs S - 1 rows of room beyond the
                    prompt (entries past the room are NaN). Cost: the copy, about one more cache
                    in device memory at the peak.
    The cache is donated: do not use the passed cache afterwards, use result.cache.
    """
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    chex.assert_rank(prompt_tokens, 2)
    chex.assert_shape(prompt_lengths, (prompt_tokens.shape[0],))
    # Host-side check when the values are here (not under jit, not spread over other hosts).
    if not isinstance(prompt_lengths, jax.core.Tracer) and getattr(prompt_lengths, "is_fully_addressable", True):
        lens = np.asarray(prompt_lengths)
        if np.any(lens < 1) or np.any(lens > prompt_tokens.shape[1]):
            raise ValueError(f"prompt_lengths must be in [1, {prompt_tokens.shape[1]}], "
                             f"got {lens.tolist()}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prefill_chunk = check_prefill_chunk(prefill_chunk)
    check_sampling(temperature, top_k, top_p)
    if forced is not None:
        shape, dtype = np.shape(forced), getattr(forced, "dtype", np.asarray(forced).dtype)
        if len(shape) != 2 or shape[0] != prompt_tokens.shape[0] or shape[1] < 1:
            raise ValueError(f"forced must be int[B={prompt_tokens.shape[0]}, S >= 1], got shape {shape}")
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"forced must hold integer token ids, got dtype {dtype}")
        if not isinstance(forced, jax.core.Tracer) and getattr(forced, "is_fully_addressable", True):
            ids = np.asarray(forced)  # checked on the host before any cast to int32
            if ids.min() < 0 or ids.max() >= config.vocab:
                raise ValueError(f"forced token ids must be in [0, {config.vocab}), got {ids.min()}..{ids.max()}")
        forced = jnp.asarray(forced, jnp.int32)
    if key is None:
        if temperature != 0.0:
            raise ValueError("a PRNG key is required when temperature > 0")
        key = jax.random.key(0)
    if eos_id is None:
        eos_ids = tuple(config.eos_ids)
    elif isinstance(eos_id, int):
        eos_ids = (eos_id,)
    else:
        eos_ids = tuple(int(e) for e in eos_id)
    # padded with -1 (never sampled) to a multiple of 4 so most EOS sets share one compile
    padded = list(eos_ids) + [-1] * (-len(eos_ids) % 4 or (4 if not eos_ids else 0))
    eos = np.asarray(padded, np.int32)
    return _generate_jit(params, cache, prompt_tokens, prompt_lengths, key, cache_consts, forced,
                         eos, jnp.int32(pad_id), jnp.float32(temperature), jnp.int32(top_k),
                         jnp.float32(top_p), config=config, max_new_tokens=int(max_new_tokens),
                         greedy=temperature == 0.0, use_top_k=top_k > 0, use_top_p=top_p < 1.0,
                         prefill_chunk=prefill_chunk)

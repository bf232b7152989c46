"""``million-jax generate``: stream text through a KV cache, then report speed and memory.

Prefill runs the prompt in forwards of ``prefill_chunk`` tokens (or in one); then one jitted
``decode_step`` (cache donated) per token, each token printed as soon as it is sampled (text is
flushed only at complete UTF-8 characters).
Decode speed excludes the first step, which compiles.
"""
from __future__ import annotations

import time
from typing import Any, Sequence, TextIO

import jax
import jax.numpy as jnp

from million_app import progress
from million_app import caches
from million_app.errors import UsageError
from million_app.flags import available_memory, check_positions
from million_app.report import human_bytes
from million_jax.cache.spec import CacheSpec
import models
from models import LoadedModel, check_room, decode_step, prefill_prompt, sample_logits

CHAT_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_prompt(model: LoadedModel, prompt: str) -> str:
    """The prompt in the ChatML template (SmolLM2-Instruct); UsageError if the model lacks it."""
    if model.tokenizer.token_to_id("<|im_start|>") is None:
        raise UsageError("--chat: this model's tokenizer has no <|im_start|> chat tokens")
    return CHAT_TEMPLATE.format(prompt=prompt)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """:func:`models.check_sampling`, its ValueError as a UsageError (one ``error:`` line)."""
    try:
        models.check_sampling(temperature, top_k, top_p)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_fits(model: LoadedModel, spec: CacheSpec, prompt_tokens: int, max_new_tokens: int) -> int:
    """The cache length prompt + new tokens; UsageError (one line) if it exceeds the model's
    max_position_embeddings or the cache would not fit in the free memory."""
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    max_len = prompt_tokens + max_new_tokens
    check_positions(model, max_len, f"the prompt ({prompt_tokens} tokens) + --max-new-tokens "
                                    f"{max_new_tokens}")
    need = caches.memory(spec, model.config, 1, max_len)["cache_bytes"]
    free = available_memory()
    if free is not None and need > free:
        raise UsageError(f"a {caches.label(spec)} cache for {max_len} positions needs "
                         f"{human_bytes(need)}, more than the {human_bytes(free)} free here; "
                         "lower --max-new-tokens")
    return max_len


def stream_generate(model: LoadedModel, prompt_ids: Sequence[int], spec: CacheSpec, *,
                    max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, out: TextIO | None = None,
                    bar_desc: str | None = None, prefill_chunk: int | None = None) -> dict[str, Any]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, writing text to ``out``.

    Returns a dict: text, tokens, prompt_tokens, new_tokens, stop ("eos" / "max_tokens"),
    prefill_s, decode_tokens_per_s, cache_bytes (of the filled cache) and the memory
    accounting of ``caches.memory`` for this sequence length. ``bar_desc``: show a
    progress bar (tokens, ETA) under that name, for output that is not streamed to a terminal.
    ``prefill_chunk``: prompt tokens per forward (None: the whole prompt in one), see
    :func:`models.prefill_prompt`.
    """
    if not prompt_ids:
        raise UsageError("the prompt is empty")
    check_sampling(temperature, top_k, top_p)
    cfg, params = model.config, model.params
    max_len = check_fits(model, spec, len(prompt_ids), max_new_tokens)
    cache, consts = caches.build(spec, cfg, 1, max_len)
    check_room(cache, len(prompt_ids) + max_new_tokens - 1)  # the whole run: prompt + every decode step
    key = jax.random.PRNGKey(seed)
    eos = set(cfg.eos_ids)

    t0 = time.perf_counter()
    logits, cache = prefill_prompt(cfg, params, cache, jnp.asarray([list(prompt_ids)], jnp.int32),
                                   jnp.asarray([len(prompt_ids)], jnp.int32), consts,
                                   prefill_chunk=prefill_chunk)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - t0

    generated: list[int] = []
    shown = ""
    step_times: list[float] = []
    stop = "max_tokens"
    pbar = progress.bar(max_new_tokens, bar_desc, unit="token") if bar_desc else None
    try:
        for i in range(max_new_tokens):
            key, sub = jax.random.split(key)
            tok = sample_logits(logits, sub, temperature, top_k, top_p)
            generated.append(int(tok[0]))
            if pbar is not None:
                pbar.update()
            text = model.decode(generated, skip_special_tokens=True)
            if out is not None and not text.endswith("\ufffd") and text.startswith(shown):
                out.write(text[len(shown):])
                out.flush()
                shown = text
            if generated[-1] in eos:
                stop = "eos"
                break
            if i == max_new_tokens - 1:
                break
            t1 = time.perf_counter()
            logits, cache = decode_step(cfg, params, cache, tok, consts)
            logits.block_until_ready()
            step_times.append(time.perf_counter() - t1)
    finally:
        if pbar is not None:
            pbar.close()
    text = model.decode(generated, skip_special_tokens=True)
    if out is not None:
        out.write(text[len(shown):] + "\n")
        out.flush()
    timed = step_times[1:]  # the first step compiles
    r: dict[str, Any] = {
        "text": text, "tokens": generated, "prompt_tokens": len(prompt_ids),
        "new_tokens": len(generated), "stop": stop, "prefill_s": prefill_s,
        "prefill_chunk": prefill_chunk or 0,
        "decode_steps_timed": len(timed),
        "decode_tokens_per_s": len(timed) / sum(timed) if timed else None,
        "cache_bytes_filled": int(cache.nbytes()),
    }
    r.update(caches.memory(spec, cfg, 1, max_len))
    r.update(caches.settings(spec))
    return r


def size_note(spec: CacheSpec, model: LoadedModel, r: dict[str, Any]) -> str | None:
    """Why a quantized cache can be larger than dense for a short sequence, or None.

    A realistic-protocol cache keeps the last ``recent`` (and first ``sinks``) tokens in
    full precision besides the codes of every position; below a break-even length that
    exact window costs more than it saves.
    """
    if spec.kind == "dense" or r["cache_bytes"] < r["dense_cache_bytes"]:
        return None
    cfg, n1 = model.config, r["cache_shape"]["max_len"]
    n2 = 2 * n1 + 256
    m2 = caches.memory(spec, cfg, 1, n2)
    saved_per_token = ((m2["dense_cache_bytes"] - r["dense_cache_bytes"])
                       - (m2["cache_bytes"] - r["cache_bytes"])) / (n2 - n1)
    exact = f"the last {spec.window} tokens" + (f" and first {spec.sinks}" if spec.sinks else "")
    msg = (f"  (the {spec.kind} cache is larger than dense here: besides the codes of all {n1} "
           f"positions it holds {exact} exact in {caches.dtype_name(spec)} (the exact window, "
           "--recent/--sinks)")
    if saved_per_token > 0:
        even = n1 + (r["cache_bytes"] - r["dense_cache_bytes"]) / saved_per_token
        msg += f"; it is smaller than dense from about {int(even) + 1} positions on"
    return msg + ")"

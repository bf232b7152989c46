"""Perplexity as MILLION's evaluation computes it.

Protocol (``evaluate``):
  * the whole text is tokenized once (no BOS unless asked for: then one BOS before it);
  * the first ``max_tokens`` tokens are cut into non-overlapping windows of ``window``
    tokens and a partial last window is dropped;
  * every window runs from an empty cache (prefill of the whole window through the
    cache under test, so every key/value the attention reads went through that cache);
  * every token but a window's first is a target: nll = mean over all targets of
    -log softmax(logits[t - 1])[token t], ppl = exp(nll).
  * a model whose tokenizer adds BOS (Gemma 3) gets one BOS at the start of every window, as
    llama.cpp's perplexity does: ``window - 1`` text tokens follow it, and the targets are the
    same as above (every text token but the window's first), so BOS only conditions. A model
    without (SmolLM2) is evaluated exactly as MILLION does.
Windows are batched (``batch`` at a time; a short last batch is padded with copies whose
results are discarded, so one compiled program serves every batch).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from million_app import caches
from million_jax.cache.spec import CacheSpec
from million_app.calibrate import windows
from million_app.errors import UsageError
from million_app.progress import bar
from models import LoadedModel, prefill


@functools.partial(jax.jit, static_argnums=(0,))
def window_nll(config: Any, params: Any, cache: Any, tokens: jax.Array, consts: Any) -> jax.Array:
    """-log p(token t | tokens < t) for t = 1..T-1 of each window: f32[B, T-1].

    tokens int32[B, T] run through ``cache`` (empty) in one prefill.
    """
    b, t = tokens.shape
    logits, _ = prefill(config, params, cache, tokens, jnp.full((b,), t, jnp.int32), consts)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def eval_windows(ids: Sequence[int], window: int, max_tokens: int | None) -> np.ndarray:
    """int32[n, window]: the protocol's windows; a UsageError when there is not one."""
    if window < 2:
        raise UsageError(f"--window must be >= 2 (a window's first token is no target), got {window}")
    if max_tokens is not None and max_tokens < window:
        raise UsageError(f"--max-tokens {max_tokens} is smaller than one --window of {window}")
    try:
        return windows(ids, window, max_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None


def evaluate(model: LoadedModel, ids: Sequence[int], spec: CacheSpec, *, window: int = 512,
             max_tokens: int | None = None, batch: int = 4, desc: str | None = None,
             window_bos: bool | None = None) -> dict:
    """Perplexity of ``model`` over ``ids`` through the cache ``spec`` (module docstring).

    Returns a JSON-ready dict: ppl, nll, tokens (targets), windows, window, max_tokens,
    seconds, tokens_per_s, window_bos, the memory accounting of ``caches.memory`` for one window
    (batch 1) and the cache settings. ``window_bos``: one BOS at the start of every window
    (default: where the model's tokenizer adds BOS, ``LoadedModel.adds_bos``).
    """
    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    window_bos = model.adds_bos if window_bos is None else bool(window_bos)
    if window_bos:
        if window < 3:
            raise UsageError(f"--window must be >= 3 with a BOS per window, got {window}")
        text_w = eval_windows(ids, window - 1, None if max_tokens is None else max_tokens - max_tokens // window)
        w = np.concatenate([np.full((len(text_w), 1), model.config.bos_id, text_w.dtype), text_w], axis=1)
    else:
        w = eval_windows(ids, window, max_tokens)
    n = len(w)
    batch = min(batch, n)
    cfg, params = model.config, model.params
    total, count = 0.0, 0
    pbar = bar(n, desc or caches.label(spec), unit="window")
    t0 = time.perf_counter()
    try:
        for i in range(0, n, batch):
            chunk = w[i: i + batch]
            real = len(chunk)
            if real < batch:  # pad to the compiled batch size; padded rows are dropped
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
            cache, consts = caches.build(spec, cfg, batch, window)
            nll = np.asarray(window_nll(cfg, params, cache, jnp.asarray(chunk), consts),
                             np.float64)[:real, 1 if window_bos else 0:]
            if not np.isfinite(nll).all():
                raise FloatingPointError(f"{caches.label(spec)}: non-finite log-likelihood in window {i}")
            total += float(nll.sum())
            count += nll.size
            pbar.update(real)
    finally:
        pbar.close()
    seconds = time.perf_counter() - t0
    mean = total / count
    out = {
        "ppl": math.exp(mean),
        "nll": mean,
        "tokens": int(count),
        "windows": int(n),
        "window": int(window),
        "max_tokens": max_tokens,
        "batch": int(batch),
        "seconds": seconds,
        "tokens_per_s": n * window / seconds,
        "window_bos": window_bos,
    }
    out.update(caches.memory(spec, cfg, 1, window))
    out.update(caches.settings(spec))
    return out

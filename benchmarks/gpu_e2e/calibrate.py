"""Layer_head K/V codebooks fitted on a model's own post-RoPE K/V (random-token prompt)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.calibration.fit import collect_kv, fit_kv_codebooks
from million_jax.quant.pq import decode, encode
from models import prefill

from .caches import dense_prefix, make_cache, min_length
from .settings import Settings
from .state import ModelState


@functools.partial(jax.jit, static_argnames=("chunk",))
def _rel_mse(cb: Any, x: jax.Array, chunk: int) -> jax.Array:
    """||decode(encode(x)) - x||^2 / ||x||^2 (encode in small chunks: G * M problems run at once)."""
    xhat = decode(cb, encode(cb, x, chunk_size=chunk))
    return jnp.mean((xhat - x) ** 2) / jnp.mean(x**2)


def calibrate(s: Settings, m: ModelState, log: Callable[[str], None], dense: Any = None) -> None:
    """Fit ``m.codebooks`` (weights loaded) and add the calibration facts to ``m.info_row``.

    With ``dense`` (a cache filled by a real prefill) its first ``calib_tokens`` positions
    are used (causal: the same K/V as a prefill of just those tokens); otherwise a
    ``calib_tokens`` prompt is prefilled into a fresh DenseCache.
    """
    cfg = m.config
    n = s.calib_tokens
    t0 = time.perf_counter()
    if dense is not None and min_length(dense) >= n:
        src = "first tokens of a prefilled context"
        view = dense_prefix(dense, n)
    else:
        src = "dedicated prefill"
        empty = make_cache("bf16", cfg, 1, n, jnp.dtype(s.dtype))
        toks = jax.random.randint(jax.random.key(77 + m.seed), (1, n), 0, cfg.vocab, jnp.int32)
        _, view = prefill(cfg, m.params, empty, toks, jnp.full((1,), n, jnp.int32), last_only=True)
    k, v = collect_kv(view)
    del view
    t1 = time.perf_counter()
    books = fit_kv_codebooks(k, v, M=s.M, nbits=s.nbits, granularity="layer_head",
                             key=jax.random.key(5 + m.seed), max_vectors=max(n, 2**s.nbits),
                             iters=s.calib_iters, chunk_size=s.calib_chunk)
    books = jax.block_until_ready(books)
    t2 = time.perf_counter()
    # quality check on the calibration K/V themselves
    mse_k = float(_rel_mse(books.key, jnp.asarray(k), s.calib_chunk))
    mse_v = float(_rel_mse(books.value, jnp.asarray(v), s.calib_chunk))
    m.codebooks = books
    m.info_row.update(calib_source=src, calib_tokens=n, calib_iters=s.calib_iters,
                      calib_collect_seconds=t1 - t0, calib_kmeans_seconds=t2 - t1,
                      codebook_bytes=books.nbytes, calib_rel_mse_k=mse_k, calib_rel_mse_v=mse_v)
    log(f"{m.name}: codebooks ({src}) k-means {t2 - t1:.1f}s, collect {t1 - t0:.1f}s, "
        f"rel. MSE K {mse_k:.3f} V {mse_v:.3f}")

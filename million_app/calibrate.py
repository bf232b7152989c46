"""Run calibration text through a model and fit its K/V codebooks."""
from __future__ import annotations

import functools

import hashlib
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from million_app.errors import UsageError
from million_app.progress import counting
from million_app.query_sample import QueryRecordCache
from million_app.report import atomic_path, check_out_dir
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.cache.base import KVCache
from million_jax.cache.hybrid import HybridCache
from million_jax.cache.query_stats import QueryStatsCache
from million_jax.calibration.fit import DEFAULT_MAX_VECTORS, collect_kv, collect_query_gram, fit_kv_codebooks
from million_jax.quant.codebook_io import KEY_ROPE, CodebookFileError, load_kv_codebooks, save_kv_codebooks
from models import LoadedModel, fill_cache
from models.decoder import rope_inv_freq


def model_fingerprint(model: LoadedModel) -> str:
    """A short hash of the config and a slice of every weight: codebooks are tied to it.

    The config fields added for hybrid families (Gemma 3) are left out where a model is a plain
    LLaMA, so codebook files calibrated before they existed still match."""
    fields = dict(model.config.__dict__)
    c = model.config
    if c.family == "llama" and not any(c.is_sliding) and c.query_pre_attn_scalar == c.head_dim:
        for name in ("family", "layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar"):
            fields.pop(name)
    h = hashlib.sha256(json.dumps(fields, default=str, sort_keys=True).encode())
    for leaf in jax.tree.leaves(model.params):
        a = np.asarray(leaf).ravel()
        h.update(np.asarray(a[:: max(1, a.size // 64)][:64], np.float32).tobytes())
    return h.hexdigest()[:16]


# Keys quantized before RoPE (the default, "pre") do not depend on position: short windows serve
# every position (benchmarks/results/prerope_smollm2). Keys quantized after RoPE ("post",
# MILLION's choice) only serve the positions they were calibrated on, and the first tokens of a
# sequence (attention sinks) are outliers every query reads (position_error_smollm2): their
# default calibration runs half its tokens in short windows (many sequence starts) and half in
# windows as long as the model's context, within this cap (the forward is quadratic in the window).
DEFAULT_KEY_ROPE = "pre"
CALIBRATION_WINDOW_CAP = 8192
SHORT_CALIBRATION_WINDOW = 512


def default_calibration_windows(model: LoadedModel, tokens: int, key_rope: str = DEFAULT_KEY_ROPE) -> tuple[int, ...]:
    """The default calibration windows for ``tokens`` calibration tokens on hand: 512 (at most
    the model's context and the tokens) for pre-RoPE keys; for post-RoPE keys (512, the model's
    context capped at CALIBRATION_WINDOW_CAP and at tokens / 2), or one window length when the
    long one is not longer than 512."""
    context = min(model.config.max_position_embeddings, CALIBRATION_WINDOW_CAP)
    if key_rope == "pre":
        return (max(2, min(context, tokens, SHORT_CALIBRATION_WINDOW)),)
    long = max(2, min(context, tokens // 2))
    if long <= SHORT_CALIBRATION_WINDOW:
        return (max(2, min(context, tokens)),)
    return (SHORT_CALIBRATION_WINDOW, long)


def parse_windows(spec: str | int | Sequence[int], flag: str = "--window") -> tuple[int, ...]:
    """``"512,8192"`` / 512 / (512, 8192) -> a tuple of window lengths (UsageError if malformed)."""
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",")]
        except ValueError:
            raise UsageError(f"{flag} must be window lengths like 512 or 512,8192, got {spec!r}") from None
    out = (int(spec),) if isinstance(spec, (int, np.integer)) else tuple(int(x) for x in spec)
    if not out or any(w < 2 for w in out):
        raise UsageError(f"{flag} window lengths must be >= 2, got {spec!r}")
    return out


def windows(ids: Sequence[int], window: int, max_tokens: int | None = None) -> np.ndarray:
    """The first max_tokens ids cut into non-overlapping windows: int32[n, window] (partial dropped)."""
    ids = np.asarray(ids[:max_tokens] if max_tokens else ids, np.int32)
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {window}")
    return ids[: n * window].reshape(n, window)


def code_layers_cache(config, cache: KVCache) -> KVCache:
    """``cache`` (one layer per global layer) for the calibration forward: wrapped in a
    HybridCache with exact rings for a model with sliding layers, whose K/V no code reads."""
    if not any(config.is_sliding):
        return cache
    return HybridCache.create(cache, config.is_sliding, config.sliding_window, jnp.float32)


def global_part(cache: KVCache) -> KVCache:
    """The global layers' cache of a calibration forward (the cache itself without sliding layers)."""
    return cache.global_part if isinstance(cache, HybridCache) else cache


# Calibration windows longer than this are run as a chunked prefill (same result up to float
# rounding), so a long window reports progress as it goes instead of one step at the end.
FORWARD_CHUNK = 1024


def collect_model_kvq(model: LoadedModel, ids: Sequence[int], *, window: int = 512, batch: int = 4,
                      max_tokens: int | None = None, progress: Callable[[int, int], None] | None = None,
                      key_rope: str = "post"):
    """Keys / values float32[L, Hkv, N, d] of the model over ``ids``, and the sums of q q^T of the
    post-RoPE queries per KV head, float64[L, Hkv, d, d], with their counts [L, Hkv].
    ``progress(tokens done, tokens total)`` runs after each prefill call (windows over
    ``FORWARD_CHUNK`` tokens are prefilled in chunks of it).

    ``key_rope``: "post" keys as the model attends with them (after RoPE), "pre" keys before
    RoPE (un-rotated at their window positions, ``million_jax.calibration.fit.collect_kv``)."""
    c = model.config
    inv_freq = _key_rope_freqs(model, key_rope)
    w = windows(ids, window, max_tokens)
    ks, vs = [], []
    gram = np.zeros((c.n_global_layers, c.n_kv_heads, c.head_dim, c.head_dim))
    count = np.zeros((c.n_global_layers, c.n_kv_heads))
    total, done = w.size, 0
    for i in range(0, len(w), batch):
        rows = w[i : i + batch]
        cache = code_layers_cache(c, QueryStatsCache.create(c.n_global_layers, rows.shape[0], c.n_kv_heads, window,
                                                            c.head_dim))
        for s in range(0, window, FORWARD_CHUNK):  # chunked prefill: progress inside long windows
            part = jnp.asarray(rows[:, s : s + FORWARD_CHUNK])
            cache = fill_cache(c, model.params, cache, part, jnp.full((rows.shape[0],), part.shape[1], jnp.int32))
            done += part.size
            if progress:
                progress(done, total)
        stats = global_part(cache)
        k, v = collect_kv(stats, rope_inv_freq=inv_freq)
        g, n = collect_query_gram(stats)
        ks.append(k)
        vs.append(v)
        gram += g
        count += n
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2), gram, count


def _key_rope_freqs(model: LoadedModel, key_rope: str) -> np.ndarray | None:
    """The model's RoPE frequencies when keys are wanted before RoPE (None: after RoPE)."""
    if key_rope not in KEY_ROPE:
        raise UsageError(f"--rope must be one of {', '.join(KEY_ROPE)}, got {key_rope!r}")
    return rope_inv_freq(model.config) if key_rope == "pre" else None


def collect_model_kv(model: LoadedModel, ids: Sequence[int], *, window: int = 512, batch: int = 4,
                     max_tokens: int | None = None, progress: Callable[[int, int], None] | None = None,
                     key_rope: str = "post"):
    """Keys/values of the model over ``ids``: float32[L, Hkv, N, d] each (``key_rope`` as
    :func:`collect_model_kvq`)."""
    k, v, _, _ = collect_model_kvq(model, ids, window=window, batch=batch, max_tokens=max_tokens,
                                   progress=progress, key_rope=key_rope)
    return k, v


def calibrate_model(model: LoadedModel, ids: Sequence[int], *, M: int, nbits: int,
                    granularity: str = "layer_head", key: jax.Array, window: int = 512,
                    batch: int = 4, max_tokens: int | None = None,
                    max_vectors: int = DEFAULT_MAX_VECTORS, iters: int = 25,
                    progress: Callable[[int, int], None] | None = None) -> PQCodebooks:
    """Codebooks for ``model`` fitted on the K/V it produces over ``ids``."""
    k, v = collect_model_kv(model, ids, window=window, batch=batch, max_tokens=max_tokens, progress=progress)
    return fit_kv_codebooks(k, v, M=M, nbits=nbits, granularity=granularity, key=key,
                            max_vectors=max_vectors, iters=iters)


# ---------------------------------------------------------------------------- files
def codebook_metadata(model: LoadedModel, books: PQCodebooks, *, calib_windows: Sequence[int] | None = None,
                      **extra) -> dict:
    """What a codebook file records: the model it belongs to, its shapes, how it was made.

    ``calib_windows``: the calibration window lengths; recorded as ``calib_windows`` and their
    longest as ``calib_window`` (what the long-sequence warning compares against)."""
    c = model.config
    meta = {
        "model_fingerprint": model_fingerprint(model),
        "model_source": os.path.basename(os.path.normpath(model.source)),
        "n_layers": c.n_global_layers,
        "global_layers": list(c.global_layers),
        "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "M": books.key_M,
        "nbits": books.key_nbits,
        "key_M": books.key_M,
        "key_nbits": books.key_nbits,
        "value_M": books.value_M,
        "value_nbits": books.value_nbits,
        "query_aware_keys": books.key_transform is not None,
        "output_aware_values": books.value_transform is not None,
        "granularity": books.granularity,
        "bits_per_element": books.bits_per_element,
    }
    if calib_windows is not None:
        meta.update(calib_window=max(calib_windows), calib_windows=list(calib_windows))
    meta.update(extra)
    return meta


def save_model_codebooks(path: str, books: PQCodebooks, meta: dict, flag: str = "--out", *,
                         force: bool = False, doing: str = "calibrating") -> None:
    """Write key/value codebooks and their metadata (see :func:`codebook_metadata`).

    Atomic: a failure or Ctrl-C leaves no partial file and an existing ``path`` as it was.
    Without ``force`` an existing ``path`` (also one that appeared while ``doing``) is never
    replaced: UsageError instead (:func:`million_app.report.atomic_path`).
    """
    check_out_dir(path, flag)
    with atomic_path(path, flag, force=force, doing=doing) as tmp:
        save_kv_codebooks(tmp, books, meta, atomic=False)


def load_model_codebooks(path: str, model: LoadedModel) -> tuple[PQCodebooks, dict]:
    """Codebooks from ``path``, checked against ``model``; any mismatch is one UsageError line."""
    c = model.config
    # Shapes first (their message is the most telling), then the exact model.
    expect = {"n_layers": c.n_global_layers, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
              "model_fingerprint": model_fingerprint(model)}
    try:
        books, meta = load_kv_codebooks(path, expect=expect)
    except CodebookFileError as e:
        if "does not match expected" not in str(e):
            raise UsageError(str(e)) from None
        user = _user_metadata(path)
        missing = [k for k in expect if k not in user]
        if missing:
            raise UsageError(f"{path}: K/V codebooks saved without the model metadata `million-jax calibrate` "
                             f"records (no {', '.join(missing)}), so they cannot be checked against "
                             f"{model.source}; calibrate with `million-jax calibrate --model {model.source}`"
                             ) from None
        raise UsageError(f"{e} (these codebooks were calibrated for {meta_source(path)}; run "
                         "`million-jax calibrate` with this model)") from None
    try:
        books.check(c.n_global_layers, c.n_kv_heads, c.head_dim)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    try:
        books.check_rope(rope_inv_freq(c))
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    return books, meta


def _user_metadata(path: str) -> dict:
    """The user metadata of a codebook file ({} if unreadable; only used to word errors)."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            user = json.loads((f.metadata() or {}).get("million_jax", "{}")).get("user", {})
        return user if isinstance(user, dict) else {}
    except Exception:  # noqa: BLE001 - only used to word an error message
        return {}


def meta_source(path: str) -> str:
    """The model a codebook file says it belongs to (best effort, for error messages)."""
    user = _user_metadata(path)
    name = user.get("model_source")
    fp = user.get("model_fingerprint")
    if name is None and fp is None:
        return "a model the file does not name"
    return (f"model {name}" if name is not None else "an unnamed model") + (f" (fingerprint {fp})" if fp else "")


# ---------------------------------------------------------------------------- pipeline
def calibration_kv(model: LoadedModel, ids: Sequence[int], *, tokens: int, window: int,
                   batch: int = 4, key_rope: str = "post") -> tuple[np.ndarray, np.ndarray, int]:
    """(keys, values, tokens used): K/V of the first ``tokens`` ids, in windows."""
    k, v, _, _, used = calibration_kvq(model, ids, tokens=tokens, window=window, batch=batch, key_rope=key_rope)
    return k, v, used


def calibration_kvq(model: LoadedModel, ids: Sequence[int], *, tokens: int, window: int | Sequence[int],
                    batch: int = 4, key_rope: str = "post") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(keys, values, query Gram sums, query counts, tokens used) of the first ``tokens`` ids
    (see :func:`collect_model_kvq`; ``key_rope`` "pre": keys before RoPE).

    ``window``: one length, or several (e.g. (512, 8192)): the tokens are then split into
    equal consecutive parts, part i cut into windows of length window[i], and the samples of
    all parts pooled (K/V concatenated along N, query sums added)."""
    lengths = parse_windows(window)
    if len(lengths) == 1:
        return _windowed_forward(ids, tokens, lengths[0], "calibration forward", functools.partial(
            collect_model_kvq, model, ids, window=lengths[0], batch=batch, key_rope=key_rope))
    share = min(tokens, len(ids)) // len(lengths)
    parts = []
    for i, w in enumerate(lengths):
        part = ids[i * share:(i + 1) * share]
        parts.append(_windowed_forward(part, share, w, "calibration forward", functools.partial(
            collect_model_kvq, model, part, window=w, batch=batch, key_rope=key_rope)))
    k, v, gram, count, used = zip(*parts)
    return (np.concatenate(k, axis=2), np.concatenate(v, axis=2), sum(gram), sum(count), sum(used))


def _windowed_forward(ids: Sequence[int], tokens: int, window: int, label: str, collect: Callable) -> tuple:
    """``(*collect(max_tokens=..., progress=...), tokens used)`` over the first ``tokens`` ids in
    whole windows, with a progress bar; UsageError for a bad window or too little text."""
    if window < 2:
        raise UsageError(f"--window must be >= 2, got {window}")
    use = min(tokens, len(ids))
    n_win = use // window
    if n_win == 0:
        raise UsageError(f"calibration text gives {use} tokens, fewer than one window of {window}"
                         " (use more text or a smaller --window)")
    with counting(f"{label} ({n_win} window{'s' if n_win > 1 else ''} of {window})", "token") as report:
        out = collect(max_tokens=use, progress=report)
    return (*out, n_win * window)


def collect_model_kvq_samples(model: LoadedModel, ids: Sequence[int], *, window: int = 512, batch: int = 4,
                              max_tokens: int | None = None, queries_per_window: int = 64, seed: int = 0,
                              progress: Callable[[int, int], None] | None = None):
    """As :func:`collect_model_kvq`, plus a sample of the raw post-RoPE queries.

    Returns (k, v, q_gram, q_count, q, q_pos): k / v float32[L, Hkv, N, d], N = W * window
    tokens in W windows; q_gram / q_count as collect_model_kvq; q float32[L, Hkv, G, W * S, d]
    the queries of S = ``queries_per_window`` positions per window, drawn uniformly without
    replacement per window (``seed``), grouped by the KV head their query head reads (query
    head h = kv * G + g, as the model groups them); q_pos int32[W * S] their token index in
    [0, N), window by window (what :mod:`million_jax.calibration.finetune` takes).
    """
    c = model.config
    if not 1 <= queries_per_window <= window:
        raise UsageError(f"queries per window must be in [1, {window}], got {queries_per_window}")
    w = windows(ids, window, max_tokens)
    rng = np.random.default_rng(seed)
    g = c.n_heads // c.n_kv_heads
    ks, vs, qs, pos = [], [], [], []
    gram = np.zeros((c.n_global_layers, c.n_kv_heads, c.head_dim, c.head_dim))
    count = np.zeros((c.n_global_layers, c.n_kv_heads))
    for i in range(0, len(w), batch):
        chunk = jnp.asarray(w[i : i + batch])
        cache = code_layers_cache(c, QueryRecordCache.create(c.n_global_layers, chunk.shape[0], c.n_heads,
                                                             c.n_kv_heads, window, c.head_dim))
        lengths = jnp.full((chunk.shape[0],), window, jnp.int32)
        cache = global_part(fill_cache(c, model.params, cache, chunk, lengths))
        k, v = collect_kv(cache.stats_cache())
        gq, n = collect_query_gram(cache.stats_cache())
        ks.append(k)
        vs.append(v)
        gram += gq
        count += n
        q = np.swapaxes(np.asarray(cache.layers.q), 2, 3)  # [L, B, window, H, d]
        for b in range(chunk.shape[0]):
            p = np.sort(rng.choice(window, size=queries_per_window, replace=False))
            qb = q[:, b, p]  # [L, S, H, d]
            qs.append(qb.reshape(c.n_global_layers, queries_per_window, c.n_kv_heads, g, c.head_dim)
                      .transpose(0, 2, 3, 1, 4))
            pos.append((i + b) * window + p)
        if progress:
            progress(min(i + batch, len(w)) * window, w.size)
    q = np.concatenate(qs, axis=3).astype(np.float32)
    return (np.concatenate(ks, axis=2), np.concatenate(vs, axis=2), gram, count, q,
            np.concatenate(pos).astype(np.int32))


def calibration_kvq_samples(model: LoadedModel, ids: Sequence[int], *, tokens: int, window: int,
                            batch: int = 4, queries_per_window: int = 64, seed: int = 0):
    """(keys, values, query Gram sums, query counts, queries, query positions, tokens used) of the
    first ``tokens`` ids with a progress bar (see :func:`collect_model_kvq_samples`)."""
    return _windowed_forward(ids, tokens, window, "calibration forward (with queries)", functools.partial(
        collect_model_kvq_samples, model, ids, window=window, batch=batch, queries_per_window=queries_per_window,
        seed=seed))


def fit_model_codebooks(k: np.ndarray, v: np.ndarray, *, M: int, nbits: int, granularity: str,
                        seed: int = 0, iters: int = 25, max_vectors: int = DEFAULT_MAX_VECTORS,
                        rope_inv_freq: np.ndarray | None = None) -> PQCodebooks:
    """``fit_kv_codebooks`` with a progress bar (one step per jitted fit; Ctrl-C stops in
    between) and settings errors as UsageErrors."""
    try:
        with counting("k-means", "fit") as report:
            return fit_kv_codebooks(k, v, M=M, nbits=nbits, granularity=granularity,
                                    key=jax.random.PRNGKey(seed), max_vectors=max_vectors, iters=iters,
                                    progress=report, rope_inv_freq=rope_inv_freq)
    except ValueError as e:
        raise UsageError(str(e)) from None


def kmeans_problem_summary(shape: tuple[int, ...], M: int, nbits: int, granularity: str,
                           max_vectors: int) -> str:
    """One line describing the k-means work: problems, vectors each, centroids."""
    L, hkv, n, _ = shape
    groups, pool = {"shared": (1, L * hkv * n), "layer": (L, hkv * n),
                    "layer_head": (L * hkv, n)}[granularity]
    return (f"2 x {groups * M} k-means problems (K and V; {groups} codebook groups x M={M}), "
            f"{min(pool, max_vectors)} vectors each, K={2 ** nbits} centroids")

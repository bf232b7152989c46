"""Run calibration text through a model and fit its K/V codebooks."""
from __future__ import annotations

import hashlib
import json
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.cache.pq_cache import PQCodebooks
from million_jax.calibration import DEFAULT_MAX_VECTORS, collect_kv, fit_kv_codebooks
from models import LoadedModel, init_cache, prefill


def model_fingerprint(model: LoadedModel) -> str:
    """A short hash of the config and a slice of every weight: codebooks are tied to it."""
    h = hashlib.sha256(json.dumps(model.config.__dict__, default=str, sort_keys=True).encode())
    for leaf in jax.tree.leaves(model.params):
        a = np.asarray(leaf).ravel()
        h.update(np.asarray(a[:: max(1, a.size // 64)][:64], np.float32).tobytes())
    return h.hexdigest()[:16]


def windows(ids: Sequence[int], window: int, max_tokens: int | None = None) -> np.ndarray:
    """The first max_tokens ids cut into non-overlapping windows: int32[n, window] (partial dropped)."""
    ids = np.asarray(ids[:max_tokens] if max_tokens else ids, np.int32)
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {window}")
    return ids[: n * window].reshape(n, window)


def collect_model_kv(model: LoadedModel, ids: Sequence[int], *, window: int = 512, batch: int = 4,
                     max_tokens: int | None = None, progress: Callable[[int, int], None] | None = None):
    """Post-RoPE keys/values of the model over ``ids``: float32[L, Hkv, N, d] each."""
    w = windows(ids, window, max_tokens)
    ks, vs = [], []
    for i in range(0, len(w), batch):
        chunk = jnp.asarray(w[i : i + batch])
        cache = init_cache(model.config, chunk.shape[0], window, jnp.float32)
        lengths = jnp.full((chunk.shape[0],), window, jnp.int32)
        _, cache = prefill(model.config, model.params, cache, chunk, lengths, last_only=True)
        k, v = collect_kv(cache)
        ks.append(k)
        vs.append(v)
        if progress:
            progress(min(i + batch, len(w)), len(w))
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)


def calibrate_model(model: LoadedModel, ids: Sequence[int], *, M: int, nbits: int,
                    granularity: str = "layer_head", key: jax.Array, window: int = 512,
                    batch: int = 4, max_tokens: int | None = None,
                    max_vectors: int = DEFAULT_MAX_VECTORS, iters: int = 25,
                    progress: Callable[[int, int], None] | None = None) -> PQCodebooks:
    """Codebooks for ``model`` fitted on the K/V it produces over ``ids``."""
    k, v = collect_model_kv(model, ids, window=window, batch=batch, max_tokens=max_tokens, progress=progress)
    return fit_kv_codebooks(k, v, M=M, nbits=nbits, granularity=granularity, key=key,
                            max_vectors=max_vectors, iters=iters)

"""Codebook fine-tuning: Adam (optax) on the PQ centroids against the attention-output error.

k-means fits keys and values one vector at a time (``||x - x_hat||^2``). Attention cares about
something else: the output ``softmax(q k^T / sqrt d) v`` of every query. Starting from the
k-means codebooks of one layer, :func:`finetune_layer` runs Adam on the key AND value centroids
of all KV heads at once (the per-head loss is vmapped over heads, the whole loop is one jitted
``lax.scan``) to minimise, per KV head h,

    err_h = sum_q || o_hat(q) - o(q) ||^2 / sum_q || o(q) ||^2
    o(q)     = softmax(q k^T / sqrt d) v            over q's causal context (exact keys/values)
    o_hat(q) = softmax(q k_hat^T / sqrt d) v_hat    the same context read from codes

summed over the G query heads of the KV head and the calibration queries. This is the
relative error of what the cache hands to the output projection; it is also what
:func:`attention_output_error` reports.

Data of one layer (post-RoPE queries and keys, as the cache sees them):

    q:      float[Hkv, G, Nq, d]   calibration queries, grouped by the KV head they read
    k, v:   float[Hkv, N, d]       keys / values of N = W * window tokens: W windows, each an
                                   independent sequence whose first token sat at position 0
    q_pos:  int[Nq]                token index in [0, N) of each query. The queries come
                                   window by window, S = Nq / W per window (query i belongs
                                   to window i // S): query i attends keys
                                   ``window_start .. q_pos[i]`` of its own window.

Why whole windows: every query sees exactly the context the model gave it at calibration time
(the same causal prefix, the attention-sink first tokens included). A random subset of keys
would change the softmax normalisation and the loss would no longer be the error the cache
makes. Each Adam step draws ``windows_per_step`` windows uniformly without replacement and
uses all their queries (a stochastic minibatch over contexts).

Codes. The cache encodes each key / value by its nearest centroid (``pq.encode``). The
fine-tuning either keeps the codes of the starting k-means codebooks (``reassign_every=0``,
the gradient moves each centroid to serve the vectors that k-means gave it) or re-encodes all
calibration keys / values with the current centroids every ``reassign_every`` steps, so
training sees the codes the cache will store. The error is always *reported* with
nearest-centroid codes (what the cache stores), never with the training codes.

``keep_best``: per KV head, the fine-tuned centroids replace the k-means ones only where their
error (nearest codes, all calibration queries) is lower; a head that did not improve keeps
its k-means codebooks. The per-head errors before and after are returned either way.

Parameters are optimised in units of the per-codebook RMS of the (transformed) keys / values,
so one learning rate fits models whose keys are large or small.

Transforms (:mod:`million_jax.quant.kv_transforms`): with a key transform A the codebooks live in
the A-space: keys are encoded as A k and the query becomes A^-T q; with a value transform B
values are encoded as B v and the output of the code attention is mapped back by B^-1. Pass
the four per-layer transforms as :class:`LayerTransforms` (``[Gt, d, d]``, Gt = 1 or Hkv); the
loss is then the same as the cache's (scores ``(A^-T q) . c_k``, output ``B^-1 sum p c_v``).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from million_jax.quant.pq import Codebooks, encode
from million_jax.quant.kv_codebooks import PQCodebooks
from pallas_kernels.pq_math import gather_centroids

__all__ = ["FinetuneSettings", "LayerTransforms", "LayerFinetune", "finetune_layer", "attention_output_error",
           "finetune_codebooks", "check_layer_data"]


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """How :func:`finetune_layer` runs.

    steps:            Adam steps per layer (0: nothing is changed)
    learning_rate:    Adam step size, in units of the RMS of the codebook's (transformed) vectors
    windows_per_step: calibration windows in each step's minibatch (all their queries)
    reassign_every:   0 keeps the k-means codes; n > 0 re-encodes (nearest centroid) every n steps
    keep_best:        per KV head, keep the k-means centroids unless fine-tuning lowered the error
    tune_keys, tune_values: which centroids move
    """

    steps: int = 100
    learning_rate: float = 1e-3
    windows_per_step: int = 4
    reassign_every: int = 0
    keep_best: bool = True
    tune_keys: bool = True
    tune_values: bool = True

    def __post_init__(self) -> None:
        self.check()  # bad settings are refused when made, not at the first fine-tuning step

    def check(self) -> "FinetuneSettings":
        if not isinstance(self.steps, (int, np.integer)) or self.steps < 0:
            raise ValueError(f"finetune: steps must be an int >= 0, got {self.steps!r}")
        if not (isinstance(self.learning_rate, (int, float)) and np.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ValueError(f"finetune: learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        if not isinstance(self.windows_per_step, (int, np.integer)) or self.windows_per_step < 1:
            raise ValueError(f"finetune: windows_per_step must be an int >= 1, got {self.windows_per_step!r}")
        if not isinstance(self.reassign_every, (int, np.integer)) or self.reassign_every < 0:
            raise ValueError(f"finetune: reassign_every must be an int >= 0, got {self.reassign_every!r}")
        if not (self.tune_keys or self.tune_values):
            raise ValueError("finetune: tune_keys and tune_values are both False: nothing to tune")
        return self


class LayerTransforms(NamedTuple):
    """One layer's key / value transforms, each None or float32[Gt, d, d] (Gt = 1 or Hkv).

    key: A (keys encoded as A k); query: A^-T (applied to queries); value: B (values encoded
    as B v); output: B^-1 (applied to the code attention's output). See PQCodebooks.
    """

    key: jax.Array | None = None
    query: jax.Array | None = None
    value: jax.Array | None = None
    output: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LayerFinetune:
    """Result of :func:`finetune_layer`.

    key_centroids, value_centroids: float32[Gc, M, K, dsub] (the input shapes)
    error_before, error_after: float[Hkv] relative attention-output error per KV head on the
        calibration data, nearest-centroid codes, before and after (after = what is returned)
    tuned_error: float[Hkv] the fine-tuned centroids' error (= error_after where kept)
    kept: bool[Gc] per codebook group: whether the fine-tuned centroids were kept (else k-means)
    loss_history: float[steps] training loss (mean over heads) of each step's minibatch
    seconds: wall time of the fit (compile included)
    """

    key_centroids: np.ndarray
    value_centroids: np.ndarray
    error_before: np.ndarray
    error_after: np.ndarray
    tuned_error: np.ndarray
    kept: np.ndarray
    loss_history: np.ndarray
    seconds: float


# ---------------------------------------------------------------------------- checks
def _floating(name: str, a) -> np.ndarray | jax.Array:
    if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"finetune: {name} must be a floating-point array, got "
                         f"{getattr(a, 'dtype', type(a).__name__)}")
    return a


def _finite(name: str, a) -> None:
    if not isinstance(a, jax.core.Tracer) and not np.isfinite(np.asarray(a)).all():
        bad = int((~np.isfinite(np.asarray(a))).sum())
        raise ValueError(f"finetune: {name} contains {bad} NaN/Inf values")


def check_layer_data(key_centroids, value_centroids, q, k, v, q_pos, window: int,
                     transforms: LayerTransforms | None = None) -> tuple[int, int]:
    """ValueError with a clear message unless the arrays fit one another (module docstring).

    Returns (W windows, S queries per window).
    """
    for name, a in (("key_centroids", key_centroids), ("value_centroids", value_centroids), ("q", q),
                    ("k", k), ("v", v)):
        _floating(name, a)
    if q.ndim != 4:
        raise ValueError(f"finetune: q must be float[Hkv, G, Nq, d], got shape {tuple(q.shape)}")
    if k.ndim != 3 or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"finetune: k and v must both be float[Hkv, N, d], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    hkv, _, nq, d = q.shape
    if k.shape[0] != hkv or k.shape[2] != d:
        raise ValueError(f"finetune: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on Hkv or d "
                         "(q float[Hkv, G, Nq, d], k float[Hkv, N, d])")
    n = k.shape[1]
    if n == 0 or nq == 0:
        raise ValueError(f"finetune: empty calibration data ({n} tokens, {nq} queries)")
    if not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"finetune: window must be an int >= 1, got {window!r}")
    if n % window:
        raise ValueError(f"finetune: N={n} tokens is not a whole number of windows of {window}")
    w = n // window
    if nq % w:
        raise ValueError(f"finetune: Nq={nq} queries do not split evenly over the {w} windows "
                         "(the same number of queries per window, window by window)")
    s = nq // w
    q_pos = np.asarray(q_pos)
    if q_pos.shape != (nq,) or not np.issubdtype(q_pos.dtype, np.integer):
        raise ValueError(f"finetune: q_pos must be int[Nq={nq}], got {q_pos.dtype}{list(q_pos.shape)}")
    if q_pos.min() < 0 or q_pos.max() >= n:
        raise ValueError(f"finetune: q_pos must lie in [0, N={n}), got [{q_pos.min()}, {q_pos.max()}]")
    if not (q_pos // window == np.repeat(np.arange(w), s)).all():
        raise ValueError(f"finetune: q_pos must list S={s} queries of window 0, then of window 1, ... "
                         f"(query i in window i // S, windows of {window} tokens)")
    for name, c, kind in (("key_centroids", key_centroids, "key"), ("value_centroids", value_centroids, "value")):
        try:
            Codebooks(c).validate()
        except ValueError as e:
            raise ValueError(f"finetune: {name}: {e}") from None
        if c.ndim != 4 or c.shape[0] not in (1, hkv):
            raise ValueError(f"finetune: {name} must be float[Gc, M, K, dsub] with Gc = 1 or Hkv={hkv}, "
                             f"got shape {tuple(c.shape)}")
        if c.shape[0] != key_centroids.shape[0]:
            raise ValueError(f"finetune: key and value centroids must have the same group axis Gc, got "
                             f"{tuple(key_centroids.shape)} and {tuple(value_centroids.shape)}")
        if c.shape[1] * c.shape[3] != d:
            raise ValueError(f"finetune: {name} {tuple(c.shape)} are for head_dim {c.shape[1] * c.shape[3]}, "
                             f"the data has d={d}")
    t = transforms or LayerTransforms()
    if (t.key is None) != (t.query is None) or (t.value is None) != (t.output is None):
        raise ValueError("finetune: a key transform needs its query transform (A^-T) and a value transform "
                         "its output transform (B^-1); give both of a pair or neither")
    for name, a in zip(LayerTransforms._fields, t):
        if a is None:
            continue
        _floating(f"{name} transform", a)
        if a.ndim != 3 or a.shape[0] not in (1, hkv) or tuple(a.shape[1:]) != (d, d):
            raise ValueError(f"finetune: {name} transform must be float[Gt, d, d] with Gt = 1 or Hkv={hkv}, "
                             f"got shape {tuple(a.shape)}")
        _finite(f"{name} transform", a)
    for name, a in (("key_centroids", key_centroids), ("value_centroids", value_centroids), ("q", q),
                    ("k", k), ("v", v)):
        _finite(name, a)
    return w, s


# ---------------------------------------------------------------------------- math
def _per_head(t: jax.Array | None, hkv: int) -> jax.Array | None:
    return None if t is None else jnp.broadcast_to(jnp.asarray(t, jnp.float32), (hkv,) + tuple(t.shape[1:]))


def _map(t: jax.Array | None, x: jax.Array) -> jax.Array:
    """x float[Hkv, ..., d] mapped by t float[Hkv, d, d] per head (None: unchanged)."""
    if t is None:
        return x
    return jnp.einsum("hij,h...j->h...i", t, x, precision=jax.lax.Precision.HIGHEST)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, scale: float) -> jax.Array:
    """Causal attention inside windows (one KV head).

    q: float[G, W, S, d]; k, v: float[W, T, d]; pos: int[W, S] position of each query in its
    window (it attends keys 0..pos). Returns float32[G, W, S, d].
    """
    s = jnp.einsum("gwsd,wtd->gwst", q, k) * scale
    t = k.shape[1]
    mask = jnp.arange(t)[None, None, :] <= pos[:, :, None]  # [W, S, T]
    s = jnp.where(mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("gwst,wtd->gwsd", p, v)


def _encode_all(centroids: jax.Array, x: jax.Array) -> jax.Array:
    """Nearest-centroid codes (as the cache encodes): centroids [Gc, M, K, dsub], x [Hkv, N, d]
    -> int32[Hkv, N, M]."""
    return encode(Codebooks(centroids), x).astype(jnp.int32)


class _Data(NamedTuple):
    qt: jax.Array  # float32[Hkv, G, W, S, d] queries in the key codebook's space
    kt: jax.Array  # float32[Hkv, W, T, d] keys in the key codebook's space
    vt: jax.Array  # float32[Hkv, W, T, d] values in the value codebook's space
    out: jax.Array  # float32[Hkv, G, W, S, d] exact attention outputs
    out_sq: jax.Array  # float32[Hkv] sum over queries of ||out||^2
    pos: jax.Array  # int32[W, S]
    to: jax.Array | None  # float32[Hkv, d, d] output transform or None


def _prepare(q, k, v, pos, transforms: LayerTransforms, w: int, s: int) -> _Data:
    hkv, g, _, d = q.shape
    t = k.shape[1] // w
    q = q.astype(jnp.float32).reshape(hkv, g, w, s, d)
    k = k.astype(jnp.float32).reshape(hkv, w, t, d)
    v = v.astype(jnp.float32).reshape(hkv, w, t, d)
    scale = 1.0 / float(np.sqrt(d))
    out = jax.vmap(lambda a, b, c: _attention(a, b, c, pos, scale))(q, k, v)
    out_sq = jnp.maximum(jnp.sum(out * out, axis=(1, 2, 3, 4)), jnp.finfo(jnp.float32).tiny)
    qt = _map(_per_head(transforms.query, hkv), q)
    kt = _map(_per_head(transforms.key, hkv), k)
    vt = _map(_per_head(transforms.value, hkv), v)
    return _Data(qt, kt, vt, out, out_sq, pos, _per_head(transforms.output, hkv))


def _head_errors(ck, cv, kcodes, vcodes, data: _Data, windows: jax.Array | None = None) -> jax.Array:
    """Sum of ||o_hat - o||^2 / sum ||o||^2 (over all windows) per head: float32[Hkv].

    ck / cv: [Gc, M, K, dsub]; kcodes / vcodes: int[Hkv, W, T, M]. ``windows`` (int[nw]) restricts
    the sum to those windows and rescales it by W / nw (an unbiased minibatch estimate).
    """
    hkv = data.kt.shape[0]
    d = data.kt.shape[-1]
    scale = 1.0 / float(np.sqrt(d))
    qt, out, pos = data.qt, data.out, data.pos
    n_win = pos.shape[0]
    if windows is not None:
        qt, out, pos = qt[:, :, windows], out[:, :, windows], pos[windows]
        kcodes, vcodes = kcodes[:, windows], vcodes[:, windows]
    ck_axis = 0 if ck.shape[0] == hkv and hkv > 1 else None
    cv_axis = 0 if cv.shape[0] == hkv and hkv > 1 else None
    ck = ck if ck_axis == 0 else ck[0]
    cv = cv if cv_axis == 0 else cv[0]

    def one(ck_h, cv_h, kc, vc, q_h, o_h, to_h):
        k_hat = gather_centroids(ck_h, kc)  # [W', T, d]
        v_hat = gather_centroids(cv_h, vc)
        o_hat = _attention(q_h, k_hat, v_hat, pos, scale)
        if to_h is not None:
            o_hat = jnp.einsum("ij,gwsj->gwsi", to_h, o_hat, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum((o_hat - o_h) ** 2)

    to_axis = None if data.to is None else 0
    err = jax.vmap(one, in_axes=(ck_axis, cv_axis, 0, 0, 0, 0, to_axis))(ck, cv, kcodes, vcodes, qt, out, data.to)
    if windows is not None:
        err = err * (n_win / windows.shape[0])
    return err / data.out_sq


def _codes(ck, cv, data: _Data) -> tuple[jax.Array, jax.Array]:
    hkv, w, t, d = data.kt.shape
    kc = _encode_all(ck, data.kt.reshape(hkv, w * t, d)).reshape(hkv, w, t, -1)
    vc = _encode_all(cv, data.vt.reshape(hkv, w * t, d)).reshape(hkv, w, t, -1)
    return kc, vc


def _rms(x: jax.Array, groups: int) -> jax.Array:
    """RMS of x float[Hkv, W, T, d] per codebook group (Gc = 1: over all heads) -> [Gc, 1, 1, 1]."""
    r = jnp.sqrt(jnp.mean(x * x, axis=(1, 2, 3)))
    if groups == 1:
        r = jnp.sqrt(jnp.mean(r * r))[None]
    return jnp.maximum(r, jnp.finfo(jnp.float32).tiny)[:, None, None, None]


@functools.partial(jax.jit, static_argnames=("w", "s", "settings"))
def _finetune(ck0, cv0, q, k, v, pos, transforms: LayerTransforms, rng, *, w: int, s: int,
              settings: FinetuneSettings):
    data = _prepare(q, k, v, pos, transforms, w, s)
    sk = _rms(data.kt, ck0.shape[0])
    sv = _rms(data.vt, cv0.shape[0])
    kc0, vc0 = _codes(ck0, cv0, data)
    err0 = _head_errors(ck0, cv0, kc0, vc0, data)
    params = {"k": ck0 / sk, "v": cv0 / sv}
    tx = optax.adam(settings.learning_rate)
    if not (settings.tune_keys and settings.tune_values):
        frozen = "v" if settings.tune_keys else "k"
        tx = optax.multi_transform({"adam": tx, "frozen": optax.set_to_zero()},
                                   {"k": "adam" if frozen == "v" else "frozen",
                                    "v": "adam" if frozen == "k" else "frozen"})
    opt = tx.init(params)
    nw = min(settings.windows_per_step, w)
    hkv = q.shape[0]

    def loss_fn(p, kc, vc, windows):
        return jnp.sum(_head_errors(p["k"] * sk, p["v"] * sv, kc, vc, data, windows)) / hkv

    def step(carry, i):
        p, opt, kc, vc = carry
        if settings.reassign_every:
            kc, vc = jax.lax.cond((i > 0) & (i % settings.reassign_every == 0),
                                  lambda: _codes(p["k"] * sk, p["v"] * sv, data), lambda: (kc, vc))
        windows = jax.random.permutation(jax.random.fold_in(rng, i), w)[:nw]
        loss, grads = jax.value_and_grad(loss_fn)(p, kc, vc, windows)
        updates, opt = tx.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt, kc, vc), loss

    (p, _, _, _), history = jax.lax.scan(step, (params, opt, kc0, vc0), jnp.arange(settings.steps))
    ck1, cv1 = p["k"] * sk, p["v"] * sv
    kc1, vc1 = _codes(ck1, cv1, data)
    err1 = _head_errors(ck1, cv1, kc1, vc1, data)
    return ck1, cv1, err0, err1, history


def _group_errors(err: np.ndarray, groups: int) -> np.ndarray:
    """Per-head errors float[Hkv] -> per codebook group [Gc] (shared codebook: the mean)."""
    return err if groups == err.shape[0] else np.mean(err, keepdims=True)


def finetune_layer(key_centroids, value_centroids, q, k, v, q_pos, *, window: int,
                   settings: FinetuneSettings = FinetuneSettings(), key: jax.Array,
                   transforms: LayerTransforms | None = None) -> LayerFinetune:
    """Fine-tune one layer's key / value centroids on its calibration (q, k, v) (module docstring).

    key_centroids: float[Gc, M, K, dsub], value_centroids: float[Gc, Mv, Kv, dsubv] with
    Gc = Hkv (per-head codebooks) or 1 (one codebook for the layer's heads); q float[Hkv, G, Nq, d];
    k, v float[Hkv, N, d]; q_pos int[Nq]; window: tokens per calibration window; key: PRNG key
    (the windows drawn per step; the same key gives the same result). Returns a LayerFinetune.
    """
    settings = settings.check()
    transforms = transforms or LayerTransforms()
    w, s = check_layer_data(key_centroids, value_centroids, q, k, v, q_pos, window, transforms)
    t0 = time.perf_counter()
    ck0 = jnp.asarray(key_centroids, jnp.float32)
    cv0 = jnp.asarray(value_centroids, jnp.float32)
    pos = jnp.asarray(np.asarray(q_pos).reshape(w, s) % window, jnp.int32)
    tr = LayerTransforms(*(None if a is None else jnp.asarray(a, jnp.float32) for a in transforms))
    ck1, cv1, err0, err1, hist = _finetune(ck0, cv0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pos, tr,
                                           key, w=w, s=s, settings=settings)
    ck0, cv0, ck1, cv1 = (np.asarray(a) for a in (ck0, cv0, ck1, cv1))
    err0, err1 = np.asarray(err0, np.float64), np.asarray(err1, np.float64)
    # one choice per codebook group (key and value codebooks of a group together)
    if settings.keep_best:
        kept = _group_errors(err1, ck0.shape[0]) < _group_errors(err0, ck0.shape[0])
    else:
        kept = np.ones(ck0.shape[0], bool)
    ck = np.where(kept[:, None, None, None], ck1, ck0).astype(np.float32)
    cv = np.where(kept[:, None, None, None], cv1, cv0).astype(np.float32)
    after = np.where(np.broadcast_to(kept, err0.shape), err1, err0)
    return LayerFinetune(ck, cv, err0, after, err1, kept, np.asarray(hist), time.perf_counter() - t0)


@functools.partial(jax.jit, static_argnames=("w", "s"))
def _errors(ck, cv, q, k, v, pos, transforms: LayerTransforms, *, w: int, s: int):
    data = _prepare(q, k, v, pos, transforms, w, s)
    kc, vc = _codes(ck, cv, data)
    return _head_errors(ck, cv, kc, vc, data)


def attention_output_error(key_centroids, value_centroids, q, k, v, q_pos, *, window: int,
                           transforms: LayerTransforms | None = None) -> np.ndarray:
    """Relative attention-output error per KV head, float64[Hkv], of one layer's codebooks.

    Keys / values get their nearest-centroid codes (as the cache stores them); shapes as
    :func:`finetune_layer`. err_h = sum ||o_hat - o||^2 / sum ||o||^2 over the G query heads
    and the Nq queries of KV head h.
    """
    transforms = transforms or LayerTransforms()
    w, s = check_layer_data(key_centroids, value_centroids, q, k, v, q_pos, window, transforms)
    pos = jnp.asarray(np.asarray(q_pos).reshape(w, s) % window, jnp.int32)
    tr = LayerTransforms(*(None if a is None else jnp.asarray(a, jnp.float32) for a in transforms))
    err = _errors(jnp.asarray(key_centroids, jnp.float32), jnp.asarray(value_centroids, jnp.float32),
                  jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pos, tr, w=w, s=s)
    return np.asarray(err, np.float64)


# ---------------------------------------------------------------------------- a model's codebooks
def _layer_transforms(books: PQCodebooks, layer: int) -> LayerTransforms:
    return LayerTransforms(*(None if t is None else np.asarray(t[layer]) for t in
                             (books.key_transform, books.query_transform, books.value_transform,
                              books.output_transform)))


def layer_errors(books: PQCodebooks, q, k, v, q_pos, *, window: int) -> np.ndarray:
    """float64[L, Hkv] relative attention-output error of every layer (see attention_output_error);
    q float[L, Hkv, G, Nq, d], k / v float[L, Hkv, N, d]."""
    _check_model_data(books, q, k, v)
    return np.stack([attention_output_error(books.key.centroids[i], books.value.centroids[i], q[i], k[i], v[i],
                                            q_pos, window=window, transforms=_layer_transforms(books, i))
                     for i in range(books.num_layers)])


def _check_model_data(books: PQCodebooks, q, k, v) -> None:
    if books.granularity == "shared":
        raise ValueError("finetune: shared codebooks (one for all layers) cannot be tuned per layer; "
                         "use 'layer' or 'layer_head' granularity")
    for name, a, rank in (("q", q, 5), ("k", k, 4), ("v", v, 4)):
        if getattr(a, "ndim", None) != rank:
            raise ValueError(f"finetune: {name} must have {rank} axes ([L, ...]), got shape "
                             f"{tuple(getattr(a, 'shape', ()))}")
        if a.shape[0] != books.num_layers:
            raise ValueError(f"finetune: {name} is for {a.shape[0]} layers, the codebooks for {books.num_layers}")


def finetune_codebooks(books: PQCodebooks, q, k, v, q_pos, *, window: int,
                       settings: FinetuneSettings = FinetuneSettings(), key: jax.Array,
                       progress: Callable[[int, int], None] | None = None
                       ) -> tuple[PQCodebooks, list[LayerFinetune]]:
    """Fine-tune every layer of a model's codebooks (``layer`` or ``layer_head`` granularity).

    q: float[L, Hkv, G, Nq, d] calibration queries (post-RoPE), k / v: float[L, Hkv, N, d],
    q_pos: int[Nq] (shared by the layers), window: tokens per calibration window. Layer i uses
    ``fold_in(key, i)``. The transforms the codebooks carry are respected (module docstring).
    Returns (the tuned PQCodebooks, transforms unchanged; one LayerFinetune per layer).
    ``progress(done, total)`` runs after each layer (it may raise to stop).
    """
    if books.key_rope == "pre":
        raise ValueError("codebook fine-tuning is not implemented for keys quantized before RoPE (its loss "
                         "reads post-RoPE keys); fit them with k-means only")
    if books.stages > 1:
        raise ValueError(f"codebook fine-tuning takes single-stage codebooks; these have {books.stages} "
                         "residual stages")
    _check_model_data(books, q, k, v)
    settings = settings.check()
    kc, vc, reports = [], [], []
    for i in range(books.num_layers):
        r = finetune_layer(books.key.centroids[i], books.value.centroids[i], q[i], k[i], v[i], q_pos,
                           window=window, settings=settings, key=jax.random.fold_in(key, i),
                           transforms=_layer_transforms(books, i))
        kc.append(r.key_centroids)
        vc.append(r.value_centroids)
        reports.append(r)
        if progress is not None:
            progress(i + 1, books.num_layers)
    tuned = dataclasses.replace(books, key=Codebooks(jnp.asarray(np.stack(kc))),
                                value=Codebooks(jnp.asarray(np.stack(vc))))
    return tuned, reports

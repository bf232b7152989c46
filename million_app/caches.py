"""The command line's view of a cache: a library ``CacheSpec`` named, reported, built and measured.

The settings live in one object, :class:`million_jax.CacheSpec` (the command line parses its
flags into one: :func:`million_app.flags.cache_spec`); this module only reads it:

    label(spec)                      a short name, e.g. ``pq M=32 nbits=8 layer_head``
    settings(spec)                   JSON-ready settings; protocol ``all`` (``spec.quantize_all``:
                                     every key/value read from the quantized store, MILLION's
                                     evaluation) or ``realistic`` (``spec.window`` last and
                                     ``spec.sinks`` first tokens kept exact)
    build(spec, config, batch, n)    (empty cache, cache_consts); bad settings are UsageErrors
    memory(spec, config, batch, n)   the memory accounting every command reports, read from the
                                     cache's own ``bits_per_element`` / ``bytes_per_token`` /
                                     ``nbytes`` (million_jax.cache.base.KVCache):

    bits_per_element          bits of information per K/V element: pq: (Mk * nbits_k + Mv *
                              nbits_v) / (2 d) (``PQCodebooks.bits_per_element``; codebooks are
                              counted apart); dense / uniform: as stored
    storage_bits_per_element  bits the cache stores per K/V element, keys and values averaged
                              (``cache.bits_per_element``: dense: the dtype's bits; pq: the
                              codes at their packed width; uniform: codes + scales + zeros)
    bytes_per_token           ``cache.bytes_per_token()``: all layers and KV heads, K + V
    cache_bytes               ``cache.nbytes()`` (the whole state: codes, exact ring and sinks,
                              staging buffers, lengths)
    sink_bytes                of which the exact first tokens (``sinks`` / ``precise_sinks``): a
                              fixed cost per sequence, not per token (0 without sinks)
    cache_bytes_global / _sliding  a hybrid model's (Gemma 3) two kinds of layer apart: the global
                              layers in the chosen kind, the sliding layers' exact rings (fixed
                              size whatever the context); dense_cache_bytes_global likewise
    dense_cache_bytes         a DenseCache of the same shape in the requested dtype
    codebook_bytes            the PQ codebooks (constant, shared by every sequence)

A dense bfloat16 cache that cannot run on this backend is built in float32 (and reported so).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from million_app.errors import UsageError
from million_jax.cache.base import tree_nbytes
from million_jax.cache.spec import CacheSpec, make_cache

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@functools.lru_cache(maxsize=None)
def dense_dtype_runs(dtype_name: str) -> bool:
    """Whether exact attention over a cache of this dtype runs on the default backend.

    (XLA:CPU rejects the bf16 x bf16 -> f32 dot that a bf16 DenseCache needs; the
    command line then keeps the dense cache in float32 and says so.)
    """
    if dtype_name == "float32":
        return True
    from million_jax.attention.exact import causal_attention

    dt = DTYPES[dtype_name]
    b, t, h, hkv, d = 2, 128, 4, 2, 64  # large enough for XLA to emit real dot calls
    try:
        q = jnp.zeros((b, t, h, d), jnp.float32)
        kv = jnp.zeros((b, hkv, t, d), dt)
        fn = jax.jit(lambda q, kv: causal_attention(q, kv, kv, q_positions=jnp.zeros((b, t), jnp.int32),
                                                    kv_lengths=jnp.full((b,), t, jnp.int32)))
        jax.block_until_ready(fn(q, kv))
        return True
    except Exception:  # noqa: BLE001 - any failure means "does not run here"
        return False


# ---------------------------------------------------------------------------- naming
def dtype_name(spec: CacheSpec) -> str:
    """The requested dtype's name, e.g. ``bfloat16``."""
    return jnp.dtype(spec.dtype).name


def effective_dtype(spec: CacheSpec) -> str:
    """The dtype actually used (a dense bf16 cache falls back to fp32 where it cannot run)."""
    name = dtype_name(spec)
    if spec.kind == "dense" and not dense_dtype_runs(name):
        return "float32"
    return name


def protocol(spec: CacheSpec) -> str:
    """``all`` (every token from the quantized store) or ``realistic`` (window / sinks exact)."""
    return "all" if spec.quantize_all else "realistic"


def label(spec: CacheSpec) -> str:
    """A short human-readable name, e.g. ``pq M=32 nbits=8 layer_head``."""
    if spec.kind == "dense":
        return f"dense {effective_dtype(spec)}"
    if spec.kind == "pq":
        b = spec.codebooks
        if b is None:
            return "pq"
        sinks = f" +{spec.precise_sinks} {dtype_name(spec)} sinks" if spec.precise_sinks else ""
        if (b.same_budget and b.key_transform is None and b.value_transform is None and b.stages == 1
                and not (b.key_norms or b.value_norms) and b.key_rope_pairs == 1):
            return f"pq M={b.key_M} nbits={b.key_nbits} {b.granularity}{sinks}"
        return f"pq {b.recipe} {b.granularity}{sinks}"
    if spec.kind == "turboquant":
        return f"turboquant {spec.bits:g} b" + (" +qjl" if spec.qjl else "")
    if spec.kind == "kivi":
        r = 0 if spec.quantize_all else spec.window
        return f"kivi int{spec.bits} g{spec.group_size} r{r}"
    if spec.uniform_mode == "kivi":
        return f"uniform kivi int{spec.bits} g{spec.group_size}"
    return f"uniform token int{spec.bits}"


def settings(spec: CacheSpec) -> dict[str, Any]:
    """JSON-ready settings of this cache (where its codebooks came from is the caller's to add)."""
    out: dict[str, Any] = {"cache": spec.kind, "cache_label": label(spec), "cache_dtype": effective_dtype(spec)}
    if effective_dtype(spec) != dtype_name(spec):
        out["requested_cache_dtype"] = dtype_name(spec)
        out["note"] = (f"a {dtype_name(spec)} dense cache does not run on the "
                       f"{jax.default_backend()} backend; float32 used")
    if spec.kind == "dense":
        return out
    out.update(protocol=protocol(spec), recent=spec.window, sinks=spec.sinks)
    if spec.kind == "pq":
        b = spec.codebooks
        out.update(precise_sinks=spec.precise_sinks,
                   M=b.key_M, nbits=b.key_nbits, value_M=b.value_M, value_nbits=b.value_nbits,
                   query_aware_keys=b.key_transform is not None,
                   output_aware_values=b.value_transform is not None, stages=b.stages,
                   granularity=b.granularity)
        if b.key_parts is not None:
            out["key_parts"] = [list(p) for p in b.key_parts]
    elif spec.kind == "turboquant":
        out.update(bits=spec.bits, qjl=spec.qjl, rotation_seed=spec.seed)
    elif spec.kind == "kivi":
        out.update(bits=spec.bits, group_size=spec.group_size, residual=0 if spec.quantize_all else spec.window)
    else:
        out.update(bits=spec.bits, uniform_mode=spec.uniform_mode,
                   group_size=spec.group_size if spec.uniform_mode == "kivi" else None)
    return out


def beyond_calibration(spec: CacheSpec, n_tokens: int, calib_window: int | None,
                       codebooks_path: str | None = None) -> str | None:
    """A warning when PQ codebooks calibrated on windows of ``calib_window`` tokens read ``n_tokens``.

    Keys quantized after RoPE (``key_rope == "post"``): positions past the calibration window rotate them to
    angles the k-means never saw (benchmarks/results/position_error_smollm2: query-weighted
    key error 0.3% in the first 1K positions, 46% at 6-8K, for 512-token calibration)."""
    if spec.kind != "pq" or calib_window is None or n_tokens <= calib_window:
        return None
    if spec.codebooks is not None and spec.codebooks.key_rope == "pre":
        return None  # keys quantized before RoPE do not depend on position
    # one long window alone starves the attention sinks (position_error_smollm2/): mix in 512
    advice = f"--window {n_tokens}" if n_tokens <= 512 else f"--window 512,{n_tokens}"
    return (f"the codebooks ({codebooks_path or 'given'}) were calibrated on windows of "
            f"{calib_window} tokens and will read sequences of up to {n_tokens}: keys past "
            f"position {calib_window} are quantized with a much larger error (long-range "
            f"retrieval fails); calibrate with `million-jax calibrate --rope pre` (position-independent) or "
            f"`million-jax calibrate --rope post {advice}`")


# ---------------------------------------------------------------------------- building
def runnable(spec: CacheSpec) -> CacheSpec:
    """``spec`` in the dtype it runs in here (:func:`effective_dtype`)."""
    if effective_dtype(spec) == dtype_name(spec):
        return spec
    return dataclasses.replace(spec, dtype=DTYPES[effective_dtype(spec)])


def build(spec: CacheSpec, config: Any, batch: int, max_len: int) -> tuple[Any, Any]:
    """(empty cache, cache_consts) for a model config; bad settings are UsageErrors."""
    try:
        return make_cache(runnable(spec), config, batch, max_len)
    except ValueError as e:
        raise UsageError(f"{label(spec)}: {e}") from None


# ---------------------------------------------------------------------------- accounting
def sink_bytes(cache: Any) -> int:
    """Bytes of the exact first tokens (``sink_k`` + ``sink_v`` of every layer; 0 for a cache
    without them): fixed per sequence, whatever the context."""
    layers = getattr(cache, "layers", None)
    layers = getattr(layers, "glob", layers)  # a HybridCache: its global layers hold the sinks
    arrays = [getattr(layers, f, None) for f in ("sink_k", "sink_v")]
    return int(sum(tree_nbytes(a) for a in arrays if a is not None))


def memory(spec: CacheSpec, config: Any, batch: int, max_len: int) -> dict[str, Any]:
    """The memory accounting of the module docstring, read from the cache itself.

    The cache ``build`` would make (and a dense one of the same shape) is traced for its shapes
    only (``jax.eval_shape``: nothing is allocated); its ``bits_per_element``,
    ``bytes_per_token`` and ``nbytes`` give the numbers.
    """
    cache = jax.eval_shape(lambda: build(spec, config, batch, max_len)[0])
    dense = jax.eval_shape(lambda: make_cache(CacheSpec("dense", dtype=spec.dtype), config, batch, max_len)[0])
    stored = cache.bits_per_element.mean
    kinds = {}
    if hasattr(cache, "nbytes_by_kind"):  # a HybridCache: sliding rings apart from the global layers
        by, dense_by = cache.nbytes_by_kind(), dense.nbytes_by_kind()
        kinds = {"cache_bytes_global": by["global"], "cache_bytes_sliding": by["sliding"],
                 "dense_cache_bytes_global": dense_by["global"], "global_layers": list(config.global_layers),
                 "sliding_window": int(config.sliding_window)}
    return {
        "bits_per_element": float(spec.codebooks.bits_per_element) if spec.kind == "pq" else stored,
        "storage_bits_per_element": stored,
        "bytes_per_token": cache.bytes_per_token(),
        "cache_bytes": int(cache.nbytes()),
        "sink_bytes": sink_bytes(cache),
        "dense_cache_bytes": int(dense.nbytes()),
        "dense_cache_dtype": dtype_name(spec),
        "codebook_bytes": int(spec.codebooks.nbytes) if spec.kind == "pq" else 0,
        "cache_shape": {"batch": batch, "max_len": max_len, "layers": config.n_layers,
                        "kv_heads": config.n_kv_heads, "head_dim": config.head_dim},
        **kinds,
    }

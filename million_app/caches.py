"""The command line's view of a cache: a library ``CacheSpec`` named, reported, built and measured.

The settings live in one object, :class:`million_jax.CacheSpec` (the command line parses its
flags into one: :func:`million_app.flags.cache_spec`); this module only reads it:

    label(spec)                      a short name, e.g. ``pq M=32 nbits=8 layer_head``
    settings(spec)                   JSON-ready settings; protocol ``all`` (``spec.quantize_all``:
                                     every key/value read from the quantized store, MILLION's
                                     evaluation) or ``realistic`` (``spec.window`` last and
                                     ``spec.sinks`` first tokens kept exact)
    build(spec, config, batch, n)    (empty cache, cache_consts); bad settings are UsageErrors
    memory(spec, config, batch, n)   the memory accounting every command reports:

    bits_per_elem          stored bits per K/V element, every per-token overhead counted:
                           dense: the dtype's bits (16 for bf16, 32 for fp32);
                           pq: (Mk * nbits_k + Mv * nbits_v) / (2 d) (the codes' information;
                           codebooks are counted separately);
                           uniform: codes + scales + zeros (``UniformCache.bits_per_element``)
    storage_bits_per_elem  from the bytes the code arrays really hold (codes of nbits < 8 are
                           packed at their real width, 9..12-bit codes too)
    cache_bytes            ``cache.nbytes()`` of an empty cache of the shape (the whole
                           state: codes, exact ring and sinks, staging buffers, lengths)
    dense_cache_bytes      a DenseCache of the same shape in the requested dtype
    codebook_bytes         the PQ codebooks (constant, shared by every sequence)

A dense bfloat16 cache that cannot run on this backend is built in float32 (and reported so).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from million_app.errors import UsageError
from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache
from million_jax.cache.spec import CacheSpec, make_cache
from million_jax.cache.uniform_cache import UniformCache

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
        if b.same_budget and b.key_transform is None and b.value_transform is None and b.stages == 1:
            return f"pq M={b.key_M} nbits={b.key_nbits} {b.granularity}"
        return f"pq {b.recipe} {b.granularity}"
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
        out.update(M=b.key_M, nbits=b.key_nbits, value_M=b.value_M, value_nbits=b.value_nbits,
                   query_aware_keys=b.key_transform is not None,
                   output_aware_values=b.value_transform is not None, stages=b.stages,
                   granularity=b.granularity)
    else:
        out.update(bits=spec.bits, uniform_mode=spec.uniform_mode,
                   group_size=spec.group_size if spec.uniform_mode == "kivi" else None)
    return out


def beyond_calibration(spec: CacheSpec, n_tokens: int, calib_window: int | None,
                       codebooks_path: str | None = None) -> str | None:
    """A warning when PQ codebooks calibrated on windows of ``calib_window`` tokens read ``n_tokens``.

    Keys are quantized after RoPE: positions past the calibration window rotate them to
    angles the k-means never saw (benchmarks/results/position_error_smollm2: query-weighted
    key error 0.3% in the first 1K positions, 46% at 6-8K, for 512-token calibration)."""
    if spec.kind != "pq" or calib_window is None or n_tokens <= calib_window:
        return None
    # one long window alone starves the attention sinks (position_error_smollm2/): mix in 512
    advice = f"--window {n_tokens}" if n_tokens <= 512 else f"--window 512,{n_tokens}"
    return (f"the codebooks ({codebooks_path or 'given'}) were calibrated on windows of "
            f"{calib_window} tokens and will read sequences of up to {n_tokens}: keys past "
            f"position {calib_window} are quantized with a much larger error (long-range "
            f"retrieval fails); calibrate with `million-jax calibrate {advice}`")


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
def bits_per_elem(spec: CacheSpec, head_dim: int) -> float:
    """Stored bits per key/value element (see the module docstring)."""
    if spec.kind == "dense":
        return float(jnp.dtype(DTYPES[effective_dtype(spec)]).itemsize * 8)
    if spec.kind == "pq":
        return float(spec.codebooks.bits_per_elem)
    return float(_shape_only(spec, head_dim).bits_per_element.mean)


def storage_bits_per_elem(spec: CacheSpec, head_dim: int) -> float:
    """Bits per element from the bytes the PQ code arrays hold (codes other than 8-bit packed)."""
    if spec.kind == "pq":
        b = spec.codebooks
        lay = jax.eval_shape(lambda: PQCache.create(1, 1, 1, 1, head_dim, M=b.key_M, nbits=b.key_nbits,
                                                    value_M=b.value_M, value_nbits=b.value_nbits)).layers
        code_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in (lay.k_codes, lay.v_codes))
        return 8.0 * code_bytes / (2 * head_dim)
    return bits_per_elem(spec, head_dim)


def _shape_only(spec: CacheSpec, head_dim: int) -> UniformCache:
    g = spec.group_size if spec.uniform_mode == "kivi" else head_dim
    return jax.eval_shape(lambda: UniformCache.create(
        1, 1, 1, g, head_dim, bits=spec.bits, group_size=spec.group_size,
        mode=spec.uniform_mode, dtype=spec.dtype))


def memory(spec: CacheSpec, config: Any, batch: int, max_len: int) -> dict[str, Any]:
    """bits_per_elem, storage_bits_per_elem, cache_bytes, dense_cache_bytes, codebook_bytes."""
    d = config.head_dim
    # Shapes only (nothing allocated): nbytes() reads shapes and dtypes.
    cache_bytes = jax.eval_shape(lambda: build(spec, config, batch, max_len)[0]).nbytes()
    dense_bytes = jax.eval_shape(lambda: DenseCache.create(
        config.n_layers, batch, config.n_kv_heads, max_len, d, spec.dtype)).nbytes()
    return {
        "bits_per_elem": bits_per_elem(spec, d),
        "storage_bits_per_elem": storage_bits_per_elem(spec, d),
        "cache_bytes": int(cache_bytes),
        "dense_cache_bytes": int(dense_bytes),
        "dense_cache_dtype": dtype_name(spec),
        "codebook_bytes": int(spec.codebooks.nbytes) if spec.kind == "pq" else 0,
        "cache_shape": {"batch": batch, "max_len": max_len, "layers": config.n_layers,
                        "kv_heads": config.n_kv_heads, "head_dim": d},
    }

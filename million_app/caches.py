"""Which KV cache a command runs: one small choice shared by eval, sweep, generate and passkey.

``CacheChoice`` is the command line's view of a cache (kind, protocol, recent window, labels);
it builds empty caches through the library's ``million_jax.make_cache`` and does the memory
accounting every command reports:

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

Protocols: ``all`` reads every key and value from the quantized store (MILLION's
evaluation); ``realistic`` keeps the last ``recent`` tokens and the first ``sinks``
tokens exact.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from million_app.errors import UsageError
from million_jax.cache.dense import DenseCache
from million_jax.cache.spec import CacheSpec, make_cache
from million_jax.cache.uniform_cache import UniformCache
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.cache.pq_cache import PQCache

KINDS = ("dense", "pq", "uniform")
PROTOCOLS = ("all", "realistic")
UNIFORM_MODES = ("kivi", "token")
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


@dataclasses.dataclass(frozen=True)
class CacheChoice:
    """A cache kind and its settings (see the module docstring)."""

    kind: str = "dense"
    protocol: str = "all"
    recent: int = 0
    sinks: int = 0
    dtype: str = "bfloat16"
    bits: int | None = None
    group_size: int = 32
    uniform_mode: str = "kivi"
    codebooks: PQCodebooks | None = None
    codebooks_path: str | None = None
    impl: str = "auto"
    calib_window: int | None = None  # the codebooks' calibration window (file metadata), if known

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"--cache must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"--protocol must be 'all' or 'realistic', got {self.protocol!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--cache-dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.recent < 0 or self.sinks < 0:
            raise UsageError("--recent and --sinks must be >= 0")
        if self.kind == "pq" and self.codebooks is None:
            raise UsageError("--cache pq needs --codebooks FILE (make one with `million-jax calibrate`)")
        if self.kind != "pq" and self.codebooks is not None:
            raise UsageError(f"--codebooks is only used with --cache pq, not --cache {self.kind}")
        if self.kind == "uniform":
            if self.bits not in (2, 4, 8):
                raise UsageError(f"--cache uniform needs --bits 2, 4 or 8, got {self.bits}")
            if self.uniform_mode not in UNIFORM_MODES:
                raise UsageError(f"--uniform-mode must be 'kivi' or 'token', got {self.uniform_mode!r}")
        elif self.bits is not None:
            raise UsageError(f"--bits is only used with --cache uniform, not --cache {self.kind}")

    # ------------------------------------------------------------------ naming
    @property
    def quantize_all(self) -> bool:
        return self.protocol == "all"

    @property
    def effective_dtype(self) -> str:
        """The dtype actually used (a dense bf16 cache falls back to fp32 where it cannot run)."""
        if self.kind == "dense" and not dense_dtype_runs(self.dtype):
            return "float32"
        return self.dtype

    def label(self) -> str:
        """A short human-readable name, e.g. ``pq M=32 nbits=8 layer_head``."""
        if self.kind == "dense":
            return f"dense {self.effective_dtype}"
        if self.kind == "pq":
            b = self.codebooks
            if b.same_budget and b.key_transform is None and b.value_transform is None and b.stages == 1:
                return f"pq M={b.key_M} nbits={b.key_nbits} {b.granularity}"
            return f"pq {b.recipe} {b.granularity}"
        if self.uniform_mode == "kivi":
            return f"uniform kivi int{self.bits} g{self.group_size}"
        return f"uniform token int{self.bits}"

    def settings(self) -> dict[str, Any]:
        """JSON-ready settings of this cache."""
        out: dict[str, Any] = {"cache": self.kind, "cache_label": self.label(),
                               "cache_dtype": self.effective_dtype}
        if self.effective_dtype != self.dtype:
            out["requested_cache_dtype"] = self.dtype
            out["note"] = (f"a {self.dtype} dense cache does not run on the "
                           f"{jax.default_backend()} backend; float32 used")
        if self.kind == "dense":
            return out
        out.update(protocol=self.protocol,
                   recent=self.recent if self.protocol == "realistic" else 0,
                   sinks=self.sinks if self.protocol == "realistic" else 0)
        if self.kind == "pq":
            b = self.codebooks
            out.update(M=b.key_M, nbits=b.key_nbits, value_M=b.value_M, value_nbits=b.value_nbits,
                       query_aware_keys=b.key_transform is not None,
                       output_aware_values=b.value_transform is not None, stages=b.stages,
                       granularity=b.granularity, codebooks=self.codebooks_path,
                       calib_window=self.calib_window)
        else:
            out.update(bits=self.bits, uniform_mode=self.uniform_mode,
                       group_size=self.group_size if self.uniform_mode == "kivi" else None)
        return out

    def beyond_calibration(self, n_tokens: int) -> str | None:
        """A warning when PQ codebooks calibrated on windows shorter than ``n_tokens`` read them.

        Keys are quantized after RoPE: positions past the calibration window rotate them to
        angles the k-means never saw (benchmarks/results/position_error_smollm2: query-weighted
        key error 0.3% in the first 1K positions, 46% at 6-8K, for 512-token calibration)."""
        if self.kind != "pq" or self.calib_window is None or n_tokens <= self.calib_window:
            return None
        # one long window alone starves the attention sinks (position_error_smollm2/): mix in 512
        advice = f"--window {n_tokens}" if n_tokens <= 512 else f"--window 512,{n_tokens}"
        return (f"the codebooks ({self.codebooks_path or 'given'}) were calibrated on windows of "
                f"{self.calib_window} tokens and will read sequences of up to {n_tokens}: keys past "
                f"position {self.calib_window} are quantized with a much larger error (long-range "
                f"retrieval fails); calibrate with `million-jax calibrate {advice}`")

    # ------------------------------------------------------------------ building
    def library_spec(self) -> CacheSpec:
        """The library's CacheSpec of this choice (see ``million_jax.make_cache``)."""
        realistic = self.protocol == "realistic"
        return CacheSpec(kind=self.kind, dtype=DTYPES[self.effective_dtype], window=self.recent if realistic else 0,
                         sinks=self.sinks if realistic else 0, quantize_all=self.quantize_all,
                         codebooks=self.codebooks, impl=self.impl, bits=self.bits, group_size=self.group_size,
                         uniform_mode=self.uniform_mode)

    def build(self, config: Any, batch: int, max_len: int) -> tuple[Any, Any]:
        """(empty cache, cache_consts) for a model config; bad settings are UsageErrors."""
        try:
            return make_cache(self.library_spec(), config, batch, max_len)
        except ValueError as e:
            raise UsageError(f"{self.label()}: {e}") from None

    # ------------------------------------------------------------------ accounting
    def bits_per_elem(self, head_dim: int) -> float:
        """Stored bits per key/value element (see the module docstring)."""
        if self.kind == "dense":
            return float(jnp.dtype(DTYPES[self.effective_dtype]).itemsize * 8)
        if self.kind == "pq":
            return float(self.codebooks.bits_per_elem)
        cache = self._shape_only(head_dim)
        return float(cache.bits_per_element.mean)

    def storage_bits_per_elem(self, head_dim: int) -> float:
        """Bits per element from the bytes the PQ code arrays hold (codes other than 8-bit packed)."""
        if self.kind == "pq":
            b = self.codebooks
            lay = jax.eval_shape(lambda: PQCache.create(1, 1, 1, 1, head_dim, M=b.key_M, nbits=b.key_nbits,
                                                        value_M=b.value_M, value_nbits=b.value_nbits)).layers
            code_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in (lay.k_codes, lay.v_codes))
            return 8.0 * code_bytes / (2 * head_dim)
        return self.bits_per_elem(head_dim)

    def _shape_only(self, head_dim: int) -> UniformCache:
        g = self.group_size if self.uniform_mode == "kivi" else head_dim
        return jax.eval_shape(lambda: UniformCache.create(
            1, 1, 1, g, head_dim, bits=self.bits, group_size=self.group_size,
            mode=self.uniform_mode, dtype=DTYPES[self.dtype]))

    def memory(self, config: Any, batch: int, max_len: int) -> dict[str, Any]:
        """bits_per_elem, storage_bits_per_elem, cache_bytes, dense_cache_bytes, codebook_bytes."""
        d = config.head_dim
        # Shapes only (nothing allocated): nbytes() reads shapes and dtypes.
        cache_bytes = jax.eval_shape(lambda: self.build(config, batch, max_len)[0]).nbytes()
        dense_bytes = jax.eval_shape(lambda: DenseCache.create(
            config.n_layers, batch, config.n_kv_heads, max_len, d, DTYPES[self.dtype])).nbytes()
        return {
            "bits_per_elem": self.bits_per_elem(d),
            "storage_bits_per_elem": self.storage_bits_per_elem(d),
            "cache_bytes": int(cache_bytes),
            "dense_cache_bytes": int(dense_bytes),
            "dense_cache_dtype": self.dtype,
            "codebook_bytes": int(self.codebooks.nbytes) if self.kind == "pq" else 0,
            "cache_shape": {"batch": batch, "max_len": max_len, "layers": config.n_layers,
                            "kv_heads": config.n_kv_heads, "head_dim": d},
        }

"""PQCache: the KV cache stored as product-quantization codes.

State (a registered dataclass pytree, donated across decode steps):

    k_codes, v_codes:  uint8|uint16[L, B, Hkv, T_max, M]  every token, encoded at append
    sink_k, sink_v:    float[L, B, Hkv, S, d]              first S tokens, exact
    ring_k, ring_v:    float[L, B, Hkv, W, d]              last W tokens, exact (slot = pos % W)
    lengths:           int32[B]

Codebooks are NOT part of the state: they are a separate, constant
:class:`PQCodebooks` passed as ``cache_consts`` (so donating the cache never
donates them). Keys are encoded after RoPE, so q . k is a LUT sum.

Each appended token is encoded once (constant cost per step, no flush
spikes). Attention (see :mod:`million_jax.cache.window`) reads sinks and the
sliding window of the last W positions exactly and everything else from
codes, merged by log-sum-exp. ``quantize_all=True`` is MILLION's evaluation
protocol: every key/value, the current token's included, is read from codes.

impl: "xla" (pure jnp, runs anywhere); "pallas" (decode steps use the fused
kernel, an error if it cannot run them, e.g. nbits > 8; interpret mode off
GPU; prefill always takes the xla path); "auto" (the kernel for decode steps
on GPU when it supports the shapes, else xla).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp

from million_jax.attention import merge_attention
from million_jax.cache.base import CodesWithWindow
from million_jax.cache.window import exact_window_attention, write_rows, write_window
from million_jax.pq import Codebooks, code_dtype, encode
from million_jax.pq_attention import pq_attention

Granularity = Literal["shared", "layer", "layer_head"]
GRANULARITIES = ("shared", "layer", "layer_head")

__all__ = ["PQCache", "PQCodebooks", "GRANULARITIES"]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["key", "value"], meta_fields=["granularity"]
)
@dataclasses.dataclass(frozen=True)
class PQCodebooks:
    """Key and value codebooks of a model at one granularity.

    key.centroids / value.centroids:
        shared:      float32[M, K, dsub]
        layer:       float32[L, M, K, dsub]
        layer_head:  float32[L, Hkv, M, K, dsub]
    """

    key: Codebooks
    value: Codebooks
    granularity: str = "layer_head"

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")

    @property
    def M(self) -> int:
        return self.key.num_subspaces

    @property
    def nbits(self) -> int:
        return self.key.nbits

    @property
    def head_dim(self) -> int:
        return self.key.dim

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> "PQCodebooks":
        """Raise a clear ValueError unless these codebooks fit the given model shape."""
        for name, cb in (("key", self.key), ("value", self.value)):
            c = cb.centroids
            want_groups = {"shared": (), "layer": (num_layers,), "layer_head": (num_layers, num_kv_heads)}[
                self.granularity
            ]
            if tuple(c.shape[:-3]) != want_groups:
                raise ValueError(
                    f"{name} codebooks have group shape {tuple(c.shape[:-3])}, "
                    f"granularity {self.granularity!r} needs {want_groups}"
                )
            if cb.dim != head_dim:
                raise ValueError(f"{name} codebooks are for head_dim {cb.dim}, the model has {head_dim}")
            cb.validate()
        if self.key.centroids.shape != self.value.centroids.shape:
            raise ValueError(
                f"key and value codebooks differ in shape: {self.key.centroids.shape} vs {self.value.centroids.shape}"
            )
        return self

    def per_layer(self, num_layers: int) -> tuple[jax.Array, jax.Array]:
        """(key, value) centroids as float32[L, G, M, K, dsub], G = 1 or Hkv (scanned by layer)."""

        def norm(c):
            c = jnp.asarray(c, jnp.float32)
            if self.granularity == "shared":
                return jnp.broadcast_to(c[None, None], (num_layers, 1) + c.shape)
            if self.granularity == "layer":
                return c[:, None]
            return c

        return norm(self.key.centroids), norm(self.value.centroids)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "v_codes", "sink_k", "sink_v", "ring_k", "ring_v", "lengths"],
    meta_fields=["quantize_all", "impl"],
)
@dataclasses.dataclass(frozen=True)
class PQCache(CodesWithWindow):
    """Product-quantized KV cache (see module docstring)."""

    k_codes: jax.Array
    v_codes: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    lengths: jax.Array
    quantize_all: bool = False
    impl: str = "auto"

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        M: int,
        nbits: int,
        window: int = 0,
        sinks: int = 0,
        dtype: Any = jnp.bfloat16,
        quantize_all: bool = False,
        impl: str = "auto",
    ) -> "PQCache":
        """An empty cache; ``window`` (W) and ``sinks`` (S) may be 0."""
        if head_dim % M:
            raise ValueError(f"head_dim {head_dim} is not divisible by M={M}")
        if window < 0 or sinks < 0:
            raise ValueError(f"window and sinks must be >= 0, got window={window}, sinks={sinks}")
        if impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        cdt = code_dtype(nbits)
        lead = (num_layers, batch, num_kv_heads)
        return cls(
            k_codes=jnp.zeros(lead + (max_len, M), cdt),
            v_codes=jnp.zeros(lead + (max_len, M), cdt),
            sink_k=jnp.zeros(lead + (sinks, head_dim), dtype),
            sink_v=jnp.zeros(lead + (sinks, head_dim), dtype),
            ring_k=jnp.zeros(lead + (window, head_dim), dtype),
            ring_v=jnp.zeros(lead + (window, head_dim), dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
            quantize_all=quantize_all,
            impl=impl,
        )

    @classmethod
    def for_codebooks(cls, codebooks: PQCodebooks, num_layers: int, batch: int, num_kv_heads: int, max_len: int, **kw) -> "PQCache":
        """An empty cache whose M / nbits / head_dim match ``codebooks`` (checked)."""
        codebooks.check(num_layers, num_kv_heads, codebooks.head_dim)
        return cls.create(
            num_layers, batch, num_kv_heads, max_len, codebooks.head_dim, M=codebooks.M, nbits=codebooks.nbits, **kw
        )

    # --- shape info -----------------------------------------------------------------





    # --- protocol -------------------------------------------------------------------
    def layer_slices(self, cache_consts: PQCodebooks | None = None):
        if not isinstance(cache_consts, PQCodebooks):
            raise ValueError("PQCache needs its PQCodebooks passed as cache_consts")
        L, _, hkv, _, M = self.k_codes.shape
        cache_consts.check(L, hkv, self.head_dim)
        if cache_consts.M != M or code_dtype(cache_consts.nbits) != self.k_codes.dtype:
            raise ValueError(
                f"codebooks (M={cache_consts.M}, nbits={cache_consts.nbits}) do not match the cache "
                f"(M={M}, codes {self.k_codes.dtype})"
            )
        states = {
            "k_codes": self.k_codes,
            "v_codes": self.v_codes,
            "sink_k": self.sink_k,
            "sink_v": self.sink_v,
            "ring_k": self.ring_k,
            "ring_v": self.ring_v,
        }
        return states, cache_consts.per_layer(L)

    def _pallas_blocker(self, q, k_codes, v_codes, kcb, vcb, lo, hi) -> str | None:
        """None when the fused kernel can run this call, else the reason it cannot."""
        from pallas_kernels import pq_kernel_unsupported_reason

        return pq_kernel_unsupported_reason(q[:, 0], k_codes, v_codes, kcb, vcb, lo[:, 0], hi[:, 0])

    def attend(self, state, const, q, k, v, n_new):
        """Append k, v (float[B, T, Hkv, d]) to one layer and attend q float[B, T, H, d]."""
        kcb, vcb = const  # [G, M, K, dsub]
        b, t = q.shape[:2]
        t_max = self.max_len
        lengths = self.lengths
        # Tokens that would land past T_max are dropped everywhere (codes, ring, sinks).
        n_new = jnp.clip(jnp.minimum(n_new, t_max - lengths), 0)
        steps = jnp.arange(t, dtype=jnp.int32)
        pos = lengths[:, None] + steps[None, :]
        real = steps[None, :] < n_new[:, None]
        rows = jnp.where(real, pos, t_max)

        kt = jnp.swapaxes(k, 1, 2)  # [B, Hkv, T, d]
        vt = jnp.swapaxes(v, 1, 2)
        new_kc = jnp.swapaxes(encode(Codebooks(kcb), kt), 1, 2)  # [B, T, Hkv, M]
        new_vc = jnp.swapaxes(encode(Codebooks(vcb), vt), 1, 2)
        k_codes = write_rows(state["k_codes"], rows, new_kc)
        v_codes = write_rows(state["v_codes"], rows, new_vc)

        ring_k_before, ring_v_before = state["ring_k"], state["ring_v"]
        sink_k, sink_v, ring_k, ring_v = write_window(
            state["sink_k"], state["sink_v"], ring_k_before, ring_v_before, k, v, lengths, n_new
        )
        new_state = dict(k_codes=k_codes, v_codes=v_codes, sink_k=sink_k, sink_v=sink_v, ring_k=ring_k, ring_v=ring_v)

        # Code region per query: [lo, hi).
        end = (lengths + n_new)[:, None]
        if self.quantize_all:
            lo = jnp.zeros_like(pos)
            hi = jnp.minimum(pos + 1, end)
        else:
            lo = jnp.full_like(pos, self.sinks)
            hi = jnp.minimum(pos + 1 - self.window, end)
        use_pallas = False
        # The kernel is a decode kernel: multi-token calls (prefill) always take the xla path.
        if self.impl != "xla" and t == 1:
            blocker = self._pallas_blocker(q, k_codes, v_codes, kcb, vcb, lo, hi)
            if self.impl == "pallas" and blocker:
                raise ValueError(f"impl='pallas' cannot run: {blocker}")
            use_pallas = blocker is None and (self.impl == "pallas" or _on_gpu())
        if use_pallas:
            from pallas_kernels import pq_decode_attention

            out_c, lse_c = pq_decode_attention(
                q[:, 0], k_codes, v_codes, kcb, vcb, lo[:, 0], jnp.maximum(hi[:, 0], lo[:, 0]),
                interpret=not _on_gpu(),  # off-GPU (tests) the kernel runs in interpret mode
            )
            out_c, lse_c = out_c[:, None], lse_c[:, None]
        else:
            out_c, lse_c = pq_attention(q, k_codes, v_codes, kcb, vcb, lo, hi)
        if self.quantize_all or (self.sinks == 0 and self.window == 0):
            return out_c.astype(q.dtype), new_state
        out_e, lse_e = exact_window_attention(
            q, sink_k, sink_v, ring_k_before, ring_v_before, k, v, lengths, n_new
        )
        out, _ = merge_attention(out_c, lse_c, out_e, lse_e)
        return out.astype(q.dtype), new_state


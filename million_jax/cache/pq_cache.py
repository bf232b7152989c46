"""PQCache: the KV cache stored as product-quantization codes.

State (``PQLayer``, stacked over layers; a registered dataclass pytree donated across steps):

    k_codes, v_codes:  uint8|uint16[L, B, Hkv, T_max, M]  every token, encoded at append
    sink_k, sink_v:    float[L, B, Hkv, S, d]              first S tokens, exact
    ring_k, ring_v:    float[L, B, Hkv, W, d]              last W tokens, exact (slot = pos % W)
    lengths:           int32[B]                            (on the PQCache)

Codebooks are NOT part of the state: they are a separate, constant
:class:`~million_jax.pq_codebooks.PQCodebooks` passed as ``cache_consts`` (so donating the
cache never donates them), already laid out per layer. Keys are encoded after RoPE, so
q . k is a LUT sum.

Each appended token is encoded once (constant cost per step, no flush spikes). Attention
(see :mod:`million_jax.cache.window`) reads sinks and the sliding window of the last W
positions exactly and everything else from codes (:mod:`million_jax.kernel_dispatch`
decides between the Pallas kernel and the xla path), merged by log-sum-exp.
``quantize_all=True`` is MILLION's evaluation protocol: every key/value, the current
token's included, is read from codes.

impl: "xla" (pure jnp, runs anywhere); "pallas" (decode steps use the fused kernel, an error
if it cannot run them, e.g. nbits > 8; interpret mode off GPU; prefill always takes the xla
path); "auto" (the kernel for decode steps on GPU when it supports the shapes, else xla).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.cache.base import CACHE_DIMS, check_cache_args, register_cache, token_rows, write_rows
from million_jax.cache.window import ExactWindowCache, ExactWindowLayer, empty_window
from million_jax.kernel_dispatch import KernelMesh, check_impl, pq_code_attention
from million_jax.pq import Codebooks, code_dtype, encode
from million_jax.pq_codebooks import PQCodebooks
from pallas_kernels.softmax import merge_partials

__all__ = ["PQCache", "PQLayer"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "v_codes", "sink_k", "sink_v", "ring_k", "ring_v"],
    meta_fields=["quantize_all", "impl", "mesh"],
)
@dataclasses.dataclass(frozen=True)
class PQLayer(ExactWindowLayer):
    """One layer of a PQCache (module docstring; per layer the leading L axis is absent)."""

    k_codes: jax.Array
    v_codes: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    quantize_all: bool = False
    impl: str = "auto"
    mesh: KernelMesh | None = None

    def attend(self, consts: PQCodebooks, q, k, v, lengths, n_new) -> tuple[jax.Array, "PQLayer"]:
        """Append k, v (float[B, T, Hkv, d]) and attend q float[B, T, H, d].

        consts: this layer's codebooks (centroids float32[G, M, K, dsub]).
        """
        kcb, vcb = consts.key.centroids, consts.value.centroids
        t = q.shape[1]
        t_max = self.max_len
        # Tokens that would land past T_max are dropped everywhere (codes, ring, sinks).
        n_new = jnp.clip(jnp.minimum(n_new, t_max - lengths), 0)
        pos, rows = token_rows(lengths, n_new, t, t_max)
        new_kc = jnp.swapaxes(encode(Codebooks(kcb), jnp.swapaxes(k, 1, 2)), 1, 2)  # [B, T, Hkv, M]
        new_vc = jnp.swapaxes(encode(Codebooks(vcb), jnp.swapaxes(v, 1, 2)), 1, 2)
        written = self.write_exact(k, v, lengths, n_new)
        new = dataclasses.replace(
            self, k_codes=write_rows(self.k_codes, rows, new_kc), v_codes=write_rows(self.v_codes, rows, new_vc),
            **written,
        )
        lo, hi = self.code_region(pos, lengths + n_new)
        out, lse = pq_code_attention(q, new.k_codes, new.v_codes, kcb, vcb, lo, hi, impl=self.impl, mesh=self.mesh)
        if self.has_exact:
            out_e, lse_e = self.exact_attention(q, written, k, v, lengths, n_new)
            out, _ = merge_partials([out, out_e], [lse, lse_e])
        return out.astype(q.dtype), new


@register_cache
@dataclasses.dataclass(frozen=True)
class PQCache(ExactWindowCache):
    """Product-quantized KV cache (see module docstring); cache_consts: its PQCodebooks."""

    layers: PQLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, *,
               M: int, nbits: int, window: int = 0, sinks: int = 0, dtype: Any = jnp.bfloat16,
               quantize_all: bool = False, impl: str = "auto") -> "PQCache":
        """An empty cache; ``window`` (W) and ``sinks`` (S) may be 0."""
        check_cache_args(dict(zip(CACHE_DIMS, (num_layers, batch, num_kv_heads, max_len, head_dim))), dtype,
                         window, sinks)
        if head_dim % M:
            raise ValueError(f"head_dim {head_dim} is not divisible by M={M}")
        check_impl(impl)
        codes = (num_layers, batch, num_kv_heads, max_len, M)
        # distinct buffers for every field: a donated pytree must not hold one buffer twice
        layers = PQLayer(k_codes=jnp.zeros(codes, code_dtype(nbits)), v_codes=jnp.zeros(codes, code_dtype(nbits)), quantize_all=quantize_all, impl=impl,
                         **empty_window((num_layers, batch, num_kv_heads), sinks, window, head_dim, dtype))
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def for_codebooks(cls, codebooks: PQCodebooks, batch: int, num_kv_heads: int, max_len: int, **kw) -> "PQCache":
        """An empty cache whose L / M / nbits / head_dim match ``codebooks`` (checked)."""
        codebooks.check(codebooks.num_layers, num_kv_heads, codebooks.head_dim)
        return cls.create(codebooks.num_layers, batch, num_kv_heads, max_len, codebooks.head_dim,
                          M=codebooks.M, nbits=codebooks.nbits, **kw)

    def layer_consts(self, cache_consts: PQCodebooks | None = None) -> PQCodebooks:
        """The codebooks, checked against this cache (they are scanned with the layers)."""
        if not isinstance(cache_consts, PQCodebooks):
            raise ValueError("PQCache needs its PQCodebooks passed as cache_consts")
        L, _, hkv, _, M = self.layers.k_codes.shape
        cache_consts.check(L, hkv, self.head_dim)
        if cache_consts.M != M or code_dtype(cache_consts.nbits) != self.layers.k_codes.dtype:
            raise ValueError(
                f"codebooks (M={cache_consts.M}, nbits={cache_consts.nbits}) do not match the cache "
                f"(M={M}, codes {self.layers.k_codes.dtype})"
            )
        return cache_consts

"""TurboQuantCache: the KV cache as calibration-free TurboQuant codes (:mod:`million_jax.quant.turboquant`).

State (``TurboQuantLayer``, stacked over layers; donated across decode steps), P = packed code
bytes per vector (d * b / 8 for an integer budget b):

    k_codes, v_codes:  uint8[L, B, Hkv, T_max, P]     every token, encoded at append
    k_norms, v_norms:    dtype[L, B, Hkv, T_max, 1]     per-token norms (bf16 by default)
    k_qjl:             uint8[L, B, Hkv, T_max, d/8]   QJL sign bits of the key residual (qjl; else width 0)
    k_rnorms:           dtype[L, B, Hkv, T_max, 1]     the residual's norm (qjl; else width 0)
    sink_k, sink_v:    dtype[L, B, Hkv, S, d]         first S tokens, exact
    ring_k, ring_v:    dtype[L, B, Hkv, W, d]         last W tokens, exact (slot = pos % W)

Constants (``cache_consts``, never donated): :class:`TurboQuantConsts`, one seeded random
orthogonal rotation per layer (float32[L, d, d], the same for keys and values) and, with the QJL
residual, one Gaussian projection per layer; :func:`turboquant_consts` makes them from a seed.
The levels are not stored: they follow from (d, bits) alone.

Attention: the query is rotated once per call, the stored codes are read by
:func:`~million_jax.attention.pq_dispatch.turboquant_code_attention` (scores from the levels
and each token's norm, values summed in rotated coordinates; decode steps in the Pallas PQ kernel
with one-dim sub-spaces and the norms as per-token scales, per shard on a mesh, else the pure-jnp
path), the call's own tokens from their
decoded codes, both merged by log-sum-exp and turned back by R^T once; sinks and the recent
window are exact (:mod:`million_jax.cache.window`) and merged the same way. ``quantize_all``
reads every token from codes. Keys are quantized after RoPE (as published).

Bits per element (``bits_per_element``) count every per-token byte: codes, norms and the QJL
bits and residual norms.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.attention.exact import tiled_dense_attention
from million_jax.attention.pq_dispatch import KernelMesh, check_impl, turboquant_code_attention
from million_jax.cache.base import CACHE_DIMS, Writes, check_cache_args, kept_tokens, register_cache, token_rows
from million_jax.cache.window import ExactWindowCache, ExactWindowLayer, empty_window
from million_jax.quant import turboquant as tq
from million_jax.quant.uniform import KVBits
from pallas_kernels.softmax import merge_partials

__all__ = ["TurboQuantCache", "TurboQuantConsts", "TurboQuantLayer", "turboquant_consts"]

_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rotation", "qjl"], meta_fields=["seed"])
@dataclasses.dataclass(frozen=True)
class TurboQuantConsts:
    """rotation float32[L, d, d] (orthogonal); qjl float32[L, d, d] or None; the seed they came from."""

    rotation: jax.Array
    qjl: jax.Array | None = None
    seed: int | None = None


def turboquant_consts(num_layers: int, head_dim: int, seed: int = 0, qjl: bool = False) -> TurboQuantConsts:
    """The rotations (and QJL projections) of ``num_layers`` layers, reproducible from ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"turboquant seed must be an int >= 0, got {seed!r}")
    rot = tq.layer_rotations(seed, num_layers, head_dim)
    return TurboQuantConsts(rotation=rot, qjl=tq.qjl_matrices(seed, num_layers, head_dim) if qjl else None,
                            seed=seed)


_DATA = ["k_codes", "k_norms", "k_qjl", "k_rnorms", "v_codes", "v_norms", "sink_k", "sink_v", "ring_k", "ring_v"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA,
                   meta_fields=["bits", "qjl", "quantize_all", "tile", "impl", "mesh"])
@dataclasses.dataclass(frozen=True)
class TurboQuantLayer(ExactWindowLayer):
    """One layer of a TurboQuantCache (module docstring; per layer the leading L axis is absent)."""

    TOKEN_FIELDS = ("k_codes", "k_norms", "k_qjl", "k_rnorms", "v_codes", "v_norms")

    k_codes: jax.Array
    k_norms: jax.Array
    k_qjl: jax.Array
    k_rnorms: jax.Array
    v_codes: jax.Array
    v_norms: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    bits: float = 4.0
    qjl: bool = False
    quantize_all: bool = False
    tile: int = 512
    impl: str = "auto"
    mesh: KernelMesh | None = None

    @property
    def key_parts(self) -> tuple[tq.Part, ...]:
        """The keys' coordinate split (with QJL the levels get bits - 1)."""
        return tq.bit_parts(self.bits - 1 if self.qjl else self.bits, self.head_dim)

    @property
    def value_parts(self) -> tuple[tq.Part, ...]:
        return tq.bit_parts(self.bits, self.head_dim)

    def encode_keys(self, consts: TurboQuantConsts, k: jax.Array):
        """k float[..., d] -> (packed codes, norm, qjl bits or None, residual norm or None,
        reconstruction float32[..., d] in rotated coordinates)."""
        dt = self.k_norms.dtype
        codes, norm, y = tq.encode(k, consts.rotation, self.key_parts, dt)
        rec = tq.decode_rotated(codes, norm, self.key_parts, self.head_dim)
        if not self.qjl:
            return tq.pack_parts(codes, self.key_parts), norm, None, None, rec
        bits, rn = tq.qjl_encode(y - rec, consts.qjl, dt)
        return tq.pack_parts(codes, self.key_parts), norm, bits, rn, rec + tq.qjl_decode_rotated(bits, rn, consts.qjl)

    def encode_values(self, consts: TurboQuantConsts, v: jax.Array):
        """v float[..., d] -> (packed codes, norm, reconstruction float32[..., d] rotated)."""
        codes, norm, _ = tq.encode(v, consts.rotation, self.value_parts, self.v_norms.dtype)
        return tq.pack_parts(codes, self.value_parts), norm, tq.decode_rotated(codes, norm, self.value_parts,
                                                                               self.head_dim)

    def attend(self, consts: TurboQuantConsts, q, k, v, lengths, n_new) -> tuple[jax.Array, Writes]:
        """q float[B, T, H, d] over the stored tokens and the new k, v (float[B, T, Hkv, d]).

        consts: this layer's TurboQuantConsts (rotation float32[d, d]). Returns (out float[B, T, H, d]
        in q.dtype, the writes of the new codes and exact rows).
        """
        b, t, _, d = q.shape
        t_max = self.max_len
        scale = 1.0 / math.sqrt(d)
        n_kept = kept_tokens(lengths, n_new, t_max)  # the rest are dropped everywhere
        pos, rows = token_rows(lengths, n_kept, t, t_max)
        lo, hi = self.code_region(pos, lengths + n_kept)
        kc, kn, kb, krn, k_rec = self.encode_keys(consts, k)  # [B, T, Hkv, ...]
        vc, vn, v_rec = self.encode_values(consts, v)
        rot = consts.rotation
        qr = jnp.einsum("bthj,ij->bthi", q.astype(jnp.float32), rot, precision=_HI)  # R q, once per call
        qs = None if not self.qjl else jnp.einsum("bthj,ij->bthi", qr, consts.qjl, precision=_HI)
        stored = turboquant_code_attention(
            qr, self.k_codes, self.k_norms, self.v_codes, self.v_norms, lo, jnp.minimum(hi, lengths[:, None]),
            key_parts=self.key_parts, value_parts=self.value_parts, impl=self.impl, mesh=self.mesh, scale=scale,
            qs=qs, k_qjl=self.k_qjl if self.qjl else None, k_rnorms=self.k_rnorms if self.qjl else None,
            tile=self.tile)
        fresh = tiled_dense_attention(qr, jnp.swapaxes(k_rec, 1, 2), jnp.swapaxes(v_rec, 1, 2),
                                      jnp.maximum(lo - lengths[:, None], 0), jnp.clip(hi - lengths[:, None], 0, t),
                                      scale=scale, return_lse=True)
        out_r, lse = merge_partials(*zip(stored, fresh))
        out = jnp.einsum("bthi,ij->bthj", out_r, rot, precision=_HI)  # back from rotated coordinates: R^T out'
        if self.has_exact:
            out_e, lse_e = self.exact_attention(q, k, v, lengths, n_kept, scale=scale)
            out, _ = merge_partials([out, out_e], [lse, lse_e])
        writes: Writes = {"k_codes": (rows, kc), "k_norms": (rows, kn), "v_codes": (rows, vc), "v_norms": (rows, vn),
                          **self.write_exact(k, v, lengths, n_kept)}
        if self.qjl:
            writes.update(k_qjl=(rows, kb), k_rnorms=(rows, krn))
        return out.astype(q.dtype), writes


@register_cache
@dataclasses.dataclass(frozen=True)
class TurboQuantCache(ExactWindowCache):
    """Calibration-free TurboQuant KV cache (module docstring); cache_consts: its TurboQuantConsts."""

    layers: TurboQuantLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, *,
               bits: float = 4, qjl: bool = False, window: int = 0, sinks: int = 0, dtype: Any = jnp.bfloat16,
               quantize_all: bool = False, tile: int = 512, impl: str = "auto") -> "TurboQuantCache":
        """An empty cache of ``bits`` per coordinate (:data:`~million_jax.quant.turboquant.TURBOQUANT_BITS`;
        with ``qjl`` the keys spend one of them on the residual's sign). Norms in ``dtype``.
        ``impl``: "auto" | "xla" | "pallas", as for a PQ cache (decode steps in the Pallas kernel;
        not with ``qjl``)."""
        b = tq.check_bits(bits, head_dim, qjl=qjl)
        check_impl(impl)
        if qjl and impl == "pallas":
            raise ValueError("impl='pallas' cannot run a turboquant cache with the QJL key residual (xla path only)")
        check_cache_args(dict(zip(CACHE_DIMS, (num_layers, batch, num_kv_heads, max_len, head_dim))), dtype,
                         window, sinks)
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile must be an int >= 1, got {tile!r}")
        lead = (num_layers, batch, num_kv_heads, max_len)
        kp = tq.bit_parts(b - 1 if qjl else b, head_dim)
        vp = tq.bit_parts(b, head_dim)
        z = lambda w, dt=jnp.uint8: jnp.zeros(lead + (w,), dt)  # noqa: E731
        layers = TurboQuantLayer(
            k_codes=z(tq.stored_bits(kp) // 8), k_norms=z(1, dtype),
            k_qjl=z(head_dim // 8 if qjl else 0), k_rnorms=z(1 if qjl else 0, dtype),
            v_codes=z(tq.stored_bits(vp) // 8), v_norms=z(1, dtype),
            bits=b, qjl=bool(qjl), quantize_all=quantize_all, tile=tile, impl=impl,
            **empty_window((num_layers, batch, num_kv_heads), sinks, window, head_dim, dtype))
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def bits_per_element(self) -> KVBits:
        """Bits per key / value element from the bytes stored per token: codes + norms (+ QJL bits
        and residual norms for keys). Exact sinks / window are fixed-size, not counted."""
        lay, d = self.layers, self.head_dim

        def per_token(*xs):
            return sum(8.0 * x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in xs) / d

        return KVBits(per_token(lay.k_codes, lay.k_norms, lay.k_qjl, lay.k_rnorms), per_token(lay.v_codes, lay.v_norms))

    def layer_consts(self, cache_consts: TurboQuantConsts | None = None) -> TurboQuantConsts:
        """The rotations (and QJL projections), checked against this cache."""
        if not isinstance(cache_consts, TurboQuantConsts):
            raise ValueError("TurboQuantCache needs its TurboQuantConsts passed as cache_consts "
                             "(million_jax.cache.turboquant_cache.turboquant_consts, or make_cache's second result)")
        L, d = self.num_layers, self.head_dim
        if tuple(cache_consts.rotation.shape) != (L, d, d):
            raise ValueError(f"turboquant rotation has shape {tuple(cache_consts.rotation.shape)}, the cache needs "
                             f"({L}, {d}, {d})")
        if self.layers.qjl != (cache_consts.qjl is not None):
            raise ValueError(f"the cache {'stores' if self.layers.qjl else 'has no'} QJL key residuals but the "
                             f"constants {'lack' if self.layers.qjl else 'hold'} QJL projections")
        if cache_consts.qjl is not None and tuple(cache_consts.qjl.shape) != (L, d, d):
            raise ValueError(f"turboquant QJL projection has shape {tuple(cache_consts.qjl.shape)}, the cache needs "
                             f"({L}, {d}, {d})")
        return cache_consts

    def dequantize(self, consts: TurboQuantConsts) -> tuple[jax.Array, jax.Array]:
        """(k_hat, v_hat) float32[L, B, Hkv, T_max, d] as the codes read back (rows >= lengths zeroed).

        For inspection and error measurement; attention never materialises this.
        """
        lay, d = self.layers, self.head_dim
        rot = consts.rotation[:, None, None, None]  # [L, 1, 1, 1, d, d]
        ky = tq.decode_rotated(tq.unpack_parts(lay.k_codes, lay.key_parts), lay.k_norms, lay.key_parts, d)
        if lay.qjl:
            ky = ky + tq.qjl_decode_rotated(lay.k_qjl, lay.k_rnorms, consts.qjl[:, None, None, None])
        vy = tq.decode_rotated(tq.unpack_parts(lay.v_codes, lay.value_parts), lay.v_norms, lay.value_parts, d)
        back = lambda y: jnp.einsum("...i,...ij->...j", y, rot, precision=_HI)  # noqa: E731
        live = (jnp.arange(self.max_len)[None, :] < self.lengths[:, None])[None, :, None, :, None]
        return jnp.where(live, back(ky), 0.0), jnp.where(live, back(vy), 0.0)

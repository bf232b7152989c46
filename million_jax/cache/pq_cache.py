"""PQCache: the KV cache stored as product-quantization codes.

State (``PQLayer``, stacked over layers; a registered dataclass pytree donated across steps):

    k_codes, v_codes:  uint8|uint16[L, B, Hkv, T_max, M]  every token, encoded at append
                       (M and nbits of keys and values may differ; codes of nbits other
                       than 8 are packed at their real width: uint8[..., ceil(M * nbits / 8)], see
                       :mod:`pallas_kernels.code_packing`; key codes of several widths,
                       ``PQCodebooks.key_parts``, in that layout: uint8[..., parts_width])
    sink_k, sink_v:    float[L, B, Hkv, S, d]              first S tokens, exact
    ring_k, ring_v:    float[L, B, Hkv, W, d]              last W tokens, exact (slot = pos % W)
    k_scales, v_scales: float16[L, B, Hkv, T_max, 1] or None  norm-explicit codebooks only
                       (``PQCodebooks.key_norms`` / ``value_norms``): |x| / |x_hat| per token,
                       multiplying its score / value wherever codes are read
    lengths:           int32[B]                            (on the PQCache)

Codebooks are NOT part of the state: they are a separate, constant
:class:`~million_jax.quant.kv_codebooks.PQCodebooks` passed as ``cache_consts`` (so donating the
cache never donates them), already laid out per layer. Keys are encoded after RoPE (MILLION),
so q . k is a LUT sum, or, with pre-RoPE codebooks (``PQCodebooks.key_rope == "pre"``),
before it: a new key is rotated back by its position and put in RoPE-pair layout
(:mod:`million_jax.rope`) before encoding, the query goes to the same layout, and the
attention paths rotate code row t by t * inv_freq (two lookup tables per pair); the exact
sinks / window keep the post-RoPE keys.

Key / value transforms of the codebooks (query-aware keys, output-aware values;
:mod:`million_jax.quant.kv_transforms`) are applied here and only here: new keys / values are
mapped before encoding, the query before the code attention and the code attention's output
after it, so the attention paths and the kernel see plain PQ. Residual codebooks
(``PQCodebooks.stages`` > 1, :mod:`million_jax.quant.residual_pq`) are handled here too: the stages'
codes sit side by side in k_codes / v_codes, the query is tiled over the stages and the output
folded back, so the attention paths again see plain PQ.

Each appended token is encoded once (constant cost per step, no flush spikes). Attention
(see :mod:`million_jax.cache.window`) reads sinks and the sliding window of the last W
positions exactly and everything else from codes (:mod:`million_jax.attention.pq_dispatch`
decides between the Pallas kernel and the xla path for the stored codes; the call's own
tokens are read from their decoded codes), merged by log-sum-exp. Attention reads the
cache as it was before the call; the new codes are written afterwards
(:mod:`million_jax.cache.base`).
``quantize_all=True`` is MILLION's evaluation protocol: every key/value, the current
token's included, is read from codes.

impl: "xla" (pure jnp, runs anywhere); "pallas" (decode steps use the fused kernel, an error
if it cannot run them, e.g. keys and values of different M; interpret mode off GPU; prefill
always takes the xla path); "auto" (the kernel for decode steps on GPU when it supports the shapes, else xla).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from million_jax import rope
from million_jax.attention.exact import tiled_dense_attention
from million_jax.cache.base import CACHE_DIMS, Writes, check_cache_args, kept_tokens, register_cache, token_rows
from million_jax.cache.window import ExactWindowCache, ExactWindowLayer, empty_window
from pallas_kernels.code_packing import (Parts, check_layout, check_layout_codes, is_packed, pack_codes, pack_layout,
                                         parts_width, stored_width)
from million_jax.attention.pq_dispatch import KernelMesh, check_impl, pq_code_attention
from million_jax.quant.kv_transforms import apply_head_transform
from million_jax.quant.pq import Codebooks, code_dtype, encode_parts
from million_jax.quant.kv_codebooks import NORM_SCALE_DTYPE, PQCodebooks, unit_vectors
from million_jax.quant.residual_pq import check_stages, encode_stages, fold_output, tile_query
from million_jax.quant.uniform import KVBits
from pallas_kernels.pq_math import gather_centroids, pair_freqs
from pallas_kernels.pq_math import rope_cos_sin as code_rope_cos_sin
from pallas_kernels.softmax import merge_partials

__all__ = ["PQCache", "PQLayer", "norm_scale", "norm_scales"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "v_codes", "sink_k", "sink_v", "ring_k", "ring_v", "k_scales", "v_scales"],
    meta_fields=["quantize_all", "impl", "mesh", "budgets"],
)
@dataclasses.dataclass(frozen=True)
class PQLayer(ExactWindowLayer):
    """One layer of a PQCache (module docstring; per layer the leading L axis is absent)."""

    TOKEN_FIELDS = ("k_codes", "v_codes", "k_scales", "v_scales")

    k_codes: jax.Array
    v_codes: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    k_scales: jax.Array | None = None  # norm-explicit keys only
    v_scales: jax.Array | None = None  # norm-explicit values only
    quantize_all: bool = False
    impl: str = "auto"
    mesh: KernelMesh | None = None
    # (key M, key nbits, value M, value nbits, residual stages, key parts) the codes were made for
    # (None: not recorded); a packed width alone cannot tell 4 x 3-bit codes from 2 x 5-bit ones
    budgets: tuple[int, int, int, int, int, Parts | None] | None = None

    def check_books(self, consts: PQCodebooks) -> PQCodebooks:
        """``consts``, if the stored codes fit them (width M, or M packed codes of nbits, and the
        dtype they make); else ValueError. Codes stacked [L, ...] or one layer's alike."""
        if consts.key_parts is not None:
            try:
                check_layout_codes(consts.key_parts, consts.key_M, self.k_codes.shape[-1], self.k_codes.dtype,
                                   "the cache's key codes", "the key codebook")
            except ValueError as e:
                raise ValueError(f"key codebooks of several widths do not match the cache: {e}; make the cache with "
                                 "PQCache.for_codebooks(codebooks, ...)") from None
        for name, books, codes in (("key", consts.key, self.k_codes), ("value", consts.value, self.v_codes)):
            if name == "key" and consts.key_parts is not None:
                continue
            m, nb, width = books.num_subspaces, books.nbits, codes.shape[-1]
            try:
                packed = is_packed(width, m, nb)
            except ValueError as e:
                raise ValueError(f"{name} codebooks (M={m}, nbits={nb}) do not match the cache: {e}") from None
            want = jnp.dtype(jnp.uint8) if packed else code_dtype(nb)
            if codes.dtype != want:
                raise ValueError(f"{name} codebooks (M={m}, nbits={nb}) do not match the cache "
                                 f"(codes {codes.dtype}[..., {width}])")
        for name, want, scales in (("key", consts.key_norms, self.k_scales), ("value", consts.value_norms,
                                                                             self.v_scales)):
            if want != (scales is not None):
                raise ValueError(f"the codebooks {'store' if want else 'have no'} explicit {name} norms but the "
                                 f"cache {'has no' if want else 'holds'} {name[0]}_scales: make the cache with "
                                 "PQCache.for_codebooks(codebooks, ...)")
        return consts

    def attend(self, consts: PQCodebooks, q, k, v, lengths, n_new) -> tuple[jax.Array, Writes]:
        """q float[B, T, H, d] over the stored tokens and the new k, v (float[B, T, Hkv, d]).

        consts: this layer's codebooks (centroids float32[G, M, K, dsub]). Stored codes are read
        by :func:`~million_jax.attention.pq_dispatch.pq_code_attention` (checked once, in ``layer_consts``); the call's own tokens are
        encoded, and where they fall in the code region read from their decoded codes.
        Returns (out float[B, T, H, d] in q.dtype, the writes of their codes and exact rows).
        """
        kcb, vcb = consts.key.centroids, consts.value.centroids
        b, t = q.shape[:2]
        t_max = self.max_len
        stages, scale = consts.stages, 1.0 / math.sqrt(q.shape[-1])
        # Tokens that would land past T_max are dropped everywhere (codes, ring, sinks).
        n_new = kept_tokens(lengths, n_new, t_max)
        pos, rows = token_rows(lengths, n_new, t, t_max)
        # None, or pre-RoPE keys: float32[S * M, P], P pairs per sub-space (per head group [G, M, 1])
        freqs = consts.key_subspace_freqs()
        k_enc, qc = k, q
        if freqs is not None:  # encode the keys rotated back to position 0, in RoPE-pair layout
            cos, sin = rope.rope_cos_sin(pos, consts.rope_inv_freq)  # [B, T, d/2]
            pairs = consts.key_rope_pairs
            # in float32: a bf16 key rounded again after the turn back would be coded off its own value
            k_enc = rope.to_pair_layout(rope.unrotate(k.astype(jnp.float32), cos[:, :, None], sin[:, :, None]), pairs)
            qc = rope.to_pair_layout(q, pairs)
            if consts.key_pair_order is not None:  # each head's pairs in its sub-spaces' order
                k_enc = rope.order_pairs(k_enc, consts.key_pair_order)
                qc = rope.order_pairs(qc, consts.key_pair_order)
        new_kc = _encode(consts.key, unit_vectors(k_enc) if consts.unit_codes and consts.key_norms else k_enc,
                         consts.key_transform, stages, consts.key_parts)  # [B, Hkv, T, Mk]
        new_vc = _encode(consts.value, unit_vectors(v) if consts.unit_codes and consts.value_norms else v,
                         consts.value_transform, stages)
        lo, hi = self.code_region(pos, lengths + n_new)
        qc = qc if consts.query_transform is None else apply_head_transform(qc, consts.query_transform)
        qc = tile_query(qc, stages)  # residual codes read as plain PQ (million_jax.quant.residual_pq)
        stored = pq_code_attention(qc, self.k_codes, self.v_codes, kcb, vcb, lo, jnp.minimum(hi, lengths[:, None]),
                                   impl=self.impl, mesh=self.mesh, scale=scale, rope_inv_freq=freqs,
                                   check_codes=False,  # checked once, in layer_consts
                                   k_parts=consts.key_parts,
                                   k_scales=self.k_scales, v_scales=self.v_scales)
        new_k = gather_centroids(kcb, new_kc)  # [B, Hkv, T, S * d]
        new_v = gather_centroids(vcb, new_vc)
        scale_writes: Writes = {}
        if consts.key_norms:  # A^-1 = (A^-T)^T maps a decoded key back to the model's space
            inv = None if consts.query_transform is None else jnp.swapaxes(consts.query_transform, -1, -2)
            ks = norm_scales(k_enc, new_k, inv, stages)  # [B, T, Hkv, 1]
            new_k = new_k * jnp.swapaxes(ks, 1, 2).astype(jnp.float32)
            scale_writes["k_scales"] = (rows, ks)
        if consts.value_norms:
            vs = norm_scales(v, new_v, consts.output_transform, stages)
            new_v = new_v * jnp.swapaxes(vs, 1, 2).astype(jnp.float32)
            scale_writes["v_scales"] = (rows, vs)
        if freqs is not None:  # the new tokens' decoded keys turned to their own positions,
            cos, sin = code_rope_cos_sin(pos, pair_freqs(freqs))  # [B, T, S * M * P] (or [G, B, T, M]),
            cos, sin = ((jnp.moveaxis(x, 0, 1) if freqs.ndim == 3 else x[:, None]) for x in (cos, sin))
            new_k = rope.rotate_pair_layout(new_k, cos, sin)  # the code paths' angles
        fresh = tiled_dense_attention(qc, new_k, new_v,
                                      jnp.maximum(lo - lengths[:, None], 0), jnp.clip(hi - lengths[:, None], 0, t),
                                      scale=scale, return_lse=True)
        out, lse = merge_partials(*zip(stored, fresh))
        out = fold_output(out, stages)
        if consts.output_transform is not None:
            out = apply_head_transform(out, consts.output_transform)
        if self.has_exact:
            out_e, lse_e = self.exact_attention(q, k, v, lengths, n_new)
            out, _ = merge_partials([out, out_e], [lse, lse_e])
        writes = {"k_codes": (rows, _stored_codes(new_kc, consts.key, self.k_codes.shape[-1], consts.key_parts)),
                  "v_codes": (rows, _stored_codes(new_vc, consts.value, self.v_codes.shape[-1])),
                  **scale_writes, **self.write_exact(k, v, lengths, n_new)}
        return out.astype(q.dtype), writes


def _encode(books: Codebooks, x: jax.Array, transform: jax.Array | None, stages: int,
            parts: Parts | None = None) -> jax.Array:
    """x float[B, T, Hkv, d] -> codes [B, Hkv, T, M] (transformed first; M counts all stages; codes
    of several widths ``parts``: each run searches its own centroids only)."""
    if transform is not None:
        x = apply_head_transform(x, transform)
    if parts is not None:
        return encode_parts(Codebooks(books.centroids), jnp.swapaxes(x, 1, 2), parts)
    return encode_stages(Codebooks(books.centroids), jnp.swapaxes(x, 1, 2), stages)


def norm_scales(x: jax.Array, decoded: jax.Array, inverse: jax.Array | None, stages: int) -> jax.Array:
    """Norm-explicit PQ: |x| / |x_hat| per vector, float16[B, T, Hkv, 1] (:func:`norm_scale`).

    x float[B, T, Hkv, d] as encoded (before any transform); decoded float32[B, Hkv, T, S * d] the
    gathered codes of its S stages (transformed space); inverse: the transform's inverse
    float[Gt, d, d] or None. Both norms are taken in the model's space.
    """
    rec = jnp.swapaxes(fold_output(decoded, stages), 1, 2)  # the stages summed: [B, T, Hkv, d]
    if inverse is not None:
        rec = apply_head_transform(rec, inverse)
    return norm_scale(x, rec)


def norm_scale(x: jax.Array, x_hat: jax.Array, dtype: Any = None) -> jax.Array:
    """|x| / |x_hat| float16[..., 1] of x, x_hat float[..., d] in the same space: the stored scale
    (1 where x_hat is 0; clipped to float16's largest finite value, never inf). ``dtype``: another
    storage dtype than ``NORM_SCALE_DTYPE`` (a benchmark's comparison)."""
    dtype = NORM_SCALE_DTYPE if dtype is None else dtype
    num = jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)
    den = jnp.linalg.norm(x_hat.astype(jnp.float32), axis=-1, keepdims=True)
    ratio = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)
    return jnp.minimum(ratio, float(jnp.finfo(dtype).max)).astype(dtype)


def _stored_codes(codes: jax.Array, books: Codebooks, width: int, parts: Parts | None = None) -> jax.Array:
    """codes [B, Hkv, T, M] -> [B, T, Hkv, width] as the cache stores them (packed if width says so;
    in the layout ``parts`` when given)."""
    codes = jnp.swapaxes(codes, 1, 2)
    if parts is not None:
        return pack_layout(codes, parts)
    return pack_codes(codes, books.nbits) if is_packed(width, books.num_subspaces, books.nbits) else codes


@register_cache
@dataclasses.dataclass(frozen=True)
class PQCache(ExactWindowCache):
    """Product-quantized KV cache (see module docstring); cache_consts: its PQCodebooks."""

    layers: PQLayer
    lengths: jax.Array

    @property
    def bits_per_element(self) -> KVBits:
        """Bits the stored codes take per key / value element: 8 * the code array's bytes per
        token / d (codes packed at their real width: ceil(M * nbits / 8) bytes; unpacked: M
        uint8 / uint16), plus the float16 norm scale of norm-explicit codebooks. The codebooks are
        constants, not counted (``PQCodebooks.nbytes``)."""
        d, lay = self.head_dim, self.layers

        def per_token(*xs):
            return sum(8.0 * x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in xs if x is not None) / d

        return KVBits(per_token(lay.k_codes, lay.k_scales), per_token(lay.v_codes, lay.v_scales))

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, *,
               M: int, nbits: int, window: int = 0, sinks: int = 0, dtype: Any = jnp.bfloat16,
               quantize_all: bool = False, impl: str = "auto", value_M: int | None = None,
               value_nbits: int | None = None, pack: bool = True, stages: int = 1, key_norms: bool = False,
               value_norms: bool = False, key_parts: Parts | None = None) -> "PQCache":
        """An empty cache; ``window`` (W) and ``sinks`` (S) may be 0.

        M / nbits are the keys' budget; value_M / value_nbits the values' (default: the keys').
        ``stages`` > 1: residual codebooks (:mod:`million_jax.quant.residual_pq`); M and value_M
        then count the codes of all stages (M / stages sub-vectors per stage).
        ``pack`` (default True): codes of nbits other than 8 stored packed at their real width
        (uint8[..., ceil(M * nbits / 8)]); False: one per uint8 (nbits < 8) / uint16 (nbits > 8).
        Every attention path, the Pallas kernel included, reads both layouts.
        ``key_norms`` / ``value_norms``: room for the per-token norm scales of norm-explicit codebooks.
        ``key_parts``: key codes of several widths (``PQCodebooks.key_parts``; their counts sum to M,
        the widest is ``nbits``), stored uint8[..., parts_width(key_parts)] whatever ``pack`` says.
        """
        check_cache_args(dict(zip(CACHE_DIMS, (num_layers, batch, num_kv_heads, max_len, head_dim))), dtype,
                         window, sinks)
        value_M = M if value_M is None else value_M
        value_nbits = nbits if value_nbits is None else value_nbits
        for name, m in (("M", M), ("value_M", value_M)):
            per_stage = check_stages(m, stages)
            if head_dim % per_stage:
                raise ValueError(f"head_dim {head_dim} is not divisible by {name}={m}"
                                 + (f" / stages={stages}" if stages > 1 else ""))
        check_impl(impl)
        if key_parts is not None:
            key_parts = check_layout(key_parts, M, nbits)
        lead = (num_layers, batch, num_kv_heads, max_len)

        def codes(m: int, nb: int) -> jax.Array:
            width = stored_width(m, nb, pack)
            return jnp.zeros(lead + (width,), jnp.uint8 if width != m else code_dtype(nb))

        # distinct buffers for every field: a donated pytree must not hold one buffer twice
        scales = lambda on: jnp.zeros(lead + (1,), NORM_SCALE_DTYPE) if on else None  # noqa: E731
        k_codes = codes(M, nbits) if key_parts is None else jnp.zeros(lead + (parts_width(key_parts),), jnp.uint8)
        layers = PQLayer(k_codes=k_codes, v_codes=codes(value_M, value_nbits), quantize_all=quantize_all,
                         k_scales=scales(key_norms), v_scales=scales(value_norms),
                         impl=impl, budgets=(M, nbits, value_M, value_nbits, stages, key_parts), **empty_window((num_layers, batch, num_kv_heads), sinks, window, head_dim, dtype))
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def for_codebooks(cls, codebooks: PQCodebooks, batch: int, num_kv_heads: int, max_len: int, **kw) -> "PQCache":
        """An empty cache whose L / M / nbits / head_dim match ``codebooks`` (checked)."""
        codebooks.check(codebooks.num_layers, num_kv_heads, codebooks.head_dim)
        return cls.create(codebooks.num_layers, batch, num_kv_heads, max_len, codebooks.head_dim,
                          M=codebooks.key_M, nbits=codebooks.key_nbits, value_M=codebooks.value_M,
                          value_nbits=codebooks.value_nbits, stages=codebooks.stages, key_norms=codebooks.key_norms,
                          value_norms=codebooks.value_norms, key_parts=codebooks.key_parts, **kw)

    def layer_consts(self, cache_consts: PQCodebooks | None = None) -> PQCodebooks:
        """The codebooks, checked against this cache (they are scanned with the layers).

        The one check of codes against codebooks on the model's path: the kernel dispatch plans
        from the shapes without checking them again (:mod:`million_jax.attention.pq_dispatch`).
        """
        if not isinstance(cache_consts, PQCodebooks):
            raise ValueError("PQCache needs its PQCodebooks passed as cache_consts")
        L, _, hkv = self.layers.k_codes.shape[:3]
        cache_consts.check(L, hkv, self.head_dim)
        books = (cache_consts.key_M, cache_consts.key_nbits, cache_consts.value_M, cache_consts.value_nbits,
                 cache_consts.stages, cache_consts.key_parts)
        if self.layers.budgets is not None and tuple(self.layers.budgets) != books:
            raise ValueError(f"codebooks (key M, nbits, value M, nbits, stages, key parts = {books}) do not match the cache "
                             f"({tuple(self.layers.budgets)})")
        return self.layers.check_books(cache_consts)

"""KiviCache: KIVI as published (Liu et al., ICML 2024), its full-precision recent tokens included.

Storage is :class:`~million_jax.cache.uniform_cache.UniformCache`'s ``kivi`` mode (keys per
channel in groups of G tokens, values per token in groups of min(G, d) channels, bits 2 / 4 / 8,
scale and zero in the cache dtype; math in :mod:`million_jax.quant.uniform`) plus an exact ring
of the last R + 1 keys and values. What differs is which tokens a query reads exactly, as
KIVI's own cache keeps them (R, the "residual length", a multiple of G):

    keys:    KIVI keeps the keys of the current, incomplete block of R tokens in full precision
             and quantizes a block (per channel, G tokens per group) once its R tokens are in;
             so a query at position p reads key s exactly iff  s >= floor(p / R) * R
             (between 1 and R keys), the older ones from codes;
    values:  KIVI quantizes a value (per token) when it leaves a sliding window of the last R;
             the query at p reads value s exactly iff  s >= p - R  (R + 1 values, its own
             included: KIVI appends the new token before it attends and evicts after).

Token s with p - R <= s < floor(p / R) * R thus has its key from codes and its value exact;
older tokens have both from codes. A prefill query reads what it would have read decoding
token by token, so one-shot prefill, chunked prefill and decoding agree. (KIVI itself runs its
prefill attention on the unquantized keys and values; the harness measures every query through
the cache, as for every other kind.)

``R = 0`` (``quantize_all``, the every-token-from-codes protocol) is the UniformCache ``kivi``
mode unchanged: each query reads its own group's keys with the group's prefix statistics.

Bits per element: keys ``bits + 2 * dtype_bits / G``, values ``bits + 2 * dtype_bits /
min(G, d)`` (codes + scale + zero); the exact ring and the key staging buffer are fixed-size
and only in ``nbytes``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.attention.exact import tiled_dense_attention
from million_jax.attention.layer_slice import take_rows
from million_jax.cache.base import CACHE_DIMS, Writes, check_cache_args, kept_tokens, register_cache, token_rows
from million_jax.cache.uniform_cache import _DATA, UniformCache, UniformLayer, _kivi_key_writes
from million_jax.cache.window import _ring_positions, empty_window
from million_jax.quant.uniform import (KVBits, check_mode, decode, dequantize_token_groups, pack, packed_width,
                                       quantize_token_groups, unpack)
from pallas_kernels.softmax import einsum_f32, group_heads, merge_partials, softmax_attention, ungroup_heads

__all__ = ["KiviCache", "KiviLayer", "check_kivi"]


def check_kivi(bits: int, group_size: int, residual: int, head_dim: int | None = None) -> None:
    """ValueError naming what is wrong with KIVI settings (bits 2/4/8, G >= 1, R = 0 or a multiple of G)."""
    check_mode("kivi", bits, group_size)
    if not isinstance(residual, int) or isinstance(residual, bool) or residual < 0:
        raise ValueError(f"KIVI's recent tokens R must be an int >= 0, got {residual!r}")
    if residual % group_size:
        raise ValueError(f"KIVI quantizes its keys in blocks of R recent tokens split into groups of G: R={residual} "
                         f"must be a multiple of the group size G={group_size}")
    if head_dim is not None:
        vg = min(group_size, head_dim)
        if head_dim % vg:
            raise ValueError(f"head_dim {head_dim} is not divisible by the value group {vg} (min(G, head_dim))")
        packed_width(head_dim, bits)


@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA,
                   meta_fields=["bits", "group_size", "mode", "quantize_all", "tile", "residual"])
@dataclasses.dataclass(frozen=True)
class KiviLayer(UniformLayer):
    """One layer of a KiviCache: a UniformLayer (kivi mode) read with KIVI's exact recent tokens."""

    residual: int = 0

    def attend(self, consts: Any, q, k, v, lengths, n_new) -> tuple[jax.Array, Writes]:
        """q float[B, T, H, d] over the stored tokens and the new k, v; consts: None."""
        if self.quantize_all or self.residual == 0:
            return super().attend(consts, q, k, v, lengths, n_new)
        b, t, _, d = q.shape
        t_max, r_len, g = self.max_len, self.residual, self.group_size
        dt = self.ring_k.dtype
        n_kept = kept_tokens(lengths, n_new, t_max)
        pos, rows = token_rows(lengths, n_kept, t, t_max)
        end = lengths + n_kept
        vgroup = d // self.v_scale.shape[-1]
        scale = 1.0 / math.sqrt(d)

        vc, vs, vz = quantize_token_groups(v.astype(dt), self.bits, vgroup, dt)  # [B, T, Hkv, ...]
        v_new = jnp.swapaxes(dequantize_token_groups(vc, vs, vz), 1, 2)  # [B, Hkv, T, d] as stored
        writes = dict(v_codes=(rows, pack(vc, self.bits)), v_scale=(rows, vs), v_zero=(rows, vz))
        key_writes, (_, _, _, kw, base) = _kivi_key_writes(self, k, lengths, end, bits=self.bits, group=g, dtype=dt)
        writes.update(key_writes)
        writes.update(self.write_exact(k, v, lengths, n_kept))

        # (1) keys and values both from codes: s < p - R (every such key's group is complete by p)
        both_hi = jnp.clip(pos - r_len, 0, end[:, None])  # [B, T], exclusive
        parts = [self._stored_attention(q, jnp.zeros_like(pos), jnp.minimum(both_hi, base[:, None]), scale)]
        nw = kw.shape[2]
        widx = base[:, None] + jnp.arange(nw, dtype=jnp.int32)[None, :]
        v_old = decode(unpack(take_rows(self.v_codes, widx), self.bits),
                       jnp.repeat(take_rows(self.v_scale, widx), vgroup, axis=-1),
                       jnp.repeat(take_rows(self.v_zero, widx), vgroup, axis=-1))
        vw = jnp.where((widx < lengths[:, None])[:, None, :, None], v_old, take_rows(v_new, widx - lengths[:, None]))
        parts.append(tiled_dense_attention(q.astype(jnp.float32), kw, vw, jnp.zeros_like(pos),
                                           jnp.clip(both_hi - base[:, None], 0, nw), scale=scale, return_lse=True))

        # (2) the last R + 1 tokens: values exact; keys exact from the current R-block on, else codes
        w = self.window  # R + 1 ring slots, as stored before this call
        ring_pos = _ring_positions(lengths, w)  # [B, W], -1 empty
        steps = jnp.arange(t, dtype=jnp.int32)[None, :]
        new_pos = jnp.where(steps < n_kept[:, None], pos, -1)
        kv_pos = jnp.concatenate([ring_pos, new_pos], axis=1)  # [B, W + T]
        k_ex = jnp.concatenate([self.ring_k.astype(jnp.float32), jnp.swapaxes(k, 1, 2).astype(dt).astype(jnp.float32)],
                               axis=2)
        v_ex = jnp.concatenate([self.ring_v.astype(jnp.float32), jnp.swapaxes(v, 1, 2).astype(dt).astype(jnp.float32)],
                               axis=2)
        # keys as their codes read back: stored final codes before the rewritten group, else this call's window
        sp = jnp.maximum(kv_pos, 0)
        k_old = decode(unpack(take_rows(self.k_codes, sp), self.bits), take_rows(self.k_scale, sp // g),
                       take_rows(self.k_zero, sp // g))
        k_hat = jnp.where((sp < base[:, None])[:, None, :, None], k_old, take_rows(kw, sp - base[:, None]))
        qg = group_heads(q.astype(jnp.float32), k_ex.shape[1])  # [B, Hkv, G, T, d]
        s_ex = einsum_f32("bkgtd,bksd->bkgts", qg, k_ex) * scale
        s_hat = einsum_f32("bkgtd,bksd->bkgts", qg, k_hat) * scale
        p_ = pos[:, :, None]
        s_ = kv_pos[:, None, :]
        block = (p_ // r_len) * r_len
        use_hat = (s_ < block)[:, None, None]
        mask = (s_ >= 0) & (s_ <= p_) & (s_ >= p_ - r_len)
        out_r, lse_r = softmax_attention(jnp.where(use_hat, s_hat, s_ex), mask[:, None, None], v_ex)
        parts.append((ungroup_heads(out_r), ungroup_heads(lse_r)))
        out, _ = merge_partials(*zip(*parts))
        return out.astype(q.dtype), writes


@register_cache
@dataclasses.dataclass(frozen=True)
class KiviCache(UniformCache):
    """KIVI as published (module docstring); no cache_consts."""

    layers: KiviLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, *,
               bits: int, group_size: int = 32, residual: int = 128, dtype: Any = jnp.bfloat16,
               quantize_all: bool = False, tile: int = 512) -> "KiviCache":
        """An empty cache: ``bits`` 2 / 4 / 8, G = ``group_size`` tokens per key stat (values:
        min(G, head_dim) channels per stat), R = ``residual`` exact recent tokens (a multiple of
        G; 0 or ``quantize_all``: every token from codes)."""
        residual = 0 if quantize_all else residual
        check_kivi(bits, group_size, residual, head_dim)
        check_cache_args(dict(zip(CACHE_DIMS, (num_layers, batch, num_kv_heads, max_len, head_dim))), dtype)
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile must be an int >= 1, got {tile!r}")
        g, vg = int(group_size), min(int(group_size), head_dim)
        lead = (num_layers, batch, num_kv_heads)
        pw = packed_width(head_dim, bits)
        z = lambda shape, dt=dtype: jnp.zeros(shape, dt)  # noqa: E731
        layers = KiviLayer(
            k_codes=z(lead + (max_len, pw), jnp.uint8), k_scale=z(lead + (-(-max_len // g), head_dim)),
            k_zero=z(lead + (-(-max_len // g), head_dim)), k_stage=z(lead + (g, head_dim)),
            v_codes=z(lead + (max_len, pw), jnp.uint8), v_scale=z(lead + (max_len, head_dim // vg)),
            v_zero=z(lead + (max_len, head_dim // vg)), bits=bits, group_size=g, mode="kivi",
            quantize_all=quantize_all, tile=tile, residual=residual,
            **empty_window(lead, 0, residual + 1 if residual else 0, head_dim, dtype))
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def residual(self) -> int:
        return self.layers.residual

    @property
    def bits_per_element(self) -> KVBits:
        """keys bits + 2 * dtype_bits / G, values bits + 2 * dtype_bits / min(G, d)."""
        lay, d = self.layers, self.head_dim
        sb = jnp.dtype(lay.ring_k.dtype).itemsize * 8
        return KVBits(float(lay.bits + 2 * sb / lay.group_size), float(lay.bits + 2 * sb / min(lay.group_size, d)))

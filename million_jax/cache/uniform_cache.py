"""UniformCache: KIVI-style asymmetric integer quantization of the KV cache (the baseline).

Modes (math in :mod:`million_jax.quant.uniform`):

    kivi        keys per channel in groups of G tokens, values per token in groups of
                G channels; bits 2, 4 or 8
    token       keys and values per token over all d channels; bits 2, 4 or 8
    int8_token  ``token`` with 8 bits (MaxText-style int8 kv_quant)

State (``UniformLayer``, stacked over layers; donated across decode steps), P = d*bits/8:

    k_codes, v_codes:  uint8[L, B, Hkv, T_max, P]     every token, packed along channels
    k_scale, k_zero:   dtype[L, B, Hkv, ceil(T_max/G), d]   (kivi)
                       dtype[L, B, Hkv, T_max, 1]           (token)
    v_scale, v_zero:   dtype[L, B, Hkv, T_max, d/G]   (kivi; d/d = 1 for token)
    k_stage:           dtype[L, B, Hkv, G, d]         exact keys of each sequence's last
                                                      key group (kivi; G = 0 for token)
    sink_k, sink_v:    dtype[L, B, Hkv, S, d]         first S tokens, exact
    ring_k, ring_v:    dtype[L, B, Hkv, W, d]         last W tokens, exact (slot = pos % W)
    lengths:           int32[B]

Append-time encoding, constant cost per step, no flush. Values are quantized
per token as they arrive. A key group's per-channel min/max needs all G tokens
of the group, so the exact keys of the current (last, possibly partial) group
are kept in ``k_stage``; on every append the touched groups are re-quantized
from the staged + new exact keys with their current min/max and their codes,
scale and zero rewritten. Once a group is full it is final. Every token is
therefore always readable from codes, which is what ``quantize_all`` needs.

Causality within a group: query p reads the keys of its own group g (tokens
g*G..p) quantized with the min/max of those tokens only (the group as it was
when p was appended), never with tokens after p. Complete earlier groups are
read from the stored codes. So a one-shot prefill, a chunked prefill and
token-by-token decoding give the same outputs and the same final state.
How: an append lays the staged keys and the new keys out as a window of the
touched groups (at most T + G - 1 rows), takes per-row prefix min/max inside
each group (cummin / cummax), stores each group with the stats of its last
row, and lets every query dequantize the <= G keys of its own group with the
stats of its own row: a small extra attention part (G*d work per query, run
in chunks of ``CURRENT_CHUNK`` queries; :mod:`million_jax.attention.uniform_xla`) merged by
log-sum-exp.

Attention for a query at position p: sinks (s < S) and the window
(p - W < s <= p) are exact (:mod:`million_jax.cache.window`); S <= s <= p - W
is read from codes, tiled over tokens under ``lax.scan`` with an online
softmax (one tile is dequantized at a time, fp32 accumulation); the parts are
merged by log-sum-exp. ``quantize_all=True`` reads every token from codes.

Tokens that do not fit (position >= T_max) are dropped everywhere, the exact
sinks and ring included. Memory: ``bits_per_element`` counts codes + scales +
zeros per K / V element; ``nbytes()`` counts every array (staging buffer,
sinks, ring and lengths included).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from million_jax.attention.exact import tiled_dense_attention
from million_jax.cache.base import (CACHE_DIMS, Writes, check_cache_args, kept_tokens, register_cache, token_rows,
                                    write_rows)
from million_jax.cache.window import ExactWindowCache, ExactWindowLayer, empty_window
from million_jax.attention.layer_slice import take_rows
from million_jax.attention.uniform_xla import current_group_attention, uniform_attention_xla
from million_jax.quant.uniform import (
    KVBits,
    bits_per_element,
    check_settings,
    decode,
    dequantize_token_groups,
    encode,
    expand_stats,
    pack,
    packed_width,
    quantize_token_groups,
    scale_zero,
    unpack,
)
from pallas_kernels.softmax import merge_partials

__all__ = ["UniformCache", "UniformLayer"]


# ------------------------------------------------------------------ appending keys (kivi)
def _kivi_key_writes(layer, k, lengths, end, *, bits, group, dtype):
    """The writes that re-quantize the key groups touched by this append from staged + new
    exact keys, and the window of those groups for attention.

    layer: the UniformLayer as stored before this call (k_stage read); k: float[B, T, Hkv, d];
    lengths: int32[B] before the append; end: int32[B] = min(lengths + n_new, T_max).
    Returns (writes, window): window = (xw, ps, pz, kw, base) with xw float32[B, Hkv, NW, d] the
    exact keys of the touched groups (row r is position base + r), ps / pz their prefix
    stats (feeds :func:`~million_jax.attention.uniform_xla.current_group_attention`) and kw
    float32[B, Hkv, NW, d] the keys as their codes will read back (final stats of each group).
    """
    k_stage = layer.k_stage
    b, t = k.shape[:2]
    hkv, t_max = layer.k_codes.shape[1:3]
    g = group
    n_blocks = (t + g - 2) // g + 1  # groups one call can touch
    nw = n_blocks * g
    a = lengths % g  # tokens of the current group already stored
    base = lengths - a  # its first position
    nvalid = end - base  # window rows r < nvalid hold real tokens
    wrote = end > lengths
    r = jnp.arange(nw, dtype=jnp.int32)

    keep = (r[:g][None, :] < a[:, None])[:, None, :, None]
    xw = jnp.zeros((b, hkv, nw, k.shape[-1]), dtype)
    xw = xw.at[:, :, :g].set(jnp.where(keep, k_stage, jnp.zeros_like(k_stage)))
    steps = jnp.arange(t, dtype=jnp.int32)
    new_rows = jnp.where(base[:, None] + a[:, None] + steps[None, :] < end[:, None], a[:, None] + steps[None, :], nw)
    xw = write_rows(xw, new_rows, k)  # cast to dtype: the same bits whether staged or new
    xf = xw.astype(jnp.float32)

    blocks = xf.reshape(b, hkv, n_blocks, g, -1)
    mn = jax.lax.cummin(blocks, axis=3).reshape(xf.shape)
    mx = jax.lax.cummax(blocks, axis=3).reshape(xf.shape)
    ps, pz = scale_zero(mn, mx, bits, dtype)  # prefix stats of every row [B, Hkv, NW, d]

    j = jnp.arange(n_blocks, dtype=jnp.int32)
    last = j[None, :] * g + jnp.clip(nvalid[:, None] - 1 - j[None, :] * g, 0, g - 1)  # [B, nb]
    bs, bz = take_rows(ps, last), take_rows(pz, last)  # final stats of each touched group
    block_ok = wrote[:, None] & (j[None, :] * g < nvalid[:, None])
    n_groups = layer.k_scale.shape[2]
    grow = jnp.where(block_ok, base[:, None] // g + j[None, :], n_groups)
    rs, rz = jnp.repeat(bs, g, axis=2), jnp.repeat(bz, g, axis=2)
    codes = encode(xf, rs, rz, bits)
    crow = jnp.where(wrote[:, None] & (r[None, :] < nvalid[:, None]), base[:, None] + r[None, :], t_max)

    jl = jnp.maximum(nvalid - 1, 0) // g
    sidx = jl[:, None] * g + jnp.arange(g, dtype=jnp.int32)[None, :]
    new_stage = jnp.where((sidx < nvalid[:, None])[:, None, :, None], take_rows(xw, sidx), jnp.zeros((), dtype))
    writes = dict(k_codes=(crow, jnp.swapaxes(pack(codes, bits), 1, 2)),
                  k_scale=(grow, jnp.swapaxes(bs, 1, 2)), k_zero=(grow, jnp.swapaxes(bz, 1, 2)),
                  k_stage=jnp.where(wrote[:, None, None, None], new_stage, k_stage))
    return writes, (xf, ps, pz, decode(codes, rs, rz), base)


# ------------------------------------------------------------------ the cache
_DATA = ["k_codes", "k_scale", "k_zero", "k_stage", "v_codes", "v_scale", "v_zero",
         "sink_k", "sink_v", "ring_k", "ring_v"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=_DATA,
    meta_fields=["bits", "group_size", "mode", "quantize_all", "tile"],
)
@dataclasses.dataclass(frozen=True)
class UniformLayer(ExactWindowLayer):
    """One layer of a UniformCache (module docstring; per layer the leading L axis is absent)."""

    TOKEN_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    k_stage: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    bits: int = 4
    group_size: int = 32
    mode: str = "kivi"
    quantize_all: bool = False
    tile: int = 512

    @property
    def kivi(self) -> bool:
        return self.mode == "kivi"

    @property
    def key_rows(self) -> int:
        """Tokens sharing one key stat: G (kivi) or 1 (token)."""
        return self.group_size if self.kivi else 1

    def attend(self, consts: Any, q, k, v, lengths, n_new) -> tuple[jax.Array, Writes]:
        """q float[B, T, H, d] over the stored tokens and the new k, v (float[B, T, Hkv, d]);
        consts: None. Returns (out float[B, T, H, d] in q.dtype, the writes of the new codes).
        """
        b, t, _, d = q.shape
        t_max = self.max_len
        dt = self.ring_k.dtype
        n_kept = kept_tokens(lengths, n_new, t_max)  # the rest are dropped everywhere
        pos, rows = token_rows(lengths, n_kept, t, t_max)
        end = lengths + n_kept
        vgroup = d // self.v_scale.shape[-1]
        scale = 1.0 / math.sqrt(d)
        lo, hi = self.code_region(pos, end)  # code region per query: [lo, hi)

        vc, vs, vz = quantize_token_groups(v.astype(dt), self.bits, vgroup, dt)  # [B, T, Hkv, ...]
        v_new = jnp.swapaxes(dequantize_token_groups(vc, vs, vz), 1, 2)  # [B, Hkv, T, d] as stored
        writes = dict(v_codes=(rows, pack(vc, self.bits)), v_scale=(rows, vs), v_zero=(rows, vz))
        parts = []
        if self.kivi:
            key_writes, (xw, ps, pz, kw, base) = _kivi_key_writes(
                self, k, lengths, end, bits=self.bits, group=self.group_size, dtype=dt)
            writes.update(key_writes)
            # stored groups that were complete before this call come from their codes
            group_start = (pos // self.group_size) * self.group_size
            parts.append(self._stored_attention(q, lo, jnp.minimum(hi, base[:, None]), scale))
            # values of the touched groups' rows: stored before this call, or new
            widx = base[:, None] + jnp.arange(xw.shape[2], dtype=jnp.int32)[None, :]
            v_old = decode(unpack(take_rows(self.v_codes, widx), self.bits),
                           jnp.repeat(take_rows(self.v_scale, widx), vgroup, axis=-1),
                           jnp.repeat(take_rows(self.v_zero, widx), vgroup, axis=-1))
            is_old = (widx < lengths[:, None])[:, None, :, None]
            vw = jnp.where(is_old, v_old, take_rows(v_new, widx - lengths[:, None]))
            if xw.shape[2] > self.group_size:  # groups completed within this call (prefill)
                parts.append(tiled_dense_attention(
                    q.astype(jnp.float32), kw, vw, jnp.maximum(lo - base[:, None], 0),
                    jnp.clip(jnp.minimum(hi, group_start) - base[:, None], 0, xw.shape[2]),
                    scale=scale, return_lse=True))
            parts.append(current_group_attention(q, xw, ps, pz, vw, pos - base[:, None], base, lo, hi,
                                                 bits=self.bits, group=self.group_size, scale=scale))
        else:
            kc, ks, kz = quantize_token_groups(k.astype(dt), self.bits, d, dt)
            writes.update(k_codes=(rows, pack(kc, self.bits)), k_scale=(rows, ks), k_zero=(rows, kz))
            parts.append(self._stored_attention(q, lo, jnp.minimum(hi, lengths[:, None]), scale))
            k_new = jnp.swapaxes(dequantize_token_groups(kc, ks, kz), 1, 2)
            parts.append(tiled_dense_attention(
                q.astype(jnp.float32), k_new, v_new, jnp.maximum(lo - lengths[:, None], 0),
                jnp.clip(hi - lengths[:, None], 0, t), scale=scale, return_lse=True))
        if self.has_exact:
            parts.append(self.exact_attention(q, k, v, lengths, n_kept, scale=scale))
        writes.update(self.write_exact(k, v, lengths, n_kept))
        out, _ = merge_partials(*zip(*parts))
        return out.astype(q.dtype), writes

    def _stored_attention(self, q, lo, hi, scale):
        """(out, lse) of q over the stored codes of tokens lo <= s < hi (int32[B, T])."""
        return uniform_attention_xla(q, self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                                 self.v_zero, lo, hi, bits=self.bits, key_rows=self.key_rows, tile=self.tile,
                                 scale=scale)


@register_cache
@dataclasses.dataclass(frozen=True)
class UniformCache(ExactWindowCache):
    """Uniform (KIVI-style / per-token) integer KV cache (module docstring); no cache_consts."""

    layers: UniformLayer
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, *,
               bits: int, group_size: int = 32, mode: str = "kivi", window: int = 0, sinks: int = 0,
               dtype: Any = jnp.bfloat16, quantize_all: bool = False, tile: int = 512) -> "UniformCache":
        """An empty cache. ``window`` (W) and ``sinks`` (S) may be 0.

        kivi: G = ``group_size`` tokens per key stat and channels per value stat
        (head_dim must be divisible by it). token / int8_token: one stat per
        token over all head_dim channels (``group_size`` unused).
        ``tile``: tokens dequantized per attention step (rounded up to a multiple of G).
        """
        check_settings(mode, bits, group_size, head_dim)
        check_cache_args(dict(zip(CACHE_DIMS, (num_layers, batch, num_kv_heads, max_len, head_dim))), dtype,
                         window, sinks)
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        kivi = mode == "kivi"
        g = int(group_size) if kivi else head_dim
        lead = (num_layers, batch, num_kv_heads)
        pw = packed_width(head_dim, bits)
        k_stats = lead + ((-(-max_len // g), head_dim) if kivi else (max_len, 1))
        v_stats = lead + (max_len, head_dim // g)
        z = lambda shape, dt=dtype: jnp.zeros(shape, dt)  # noqa: E731
        layers = UniformLayer(
            k_codes=z(lead + (max_len, pw), jnp.uint8),
            k_scale=z(k_stats),
            k_zero=z(k_stats),
            k_stage=z(lead + ((g if kivi else 0), head_dim)),
            v_codes=z(lead + (max_len, pw), jnp.uint8),
            v_scale=z(v_stats),
            v_zero=z(v_stats),
            bits=bits,
            group_size=g,
            mode=mode,
            quantize_all=quantize_all,
            tile=tile,
            **empty_window(lead, sinks, window, head_dim, dtype),
        )
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def bits_per_element(self) -> KVBits:
        """Bits per key / value element: codes + scales + zeros (fixed-size parts excluded)."""
        lay = self.layers
        gs = lay.group_size if lay.kivi else self.head_dim
        return bits_per_element(lay.mode, lay.bits, gs, self.head_dim, lay.ring_k.dtype)

    def dequantize(self) -> tuple[jax.Array, jax.Array]:
        """(k_hat, v_hat) float32[L, B, Hkv, T_max, d] as stored in codes (rows >= lengths zeroed).

        For inspection and error measurement; attention never materialises this.
        """
        lay = self.layers
        n, d = self.max_len, self.head_dim
        kc = d // lay.k_scale.shape[-1]
        vc = d // lay.v_scale.shape[-1]
        kh = decode(unpack(lay.k_codes, lay.bits), expand_stats(lay.k_scale, lay.key_rows, kc, n, d),
                    expand_stats(lay.k_zero, lay.key_rows, kc, n, d))
        vh = decode(unpack(lay.v_codes, lay.bits), expand_stats(lay.v_scale, 1, vc, n, d),
                    expand_stats(lay.v_zero, 1, vc, n, d))
        live = (jnp.arange(n)[None, :] < self.lengths[:, None])[None, :, None, :, None]
        return jnp.where(live, kh, 0.0), jnp.where(live, vh, 0.0)

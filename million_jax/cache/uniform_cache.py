"""UniformCache: KIVI-style asymmetric integer quantization of the KV cache (the baseline).

Modes (math in :mod:`million_jax.uniform_quant`):

    kivi        keys per channel in groups of G tokens, values per token in groups of
                G channels; bits 2, 4 or 8
    token       keys and values per token over all d channels; bits 2, 4 or 8
    int8_token  ``token`` with 8 bits (MaxText-style int8 kv_quant)

State (a registered dataclass pytree, donated across decode steps), P = d*bits/8:

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
in chunks of ``CURRENT_CHUNK`` queries) merged by log-sum-exp.

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

from million_jax.attention import merge_attention
from million_jax.cache.base import CodesWithWindow
from million_jax.cache.window import exact_window_attention, write_rows, write_window
from million_jax.online_softmax import pad_rows, softmax_finish, softmax_init, softmax_step, to_tiles
from million_jax.uniform_quant import (
    KVBits,
    bits_per_element,
    check_settings,
    decode,
    encode,
    expand_stats,
    pack,
    packed_width,
    quantize_token_groups,
    scale_zero,
    unpack,
)

__all__ = ["UniformCache", "uniform_attention"]

# Queries per lax.map step of the current-group attention (bounds its memory
# to CURRENT_CHUNK * B * Hkv * G * d floats during a long prefill).
CURRENT_CHUNK = 64


# ------------------------------------------------------------------ attention over codes
def uniform_attention(
    q: jax.Array,
    k_codes: jax.Array,
    k_scale: jax.Array,
    k_zero: jax.Array,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    bits: int,
    key_rows: int,
    tile: int = 512,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over tokens stored as uniform codes, one tile at a time.

    q:                 float[B, T, H, d]        (GQA: head h reads KV head h // (H/Hkv))
    k_codes, v_codes:  uint8[B, Hkv, N, d*bits/8]
    k_scale, k_zero:   float[B, Hkv, ceil(N/key_rows), d/kc]  key_rows tokens x kc channels
                       share a stat (kivi: key_rows=G, kc=1; token: 1, d)
    v_scale, v_zero:   float[B, Hkv, N, d/vc]   per token, vc channels share a stat
    lo, hi:            int32[B, T]              query t sees tokens lo <= s < hi
    Returns (out float32[B, T, H, d], lse float32[B, T, H]); 0 / -inf for a query
    that sees no token. Only one tile of ``tile`` tokens is dequantized at a time.
    """
    b, t, h, d = q.shape
    hkv, n = k_codes.shape[1:3]
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    grp = h // hkv
    kc, vc = d // k_scale.shape[-1], d // v_scale.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tile = -(-max(1, min(tile, n)) // key_rows) * key_rows
    n_tiles = -(-n // tile)
    n_all = n_tiles * tile
    xs = (
        jnp.arange(n_tiles, dtype=jnp.int32),
        to_tiles(pad_rows(k_codes, n_all), n_tiles),
        to_tiles(pad_rows(k_scale, n_all // key_rows), n_tiles),
        to_tiles(pad_rows(k_zero, n_all // key_rows), n_tiles),
        to_tiles(pad_rows(v_codes, n_all), n_tiles),
        to_tiles(pad_rows(v_scale, n_all), n_tiles),
        to_tiles(pad_rows(v_zero, n_all), n_tiles),
    )
    qg = q.astype(jnp.float32).reshape(b, t, hkv, grp, d)

    def body(carry, x):
        i, kct, kst, kzt, vct, vst, vzt = x
        kx = lambda st: expand_stats(st, key_rows, kc, tile, d)  # noqa: E731
        vx = lambda st: expand_stats(st, 1, vc, tile, d)  # noqa: E731
        kd = decode(unpack(kct, bits), kx(kst), kx(kzt))  # [B, Hkv, tile, d] f32, this tile only
        vd = decode(unpack(vct, bits), vx(vst), vx(vzt))
        scores = jnp.einsum("btkgd,bksd->bkgts", qg, kd) * scale  # [B, Hkv, g, T, tile]
        s_pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
        vis = (s_pos[None, None, :] >= lo[:, :, None]) & (s_pos[None, None, :] < hi[:, :, None])
        return softmax_step(carry, scores, vis[:, None, None], vd), None

    carry, _ = jax.lax.scan(body, softmax_init(b, hkv, grp, t, d), xs)
    return softmax_finish(carry, b, t, h, d)


def _rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, Hkv, N, d], idx int[B, R] -> x[b, :, idx[b]] as [B, Hkv, R, d] (idx clipped)."""
    idx = jnp.clip(idx, 0, x.shape[2] - 1)
    return jnp.take_along_axis(x, idx[:, None, :, None], axis=2, mode="promise_in_bounds")


def _current_group_attention(q, xw, ps, pz, vw, offs, base, lo, hi, *, bits, group, scale):
    """Attention of each query over its own key group with the group's prefix statistics.

    q:       float[B, T, H, d]
    xw:      float32[B, Hkv, NW, d]  exact keys, window layout: row r is position base + r
    ps, pz:  dtype[B, Hkv, NW, d]    scale / zero of the group of row r over its rows <= r
    vw:      float32[B, Hkv, NW, d]  dequantized values of the same rows
    offs:    int32[B, T]             window row of each query (its position - base)
    base:    int32[B]                position of window row 0 (a multiple of G)
    lo, hi:  int32[B, T]             code region; this part covers max(lo, group start) <= s < hi
    Returns (out float32[B, T, H, d], lse float32[B, T, H]).
    """
    b, t, h, d = q.shape
    hkv = xw.shape[1]
    grp = h // hkv
    steps = jnp.arange(group, dtype=jnp.int32)

    def one(x):
        qt, o, lo_t, hi_t = x  # [B, H, d], [B], [B], [B]
        start = (o // group) * group
        idx = start[:, None] + steps[None, :]  # [B, G]
        sc = _rows(ps, o[:, None])  # [B, Hkv, 1, d]
        ze = _rows(pz, o[:, None])
        kd = decode(encode(_rows(xw, idx), sc, ze, bits), sc, ze)  # [B, Hkv, G, d]
        vd = _rows(vw, idx)
        spos = base[:, None] + idx
        vis = (spos >= jnp.maximum(lo_t, base + start)[:, None]) & (spos < hi_t[:, None])  # [B, G]
        scores = jnp.einsum("bkgd,bksd->bkgs", qt.astype(jnp.float32).reshape(b, hkv, grp, d), kd) * scale
        vis = vis[:, None, None, :]
        scores = jnp.where(vis, scores, -jnp.inf)
        mx = jnp.max(scores, axis=-1)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        p = jnp.where(vis, jnp.exp(scores - mx[..., None]), 0.0)
        den = jnp.sum(p, axis=-1)
        out = jnp.einsum("bkgs,bksd->bkgd", p, vd) / jnp.where(den > 0, den, 1.0)[..., None]
        lse = jnp.where(den > 0, mx + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
        return out.reshape(b, h, d), lse.reshape(b, h)

    xs = (jnp.swapaxes(q, 0, 1), offs.T, lo.T, hi.T)
    if t <= CURRENT_CHUNK:
        out, lse = jax.vmap(one)(xs)
    else:
        out, lse = jax.lax.map(one, xs, batch_size=CURRENT_CHUNK)
    return jnp.swapaxes(out, 0, 1), jnp.swapaxes(lse, 0, 1)


# ------------------------------------------------------------------ appending keys (kivi)
def _append_kivi_keys(state, k, lengths, end, *, bits, group, dtype):
    """Re-quantize the key groups touched by this append from staged + new exact keys.

    state: the layer dict (k_codes, k_scale, k_zero, k_stage); k: float[B, T, Hkv, d];
    lengths: int32[B] before the append; end: int32[B] = min(lengths + n_new, T_max).
    Returns (updated entries, window) where window = (xw, ps, pz, base) feeds
    :func:`_current_group_attention`.
    """
    k_codes, k_stage = state["k_codes"], state["k_stage"]
    b, t = k.shape[:2]
    hkv, t_max = k_codes.shape[1:3]
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
    bs, bz = _rows(ps, last), _rows(pz, last)  # final stats of each touched group
    block_ok = wrote[:, None] & (j[None, :] * g < nvalid[:, None])
    n_groups = state["k_scale"].shape[2]
    grow = jnp.where(block_ok, base[:, None] // g + j[None, :], n_groups)
    k_scale = write_rows(state["k_scale"], grow, jnp.swapaxes(bs, 1, 2))
    k_zero = write_rows(state["k_zero"], grow, jnp.swapaxes(bz, 1, 2))

    codes = encode(xf, jnp.repeat(bs, g, axis=2), jnp.repeat(bz, g, axis=2), bits)
    crow = jnp.where(wrote[:, None] & (r[None, :] < nvalid[:, None]), base[:, None] + r[None, :], t_max)
    k_codes = write_rows(k_codes, crow, jnp.swapaxes(pack(codes, bits), 1, 2))

    jl = jnp.maximum(nvalid - 1, 0) // g
    sidx = jl[:, None] * g + jnp.arange(g, dtype=jnp.int32)[None, :]
    new_stage = jnp.where((sidx < nvalid[:, None])[:, None, :, None], _rows(xw, sidx), jnp.zeros((), dtype))
    k_stage = jnp.where(wrote[:, None, None, None], new_stage, k_stage)
    upd = dict(k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, k_stage=k_stage)
    return upd, (xf, ps, pz, base)


# ------------------------------------------------------------------ the cache
_DATA = ["k_codes", "k_scale", "k_zero", "k_stage", "v_codes", "v_scale", "v_zero",
         "sink_k", "sink_v", "ring_k", "ring_v", "lengths"]
_STATE = _DATA[:-1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=_DATA,
    meta_fields=["bits", "group_size", "mode", "quantize_all", "tile"],
)
@dataclasses.dataclass(frozen=True)
class UniformCache(CodesWithWindow):
    """Uniform (KIVI-style / per-token) integer KV cache (see module docstring for shapes).

    Per-layer state handed to ``attend`` is a dict of the ``_STATE`` arrays without
    the leading L axis; this cache needs no ``cache_consts`` (pass None).
    """

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
    lengths: jax.Array
    bits: int = 4
    group_size: int = 32
    mode: str = "kivi"
    quantize_all: bool = False
    tile: int = 512

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        bits: int,
        group_size: int = 32,
        mode: str = "kivi",
        window: int = 0,
        sinks: int = 0,
        dtype: Any = jnp.bfloat16,
        quantize_all: bool = False,
        tile: int = 512,
    ) -> "UniformCache":
        """An empty cache. ``window`` (W) and ``sinks`` (S) may be 0.

        kivi: G = ``group_size`` tokens per key stat and channels per value stat
        (head_dim must be divisible by it). token / int8_token: one stat per
        token over all head_dim channels (``group_size`` unused).
        ``tile``: tokens dequantized per attention step (rounded up to a multiple of G).
        """
        check_settings(mode, bits, group_size, head_dim)
        sizes = dict(num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len)
        for name, val in sizes.items():
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if window < 0 or sinks < 0:
            raise ValueError(f"window and sinks must be >= 0, got window={window}, sinks={sinks}")
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ValueError(f"dtype must be a floating type, got {dtype}")
        kivi = mode == "kivi"
        g = int(group_size) if kivi else head_dim
        lead = (num_layers, batch, num_kv_heads)
        pw = packed_width(head_dim, bits)
        k_stats = lead + ((-(-max_len // g), head_dim) if kivi else (max_len, 1))
        v_stats = lead + (max_len, head_dim // g)
        z = lambda shape, dt=dtype: jnp.zeros(shape, dt)  # noqa: E731
        return cls(
            k_codes=z(lead + (max_len, pw), jnp.uint8),
            k_scale=z(k_stats),
            k_zero=z(k_stats),
            k_stage=z(lead + ((g if kivi else 0), head_dim)),
            v_codes=z(lead + (max_len, pw), jnp.uint8),
            v_scale=z(v_stats),
            v_zero=z(v_stats),
            sink_k=z(lead + (sinks, head_dim)),
            sink_v=z(lead + (sinks, head_dim)),
            ring_k=z(lead + (window, head_dim)),
            ring_v=z(lead + (window, head_dim)),
            lengths=jnp.zeros((batch,), jnp.int32),
            bits=bits,
            group_size=g,
            mode=mode,
            quantize_all=quantize_all,
            tile=tile,
        )

    # --- shape info -----------------------------------------------------------------





    @property
    def dtype(self) -> Any:
        return self.ring_k.dtype

    @property
    def kivi(self) -> bool:
        return self.mode == "kivi"

    @property
    def key_rows(self) -> int:
        """Tokens sharing one key stat: G (kivi) or 1 (token)."""
        return self.group_size if self.kivi else 1

    @property
    def bits_per_element(self) -> KVBits:
        """Bits per key / value element: codes + scales + zeros (fixed-size parts excluded)."""
        gs = self.group_size if self.kivi else self.head_dim
        return bits_per_element(self.mode, self.bits, gs, self.head_dim, self.dtype)

    def bytes_per_token(self) -> float:
        """Bytes per token over all layers and KV heads of keys + values (codes + stats)."""
        L, _, hkv = self.k_codes.shape[:3]
        return L * hkv * self.head_dim * (self.bits_per_element.key + self.bits_per_element.value) / 8

    # --- protocol -------------------------------------------------------------------
    def layer_slices(self, cache_consts: Any = None) -> tuple[dict[str, jax.Array], None]:
        """({name: [L, ...]} for the state arrays, None)."""
        if cache_consts is not None:
            raise ValueError("UniformCache takes no cache_consts (pass None)")
        return {name: getattr(self, name) for name in _STATE}, None

    def attend(self, state, const, q, k, v, n_new):
        """Append k, v (float[B, T, Hkv, d]) to one layer and attend q float[B, T, H, d].

        Returns (out float[B, T, H, d] in q.dtype, new layer state).
        """
        b, t = q.shape[:2]
        d = q.shape[-1]
        t_max = self.max_len
        dt = state["ring_k"].dtype
        lengths = self.lengths
        n_new = n_new.astype(jnp.int32)
        steps = jnp.arange(t, dtype=jnp.int32)
        pos = lengths[:, None] + steps[None, :]  # [B, T]
        real = steps[None, :] < n_new[:, None]
        rows = jnp.where(real, pos, t_max)
        end = jnp.minimum(lengths + n_new, t_max)
        n_kept = end - lengths  # new tokens that fit; the rest are dropped everywhere
        vgroup = d // state["v_scale"].shape[-1]

        new = dict(state)
        vc, vs, vz = quantize_token_groups(v.astype(dt), self.bits, vgroup, dt)  # [B, T, Hkv, ...]
        new["v_codes"] = write_rows(state["v_codes"], rows, pack(vc, self.bits))
        new["v_scale"] = write_rows(state["v_scale"], rows, vs)
        new["v_zero"] = write_rows(state["v_zero"], rows, vz)
        if self.kivi:
            upd, window = _append_kivi_keys(state, k, lengths, end, bits=self.bits, group=self.group_size, dtype=dt)
            new.update(upd)
        else:
            kc, ks, kz = quantize_token_groups(k.astype(dt), self.bits, d, dt)
            new["k_codes"] = write_rows(state["k_codes"], rows, pack(kc, self.bits))
            new["k_scale"] = write_rows(state["k_scale"], rows, ks)
            new["k_zero"] = write_rows(state["k_zero"], rows, kz)
        ring_k_before, ring_v_before = state["ring_k"], state["ring_v"]
        new["sink_k"], new["sink_v"], new["ring_k"], new["ring_v"] = write_window(
            state["sink_k"], state["sink_v"], ring_k_before, ring_v_before, k, v, lengths, n_kept
        )

        # Code region per query: [lo, hi).
        if self.quantize_all:
            lo = jnp.zeros_like(pos)
            hi = jnp.minimum(pos + 1, end[:, None])
        else:
            lo = jnp.full_like(pos, self.sinks)
            hi = jnp.minimum(pos + 1 - self.window, end[:, None])
        scale = 1.0 / math.sqrt(d)
        # Complete groups (and, in token mode, everything) come from the stored codes.
        hi_main = jnp.minimum(hi, (pos // self.group_size) * self.group_size) if self.kivi else hi
        out, lse = uniform_attention(
            q, new["k_codes"], new["k_scale"], new["k_zero"], new["v_codes"], new["v_scale"], new["v_zero"],
            lo, hi_main, bits=self.bits, key_rows=self.key_rows, tile=self.tile, scale=scale,
        )
        if self.kivi:
            xw, ps, pz, base = window
            widx = base[:, None] + jnp.arange(xw.shape[2], dtype=jnp.int32)[None, :]
            vw = decode(
                unpack(_rows(new["v_codes"], widx), self.bits),
                jnp.repeat(_rows(new["v_scale"], widx), vgroup, axis=-1),
                jnp.repeat(_rows(new["v_zero"], widx), vgroup, axis=-1),
            )
            out_g, lse_g = _current_group_attention(
                q, xw, ps, pz, vw, pos - base[:, None], base, lo, hi, bits=self.bits, group=self.group_size, scale=scale
            )
            out, lse = merge_attention(out, lse, out_g, lse_g)
        if not (self.quantize_all or (self.sinks == 0 and self.window == 0)):
            out_e, lse_e = exact_window_attention(
                q, new["sink_k"], new["sink_v"], ring_k_before, ring_v_before, k, v, lengths, n_kept, scale=scale
            )
            out, _ = merge_attention(out, lse, out_e, lse_e)
        return out.astype(q.dtype), new


    # --- inspection -----------------------------------------------------------------
    def dequantize(self) -> tuple[jax.Array, jax.Array]:
        """(k_hat, v_hat) float32[L, B, Hkv, T_max, d] as stored in codes (rows >= lengths zeroed).

        For inspection and error measurement; attention never materialises this.
        """
        n, d = self.max_len, self.head_dim
        kc = d // self.k_scale.shape[-1]
        vc = d // self.v_scale.shape[-1]
        kh = decode(unpack(self.k_codes, self.bits), expand_stats(self.k_scale, self.key_rows, kc, n, d),
                    expand_stats(self.k_zero, self.key_rows, kc, n, d))
        vh = decode(unpack(self.v_codes, self.bits), expand_stats(self.v_scale, 1, vc, n, d),
                    expand_stats(self.v_zero, 1, vc, n, d))
        live = (jnp.arange(n)[None, :] < self.lengths[:, None])[None, :, None, :, None]
        return jnp.where(live, kh, 0.0), jnp.where(live, vh, 0.0)

"""Attention over PQ codes in pure jnp (the "xla" implementation).

For query head h (KV head h // G) and a key stored as codes c_t[m]:

    LUT[m, j] = q_m . Ck_m[j]                 one [M, K] table per query
    score_t   = scale * sum_m LUT[m, c_t[m]]  M lookups, no dequantization
    out       = sum_t p_t * concat_m Cv_m[cv_t[m]]

The context is walked in tiles of ``tile`` tokens under ``lax.scan`` with an
online softmax, so memory is O(B * T * H * M * tile) whatever the context
length: dequantized K/V are never materialised for the whole context (only
the value centroids of one tile). With many queries per call (prefill) the
key side of a tile is decoded and multiplied instead of gathered from a
LUT: the same numbers, computed the way a matmul unit likes.

Shapes (one layer):
    q:            float[B, T, H, d]
    k_codes:      uint8|uint16[B, Hkv, N, M]   (v_codes alike)
    k_centroids:  float[G, M, K, dsub], G in {1, Hkv}   (v_centroids alike)
    lo, hi:       int32[B, T]   query t of sequence b sees tokens lo <= s < hi
Returns (out float32[B, T, H, d], lse float32[B, T, H]); -inf / 0 when a
query sees no token.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from million_jax.online_softmax import pad_rows, softmax_finish, softmax_init, softmax_step, to_tiles

__all__ = ["pq_attention", "LUT_MAX_QUERIES"]

# With at most this many queries per call the key scores come from the LUT;
# above it a tile of keys is decoded and multiplied (prefill).
LUT_MAX_QUERIES = 8


def _gather_centroids(centroids: jax.Array, codes: jax.Array) -> jax.Array:
    """centroids [G, M, K, dsub], codes [B, Hkv, n, M] -> float32[B, Hkv, n, M*dsub]."""
    g, m, _, dsub = centroids.shape
    b, hkv, n, _ = codes.shape
    c = jnp.broadcast_to(centroids.astype(jnp.float32), (hkv, m) + centroids.shape[2:])
    idx = codes.astype(jnp.int32)  # [B, Hkv, n, M]
    # out[b, h, t, m, :] = c[h, m, idx[b, h, t, m], :]
    hh = jnp.arange(hkv)[None, :, None, None]
    mm = jnp.arange(m)[None, None, None, :]
    sub = c[hh, mm, idx]  # [B, Hkv, n, M, dsub]
    return sub.reshape(b, hkv, n, m * dsub)


def pq_attention(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_centroids: jax.Array,
    v_centroids: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    scale: float | None = None,
    tile: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over tokens stored as PQ codes (see module docstring)."""
    b, t, h, d = q.shape
    hkv, n, m = k_codes.shape[1:]
    if h % hkv:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hkv}")
    grp = h // hkv
    g, m_cb, kc, dsub = k_centroids.shape
    if m_cb != m or m * dsub != d:
        raise ValueError(f"codebook [G={g}, M={m_cb}, K={kc}, dsub={dsub}] does not fit codes M={m}, d={d}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tile = max(1, min(tile, n))
    n_tiles = -(-n // tile)
    kct = to_tiles(pad_rows(k_codes, n_tiles * tile), n_tiles)  # [n_tiles, B, Hkv, tile, M]
    vct = to_tiles(pad_rows(v_codes, n_tiles * tile), n_tiles)

    qg = q.astype(jnp.float32).reshape(b, t, hkv, grp, d)
    use_lut = t <= LUT_MAX_QUERIES
    if use_lut:
        ck = jnp.broadcast_to(k_centroids.astype(jnp.float32), (hkv, m, kc, dsub))
        # LUT[b, kv, (g, t), m, j] = q_m . Ck_m[j]
        lut = jnp.einsum("btkgmd,kmjd->bkgtmj", qg.reshape(b, t, hkv, grp, m, dsub), ck)
        lut = lut.reshape(b, hkv, grp * t, m, kc)

    def body(carry, xs):
        i, kc_tile, vc_tile = xs
        if use_lut:
            # sum over m of LUT[..., m, code[s, m]]
            idx = jnp.swapaxes(kc_tile.astype(jnp.int32), -1, -2)[:, :, None, :, :]  # [B,Hkv,1,M,tile]
            idx = jnp.broadcast_to(idx, (b, hkv, grp * t, m, tile))
            scores = jnp.take_along_axis(lut, idx, axis=-1).sum(axis=-2)  # [B, Hkv, G*T, tile]
            scores = scores.reshape(b, hkv, grp, t, tile)
        else:
            kd = _gather_centroids(k_centroids, kc_tile)  # [B, Hkv, tile, d]
            scores = jnp.einsum("btkgd,bksd->bkgts", qg, kd)
        s_pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
        vis = (s_pos[None, None, :] >= lo[:, :, None]) & (s_pos[None, None, :] < hi[:, :, None])  # [B,T,tile]
        vd = _gather_centroids(v_centroids, vc_tile)  # [B, Hkv, tile, d]
        return softmax_step(carry, scores * scale, vis[:, None, None], vd), None

    carry, _ = jax.lax.scan(body, softmax_init(b, hkv, grp, t, d), (jnp.arange(n_tiles, dtype=jnp.int32), kct, vct))
    return softmax_finish(carry, b, t, h, d)

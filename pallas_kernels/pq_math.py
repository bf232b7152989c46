"""Product-quantization math in pure jnp: one home for reading vectors and scores from codes.

A PQ codebook has ``M`` subspaces of ``dsub`` dims with ``K`` centroids each; a vector of
``d = M * dsub`` dims is stored as M codes. Codebooks carry leading group axes (``[G, ...]``:
one codebook per KV head, or ``G = 1`` shared) that broadcast against the codes' leading axes.

    gather_centroids   codes -> the centroids they name (decode, value side of attention)
    build_lut          LUT[m, j] = q_m . C_m[j] for each query row (MILLION's lookup table)
    lut_scores         score = sum_m LUT[m, code_m] for each key (no dequantization)

Used by ``million_jax.quant.pq`` (encode/decode), the xla attention-from-codes path and the Pallas
kernel's reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["gather_centroids", "build_lut", "lut_scores"]


def gather_centroids(centroids: jax.Array, codes: jax.Array) -> jax.Array:
    """The vectors that codes name.

    centroids: float[*G, M, K, dsub]; codes: int[*L, N, M] with ``*G`` broadcastable against
    ``*L`` (e.g. centroids [Hkv, M, K, dsub] or [1, M, K, dsub] with codes [B, Hkv, N, M]).
    Returns float32[*broadcast(L, G), N, M * dsub]. The codebook is indexed, never broadcast
    in memory (an XLA gather with iota indices for the group axes).
    """
    m, k, dsub = centroids.shape[-3:]
    if codes.shape[-1] != m:
        raise ValueError(f"codes have {codes.shape[-1]} subspaces, the codebook {m}")
    groups = centroids.shape[:-3]
    flat = centroids.astype(jnp.float32).reshape(groups + (m * k, dsub))
    idx = codes.astype(jnp.int32) + jnp.arange(m, dtype=jnp.int32) * k  # [*L, N, M]
    lead = jnp.broadcast_shapes(codes.shape[:-2], groups)
    # one index array per group axis, aligned with the trailing axes of `lead`
    index = []
    for i, size in enumerate(groups):
        shape = [1] * (len(lead) + 2)
        shape[len(lead) - len(groups) + i] = size
        index.append(jnp.arange(size, dtype=jnp.int32).reshape(shape) if size > 1 else
                     jnp.zeros(shape, jnp.int32))
    sub = flat[tuple(index) + (idx,)]  # [*lead, N, M, dsub]
    return sub.reshape(sub.shape[:-2] + (m * dsub,))


def build_lut(q: jax.Array, centroids: jax.Array) -> jax.Array:
    """LUT[b, h, r, m, j] = q[b, h, r, m-th sub-vector] . C_m[j].

    q: float[B, Hkv, R, d] (R query rows per KV head: GQA heads x tokens);
    centroids: float[G, M, K, dsub], G = 1 or Hkv. Returns f32[B, Hkv, R, M, K].
    """
    b, hkv, r, d = q.shape
    g, m, k, dsub = centroids.shape
    qs = q.astype(jnp.float32).reshape(b, hkv, r, m, dsub)
    cb = jnp.broadcast_to(centroids.astype(jnp.float32), (hkv, m, k, dsub))
    return jnp.einsum("bhrms,hmks->bhrmk", qs, cb, precision=lax.Precision.HIGHEST)


def lut_scores(lut: jax.Array, codes: jax.Array) -> jax.Array:
    """scores[b, h, r, n] = sum_m lut[b, h, r, m, codes[b, h, n, m]].

    lut: f32[B, Hkv, R, M, K]; codes: int[B, Hkv, N, M]. Returns f32[B, Hkv, R, N].
    Codes >= K are clipped (memory safety; encode never writes them).
    """
    idx = jnp.swapaxes(codes.astype(jnp.int32), -1, -2)[:, :, None]  # [B, Hkv, 1, M, N]
    idx = jnp.broadcast_to(idx, lut.shape[:3] + idx.shape[3:])
    picked = jnp.take_along_axis(lut, idx, axis=-1, mode="clip")  # [B, Hkv, R, M, N]
    return jnp.sum(picked, axis=-2)

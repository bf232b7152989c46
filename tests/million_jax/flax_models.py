"""Small decoders built from the stock Flax attention layers (the attention class is swappable),
and an independent NumPy reference for attention read from a layer's stored PQ codes."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from pallas_kernels.code_packing import codebook_nbits, maybe_unpack

VOCAB, D_MODEL, HEADS, MAX_LEN = 48, 32, 4, 64


class NNXBlock(nnx.Module):
    def __init__(self, attn_cls, kv_heads: int, rngs: nnx.Rngs, **attn_kw):
        self.norm1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.attn = attn_cls(HEADS, D_MODEL, num_kv_heads=kv_heads, decode=False, rngs=rngs, **attn_kw)
        self.norm2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.mlp = nnx.Linear(D_MODEL, D_MODEL, rngs=rngs)

    def __call__(self, x, mask, decode):
        x = x + self.attn(self.norm1(x), mask=mask, decode=decode)
        return x + self.mlp(nnx.gelu(self.norm2(x)))


class NNXDecoder(nnx.Module):
    """tokens int[B, T] at positions start.. -> logits float[B, T, VOCAB]."""

    def __init__(self, attn_cls=nnx.MultiHeadAttention, *, layers: int = 2, kv_heads: int = 2, seed: int = 0,
                 **attn_kw):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.pos = nnx.Embed(MAX_LEN, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(attn_cls, kv_heads, rngs, **attn_kw) for _ in range(layers)])
        self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens, start=0, decode=False):
        x = self.embed(tokens) + self.pos(start + jnp.arange(tokens.shape[1]))
        mask = None if decode else nnx.make_causal_mask(tokens)
        for blk in self.blocks:
            x = blk(x, mask, decode)
        return self.head(self.norm(x))

    def init_cache(self, batch: int, max_len: int = MAX_LEN):
        for blk in self.blocks:
            blk.attn.init_cache((batch, max_len, D_MODEL))


class LinenDecoder(nn.Module):
    """tokens int[B, T] at positions start.. -> logits float[B, T, VOCAB]."""

    attn_cls: Any = nn.MultiHeadDotProductAttention
    attn_kw: Any = None
    layers: int = 2
    decode: bool = False

    @nn.compact
    def __call__(self, tokens, start=0):
        x = nn.Embed(VOCAB, D_MODEL)(tokens) + nn.Embed(MAX_LEN, D_MODEL)(start + jnp.arange(tokens.shape[1]))
        mask = None if self.decode else nn.make_causal_mask(tokens)
        for i in range(self.layers):
            attn = self.attn_cls(num_heads=HEADS, decode=self.decode, name=f"attn_{i}", **dict(self.attn_kw or {}))
            x = x + attn(nn.LayerNorm()(x), mask=mask)
            x = x + nn.Dense(D_MODEL)(nn.gelu(nn.LayerNorm()(x)))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def dequant(codes: np.ndarray, books: np.ndarray) -> np.ndarray:
    """codes int[B, Hkv, T, M], books float[G, M, K, dsub] -> float[B, Hkv, T, M * dsub]."""
    g, m = books.shape[:2]
    heads = np.arange(codes.shape[1]) % g
    vec = books[heads[None, :, None, None], np.arange(m)[None, None, None, :], codes]  # [B, Hkv, T, M, dsub]
    return vec.reshape(codes.shape[:3] + (-1,))


def stored_codes(codes, books: np.ndarray) -> np.ndarray:
    """A cache's code array (packed below 8 bits) as one code per entry: int[B, Hkv, T, M]."""
    g, m, k = books.shape[:3]
    return np.asarray(maybe_unpack(jnp.asarray(codes[...]), m, codebook_nbits(k)))


def assert_nearest_codes(codes: np.ndarray, x: np.ndarray, books: np.ndarray) -> None:
    """Every stored code of x float[B, Hkv, T, d] is a nearest centroid of its sub-vector."""
    g, m, k, dsub = books.shape
    sub = x.reshape(x.shape[:3] + (m, 1, dsub))
    heads = np.arange(x.shape[1]) % g
    dist = ((sub - books[heads][None, :, None]) ** 2).sum(-1)  # [B, Hkv, T, M, K]
    chosen = np.take_along_axis(dist, codes[..., None].astype(np.int64), -1)[..., 0]
    np.testing.assert_allclose(chosen, dist.min(-1), atol=1e-5)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_codes, v_codes, k_books, v_books,
                        start: int, window: int, sinks: int) -> np.ndarray:
    """Decode attention of q float[B, T, H, d] (positions start..start+T-1) over every stored token.

    k, v: float[B, Hkv, N, d] exact projections of all N tokens so far; codes [B, Hkv, N, M].
    Token s is read exactly when s < sinks or s > p - window (window/sinks > 0), else from codes.
    """
    kq, vq = dequant(k_codes, k_books), dequant(v_codes, v_books)
    b, t, h, d = q.shape
    hkv = k.shape[1]
    out = np.zeros_like(q)
    for i in range(t):
        p = start + i
        s = np.arange(p + 1)
        exact = ((s < sinks) | (s > p - window)) if (window or sinks) else np.zeros(p + 1, bool)
        keys = np.where(exact[None, None, :, None], k[:, :, : p + 1], kq[:, :, : p + 1])
        vals = np.where(exact[None, None, :, None], v[:, :, : p + 1], vq[:, :, : p + 1])
        for j in range(h):
            g = j // (h // hkv)
            sc = np.einsum("bd,bsd->bs", q[:, i, j], keys[:, g]) / np.sqrt(d)
            w = np.exp(sc - sc.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, i, j] = np.einsum("bs,bsd->bd", w, vals[:, g])
    return out


def project(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x float[B, T, F] @ kernel [F, H, d] + bias [H, d] -> [B, T, H, d]."""
    return np.einsum("btf,fhd->bthd", x, kernel) + bias


def random_books(num_layers: int, kv_heads: int, head_dim: int, M: int, nbits: int, seed: int = 0):
    """PQCodebooks [L, Hkv, M, 2**nbits, d/M] of Gaussian centroids (the projections' scale)."""
    from million_jax import PQCodebooks

    rng = np.random.default_rng(seed)
    shape = (num_layers, kv_heads, M, 2 ** nbits, head_dim // M)
    return PQCodebooks.from_centroids(rng.standard_normal(shape), 0.5 * rng.standard_normal(shape))


def to_np(x) -> np.ndarray:
    return np.asarray(x, np.float64)

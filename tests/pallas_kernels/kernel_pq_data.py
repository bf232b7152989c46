"""Random PQ decode-attention inputs and an independent NumPy oracle for the kernel tests."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 64
    num_subspaces: int = 32
    nbits: int = 8
    seq_len: int = 40
    shared_codebook: bool = True  # G = 1, else G = Hkv
    codebook_dtype: str = "float32"
    q_scale: float = 1.0  # larger -> peakier softmax


def make_inputs(case: Case, seed: int, starts=None, ends=None) -> dict:
    """Fresh random inputs; starts/ends default to a ragged batch (lengths include 1)."""
    rng = np.random.default_rng(seed)
    b, hkv, d, m, t = case.batch, case.num_kv_heads, case.head_dim, case.num_subspaces, case.seq_len
    k = 2**case.nbits
    g = 1 if case.shared_codebook else hkv
    if ends is None:
        ends = rng.integers(1, t + 1, size=b)
        ends[0] = t  # longest row: the full array (not a multiple of block_t in most cases)
        if b > 1:
            ends[1] = 1  # a length-1 row: most of its splits are empty
    if starts is None:
        starts = np.zeros(b, np.int64)
        if b > 2:
            starts[2] = min(3, int(ends[2]) - 1)  # start > 0
    cb_dtype = jnp.bfloat16 if case.codebook_dtype == "bfloat16" else jnp.float32
    return dict(
        q=jnp.asarray(case.q_scale * rng.standard_normal((b, hkv * case.group, d)), jnp.float32),
        k_codes=jnp.asarray(rng.integers(0, k, (b, hkv, t, m)), jnp.uint8),
        v_codes=jnp.asarray(rng.integers(0, k, (b, hkv, t, m)), jnp.uint8),
        k_codebooks=jnp.asarray(rng.standard_normal((g, m, k, d // m)), cb_dtype),
        v_codebooks=jnp.asarray(rng.standard_normal((g, m, k, d // m)), cb_dtype),
        start=jnp.asarray(starts, jnp.int32),
        end=jnp.asarray(ends, jnp.int32),
    )


def numpy_oracle(inputs: dict, scale: float | None = None,
                 freqs=None) -> tuple[np.ndarray, np.ndarray]:
    """Dequantise K and V, then plain softmax attention in float64 (independent of the jnp code).
    Codes one per entry; optional ``k_scales`` / ``v_scales`` [B, Hkv, T] in ``inputs`` scale row t.

    freqs float[M] (keys quantized before RoPE, dsub 2) or float[M, P] (P pairs per sub-space,
    dsub 2P): key row t is first rotated pair-wise, pair p of sub-space m (its dims 2p, 2p + 1)
    by t * freqs[m, p], with float64 angles."""
    q = np.asarray(inputs["q"], np.float64)
    kc = np.asarray(inputs["k_codes"]).astype(np.int64)
    vc = np.asarray(inputs["v_codes"]).astype(np.int64)
    kcb = np.asarray(inputs["k_codebooks"].astype(jnp.float32), np.float64)
    vcb = np.asarray(inputs["v_codebooks"].astype(jnp.float32), np.float64)
    start, end = np.asarray(inputs["start"]), np.asarray(inputs["end"])
    ks, vs = (None if inputs.get(n) is None else np.asarray(inputs[n].astype(jnp.float32), np.float64)
              for n in ("k_scales", "v_scales"))
    b, h, d = q.shape
    _, hkv, t, m = kc.shape
    group = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, h, d))
    lse = np.full((b, h), -np.inf)
    for bi in range(b):
        lo, hi = max(0, int(start[bi])), min(t, int(end[bi]))
        if hi <= lo:
            continue
        for hi_ in range(h):
            g = hi_ // group
            kg = kcb[0 if kcb.shape[0] == 1 else g]
            vg = vcb[0 if vcb.shape[0] == 1 else g]
            kk = np.stack([kg[mi, kc[bi, g, lo:hi, mi]] for mi in range(m)], axis=1)  # [n, M, dsub]
            if freqs is not None:
                f = np.asarray(freqs, np.float32).astype(np.float64).reshape(m, -1)  # [M, P]
                ang = np.arange(lo, hi, dtype=np.float64)[:, None, None] * f[None]  # [n, M, P]
                cos, sin = np.cos(ang), np.sin(ang)
                pairs = kk.reshape(hi - lo, m, f.shape[1], 2)
                k1, k2 = pairs[..., 0], pairs[..., 1]
                kk = np.stack([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1).reshape(kk.shape)
            kk = kk.reshape(hi - lo, d)
            vv = np.stack([vg[mi, vc[bi, g, lo:hi, mi]] for mi in range(vg.shape[0])], axis=1).reshape(hi - lo, d)
            if ks is not None:  # per-token scales: score and value of row t times its scale
                kk = kk * ks[bi, g, lo:hi, None]
            if vs is not None:
                vv = vv * vs[bi, g, lo:hi, None]
            s = scale * kk @ q[bi, hi_]
            mx = s.max()
            p = np.exp(s - mx)
            lse[bi, hi_] = mx + np.log(p.sum())
            out[bi, hi_] = p @ vv / p.sum()
    return out, lse


def make_packed_inputs(case: Case, seed: int, k_bits: int, v_bits: int) -> tuple[dict, dict]:
    """(unpacked, stored) inputs with key / value codes of k_bits / v_bits bits (K = 2**bits);
    in ``stored`` the codes of a width other than 8 are packed (pallas_kernels.code_packing)."""
    from pallas_kernels.code_packing import pack_codes

    base = make_inputs(dataclasses.replace(case, nbits=8), seed)
    rng = np.random.default_rng(seed + 1)
    b, hkv, d, m, t = case.batch, case.num_kv_heads, case.head_dim, case.num_subspaces, case.seq_len
    g = 1 if case.shared_codebook else hkv
    unpacked, stored = dict(base), dict(base)
    for side, bits in (("k", k_bits), ("v", v_bits)):
        codes = jnp.asarray(rng.integers(0, 2**bits, (b, hkv, t, m)), jnp.uint8 if bits <= 8 else jnp.uint16)
        unpacked[f"{side}_codes"] = codes
        stored[f"{side}_codes"] = codes if bits == 8 else pack_codes(codes, bits)
        books = jnp.asarray(rng.standard_normal((g, m, 2**bits, d // m)), jnp.float32)
        unpacked[f"{side}_codebooks"] = stored[f"{side}_codebooks"] = books
    return unpacked, stored

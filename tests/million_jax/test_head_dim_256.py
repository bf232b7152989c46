"""Head dim 256 on one KV head with 4 query heads (Gemma 3's global layers) in every PQ attention
path of the library: the xla tile walk, the dispatch to the kernel, and the PQ cache.

Keys after RoPE (M 128 / dsub 2 or M 64 / dsub 4) and before RoPE (M 128 RoPE pairs, Gemma 3's
global base 1e6), codes one per byte and packed (4 / 6 bit). Every test compares with attention
over the decoded (and, before RoPE, rotated) keys computed independently in NumPy float64, on
fresh random inputs.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax import rope
from million_jax.attention.pq_dispatch import kernel_plan, pq_code_attention
from million_jax.attention.pq_xla import pq_attention_xla
from million_jax.cache.pq_cache import PQCache
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.pq import Codebooks, decode, encode
from pallas_kernels import pq_kernel_unsupported_reason
from pallas_kernels.code_packing import pack_codes
from test_pq_cache import _reference

D, H, HKV = 256, 4, 1  # GQA 4:1
GEMMA_GLOBAL_BASE = 1e6


def make(rng, b: int, t: int, n: int, m: int, k_bits: int, v_bits: int, pre: bool) -> dict:
    """q float32[B, T, 4, 256], codes uint8[B, 1, N, M] (and their stored, maybe packed, form),
    per-KV-head codebooks float32[1, M, K, 256 / M]; ``freqs`` float32[M] when pre-RoPE."""
    kc = rng.integers(0, 2**k_bits, (b, HKV, n, m)).astype(np.uint8)
    vc = rng.integers(0, 2**v_bits, (b, HKV, n, m)).astype(np.uint8)
    store = lambda c, bits: c if bits == 8 else np.asarray(pack_codes(jnp.asarray(c), bits))  # noqa: E731
    return dict(
        q=rng.standard_normal((b, t, H, D)).astype(np.float32),
        k_codes=kc, v_codes=vc, stored_k=store(kc, k_bits), stored_v=store(vc, v_bits),
        k_books=rng.standard_normal((HKV, m, 2**k_bits, D // m)).astype(np.float32),
        v_books=rng.standard_normal((HKV, m, 2**v_bits, D // m)).astype(np.float32),
        freqs=(1.0 / GEMMA_GLOBAL_BASE ** (np.arange(m) / m) * rng.uniform(0.7, 1.0, m)).astype(np.float32)
        if pre else None,
    )


def oracle(x: dict, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of q [B, T, H, d] over decode(codes) (pre-RoPE: pair m of row s turned
    by s * freqs[m]), tokens lo <= s < hi."""
    q, kc, vc = x["q"].astype(np.float64), x["k_codes"], x["v_codes"]
    kb, vb = x["k_books"].astype(np.float64), x["v_books"].astype(np.float64)
    b, t, h, d = q.shape
    n, m = kc.shape[2], kc.shape[3]
    keys = kb[0][np.arange(m), kc[:, 0]]  # [B, N, M, dsub]
    if x["freqs"] is not None:
        ang = np.arange(n, dtype=np.float64)[:, None] * x["freqs"].astype(np.float64)[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        k1, k2 = keys[..., 0], keys[..., 1]
        keys = np.stack([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)
    keys = keys.reshape(b, n, d)
    vals = vb[0][np.arange(m), vc[:, 0]].reshape(b, n, d)
    out, lse = np.zeros((b, t, h, d)), np.full((b, t, h), -np.inf)
    for bi in range(b):
        for ti in range(t):
            sl = slice(int(lo[bi, ti]), int(hi[bi, ti]))
            if sl.stop <= sl.start:
                continue
            s = keys[bi, sl] @ q[bi, ti].T / math.sqrt(d)  # [n, H]
            mx = s.max(axis=0)
            p = np.exp(s - mx)
            out[bi, ti] = (p.T @ vals[bi, sl]) / p.sum(axis=0)[:, None]
            lse[bi, ti] = mx + np.log(p.sum(axis=0))
    return out, lse


def check(got, want, tol: float) -> None:
    out, lse = (np.asarray(a, np.float64) for a in got)
    empty = np.isneginf(want[1])
    assert (np.isneginf(lse) == empty).all()
    np.testing.assert_allclose(out, want[0], atol=tol, rtol=0)
    np.testing.assert_allclose(lse[~empty], want[1][~empty], atol=tol, rtol=0)


def windows(rng, b: int, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    lo = rng.integers(0, 30, (b, t)).astype(np.int32)
    hi = rng.integers(31, n + 1, (b, t)).astype(np.int32)
    hi[0, 0] = n  # the whole array (not a multiple of the tile)
    if b > 1:
        lo[1, 0], hi[1, 0] = 9, 9  # an empty window
    return lo, hi


def args_of(x: dict, lo, hi) -> tuple:
    return tuple(jnp.asarray(a) for a in (x["q"], x["stored_k"], x["stored_v"], x["k_books"], x["v_books"], lo, hi))


@pytest.mark.parametrize("t, m, k_bits, v_bits, pre", [
    (1, 128, 8, 8, False),   # decode: LUT scores
    (12, 64, 6, 6, False),   # prefill (T > 8): decoded key tiles and a matmul; dsub 4, packed
    (1, 128, 4, 8, True),    # pre-RoPE decode: the q.c / q.Jc tables; packed keys
    (12, 128, 8, 4, True),   # pre-RoPE prefill: rotated decoded keys; packed values
], ids=["decode-M128", "prefill-M64-6bit", "pre-decode-4bit", "pre-prefill"])
def test_xla_tile_walk_matches_float64(t, m, k_bits, v_bits, pre):
    rng = np.random.default_rng(1000 * t + 10 * m + k_bits + pre)
    b, n = 3, 100
    x = make(rng, b, t, n, m, k_bits, v_bits, pre)
    lo, hi = windows(rng, b, t, n)
    freqs = None if x["freqs"] is None else jnp.asarray(x["freqs"])
    fn = jax.jit(pq_attention_xla, static_argnames="tile")
    check(fn(*args_of(x, lo, hi), tile=32, rope_inv_freq=freqs), oracle(x, lo, hi), 2e-5)  # 3 tiles + 4 rows


@pytest.mark.parametrize("m, k_bits, pre", [(128, 8, False), (64, 6, False), (128, 4, True)],
                         ids=["M128", "M64-6bit", "pre-M128-4bit"])
def test_dispatch_runs_the_kernel_at_d256_one_kv_head(m, k_bits, pre):
    """The kernel plans and runs this shape (interpret mode off GPU): equal to the float64 oracle
    within the bf16 dots' error, and to the xla path."""
    rng = np.random.default_rng(50 + m + k_bits)
    b, n = 2, 70
    x = make(rng, b, 1, n, m, k_bits, k_bits, pre)
    lo, hi = windows(rng, b, 1, n)
    args = args_of(x, lo, hi)
    freqs = None if x["freqs"] is None else jnp.asarray(x["freqs"])
    plan = kernel_plan("pallas", *args[:5], rope=pre)
    assert plan is not None and plan.rope == pre and plan.dims.group == 4 and plan.dims.head_dim == D
    assert plan.launch.block_t == (16 if pre else 32)  # the wide-head defaults of pallas_kernels.launch
    kernel_args = (args[0][:, 0], *args[1:5], args[5][:, 0], args[6][:, 0])
    assert pq_kernel_unsupported_reason(*kernel_args, rope_inv_freq=freqs) is None
    run = jax.jit(lambda *a, impl: pq_code_attention(*a, impl=impl, rope_inv_freq=freqs), static_argnames="impl")
    want = oracle(x, lo, hi)
    kernel = run(*args, impl="pallas")
    check(kernel, want, 5e-2)
    check(run(*args, impl="xla"), want, 2e-5)
    np.testing.assert_allclose(np.asarray(kernel[0]), np.asarray(run(*args, impl="xla")[0]), atol=5e-2)


def test_dispatch_plans_pre_rope_pair_groups_and_names_why_few_subspaces_cannot_run():
    rng = np.random.default_rng(3)
    lo, hi = np.zeros((1, 1), np.int32), np.full((1, 1), 20, np.int32)
    args = args_of(make(rng, 1, 1, 20, 64, 8, 8, pre=False), lo, hi)
    assert kernel_plan("pallas", *args[:5]) is not None  # after RoPE, dsub 4 runs
    assert kernel_plan("pallas", *args[:5], rope=True).rope  # before RoPE: two pairs per sub-space
    args = args_of(make(rng, 1, 1, 20, 8, 8, 8, pre=False), lo, hi)  # 16 pairs per sub-space, M = 8
    with pytest.raises(ValueError, match=r"impl='pallas' cannot run: .*M >= 16 sub-spaces"):
        kernel_plan("pallas", *args[:5], rope=True)


def _cache_setup(rng, m: int, nbits: int, pre: bool, t_max: int):
    """Codebooks [1 layer, 1 KV head], keys after RoPE as the model gives them, and what the cache
    should read: the decoded keys (pre-RoPE: decoded in pair layout, then rotated) and values."""
    kb = rng.standard_normal((1, HKV, m, 2**nbits, D // m)).astype(np.float32)
    vb = rng.standard_normal((1, HKV, m, 2**nbits, D // m)).astype(np.float32)
    books = PQCodebooks.from_centroids(kb, vb, "layer_head", num_layers=1)
    b = 2
    k_pre = rng.standard_normal((b, HKV, t_max, D)).astype(np.float32)
    v = rng.standard_normal((b, HKV, t_max, D)).astype(np.float32)
    q = rng.standard_normal((b, t_max, H, D)).astype(np.float32)
    kcb, vcb = Codebooks(kb[0]), Codebooks(vb[0])
    vq = np.asarray(decode(vcb, encode(vcb, v)))
    if not pre:
        return books, q, k_pre, v, np.asarray(decode(kcb, encode(kcb, k_pre))), vq
    inv = rope.rope_inv_freq(D, GEMMA_GLOBAL_BASE)
    books = books.with_pre_rope_keys(inv)
    cos, sin = rope.rope_cos_sin(np.arange(t_max), inv)
    k_post = np.asarray(rope.rotate(k_pre, cos, sin))
    kq_pre = np.asarray(rope.from_pair_layout(decode(kcb, encode(kcb, rope.to_pair_layout(k_pre)))))
    return books, q, k_post, v, np.asarray(rope.rotate(kq_pre, cos, sin)), vq


def _rows(x: np.ndarray, start: np.ndarray, n: np.ndarray, t: int, axis: int) -> np.ndarray:
    """Rows start[b] .. start[b] + n[b] of x along the token ``axis`` (of x[b]) as [B, t, ...]."""
    out = []
    for bi in range(x.shape[0]):
        xb = np.moveaxis(np.take(x[bi], np.arange(start[bi], start[bi] + t), axis=axis), axis, 0).copy()
        xb[n[bi]:] = 0
        out.append(xb)
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize("m, nbits, pre, impl", [
    (128, 8, False, "xla"), (64, 6, False, "pallas"), (128, 8, True, "pallas"), (128, 4, True, "xla"),
], ids=["M128-xla", "M64-6bit-pallas", "pre-M128-pallas", "pre-M128-4bit-xla"])
def test_pq_cache_at_d256_matches_exact_attention_over_reconstructions(m, nbits, pre, impl):
    """A head_dim 256, one-KV-head PQ cache (2 sinks, window 3) builds, takes a ragged prefill and
    two decode steps, and reads what the codes say (the kernel on the decode steps for "pallas")."""
    t_max, sinks, window = 20, 2, 3
    rng = np.random.default_rng(m + nbits + 2 * pre)
    books, q, k, v, kq, vq = _cache_setup(rng, m, nbits, pre, t_max)
    cache = PQCache.for_codebooks(books, 2, HKV, t_max, window=window, sinks=sinks, dtype=jnp.float32, impl=impl)
    assert cache.head_dim == D and cache.layers.k_codes.shape[-1] == -(-m * nbits // 8)
    prompt = np.array([9, 4], np.int32)
    steps = [(np.zeros(2, np.int32), prompt, 9)] + [(prompt + i, np.ones(2, np.int32), 1) for i in range(2)]
    tol = 3e-2 if impl == "pallas" else 2e-4  # the kernel's dots are bf16
    for start, n, t in steps:
        qc, kc, vc = _rows(q, start, n, t, 0), _rows(k, start, n, t, 1), _rows(v, start, n, t, 1)
        out, cache = attend_layer0(cache, books, jnp.asarray(qc), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(n))
        ref = _reference(qc, k, v, kq, vq, start, n, sinks, window, False)
        for bi in range(2):
            np.testing.assert_allclose(np.asarray(out)[bi, :n[bi]], ref[bi, :n[bi]], rtol=tol, atol=tol)
    if pre:  # the rotation is what makes it right: the codes read as post-RoPE keys are far off
        unturned = np.asarray(rope.rotate(kq, *rope.rope_cos_sin(-np.arange(t_max), rope.rope_inv_freq(
            D, GEMMA_GLOBAL_BASE))))
        wrong = _reference(qc, k, v, unturned, vq, start, n, sinks, window, False)
        assert np.abs(np.asarray(out) - wrong).max() > 10 * tol

"""Keys quantized before RoPE (issue 24): exact angles, the reference and the kernel against float64.

The contract: key sub-space m (dsub = 2) is RoPE pair m, code row t is the key of position t,
rotated by t * inv_freq[m] (rotate-half convention); q comes rotated. With P pairs per sub-space
(dsub = 2P) the frequencies are [M, P] and pair p of sub-space m turns by t * inv_freq[m, p]. Every test compares with
attention over RoPE(decode(codes)) computed independently in NumPy float64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import TRITON_CUSTOM_CALL, export_for_cuda
from kernel_pq_data import Case, make_inputs, make_packed_inputs, numpy_oracle
from pallas_kernels import (plan_pq_kernel, pq_decode_attention, pq_decode_attention_reference, pq_dims,
                            pq_kernel_unsupported_reason)
from pallas_kernels import pq_math
from test_kernel_lowering import specs

pytestmark = pytest.mark.kernels


def inv_freq(m: int, theta: float = 10000.0, seed: int | None = None) -> jax.Array:
    """LLaMA-style frequencies of M pairs, optionally jittered (fresh random inputs per test)."""
    f = 1.0 / theta ** (np.arange(m) / m)
    if seed is not None:
        f = f * np.random.default_rng(seed).uniform(0.7, 1.0, m)
    return jnp.asarray(f, jnp.float32)


def rope_oracle(inputs: dict, freqs, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dequantize, rotate key row t by t * f (float64 angles), softmax attention in float64."""
    return numpy_oracle(inputs, scale, freqs=freqs)


def assert_close(got, want, tol):
    out, lse = (np.asarray(x, np.float64) for x in got)
    w_out, w_lse = want
    both_inf = np.isneginf(lse) & np.isneginf(w_lse)
    np.testing.assert_allclose(out, w_out, atol=tol, rtol=0)
    np.testing.assert_allclose(np.where(both_inf, 0, lse), np.where(both_inf, 0, w_lse), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- angles


def _pi_scaled(bits: int) -> int:
    """floor(pi * 2**bits) by Machin's formula in integers (independent of any float)."""
    one = 1 << (bits + 32)

    def arctan_inv(x: int) -> int:
        total, term, n, sign = 0, one // x, 1, 1
        while term:
            total += sign * (term // n)
            term //= x * x
            n += 2
            sign = -sign
        return total

    return (16 * arctan_inv(5) - 4 * arctan_inv(239)) >> 32


def test_inv_two_pi_pieces_are_exact_float32_and_sum_to_60_bits():
    want = Fraction(1 << 200, 2 * _pi_scaled(200))
    pieces = pq_math._INV_TWO_PI
    assert all(float(np.float32(p)) == p for p in pieces)
    assert abs(sum(Fraction(p) for p in pieces) - want) < Fraction(1, 2**62)


def test_rope_phase_is_exact_fixed_point():
    """floor(t * f / (2 pi) * 2**32) mod 2**32 in exact rationals, at positions up to 2**31 - 1."""
    rng = np.random.default_rng(7)
    f = np.concatenate([np.asarray(inv_freq(16)), rng.uniform(1e-7, 3.0, 16)]).astype(np.float32)
    t = np.array([0, 1, 63, 4097, 65535, 65536, 131071, 131072, 2**24 + 3, 2**31 - 1], np.int64)
    hi, lo = jax.jit(pq_math.rope_turns)(jnp.asarray(f))
    phase = np.asarray(jax.jit(pq_math.rope_phase)(jnp.asarray(t, jnp.int32)[:, None], hi, lo)).astype(np.int64)
    two_pi = Fraction(2 * _pi_scaled(120), 2**120)
    for j, fj in enumerate(f):
        u = Fraction(float(fj)) / two_pi
        for i, ti in enumerate(t):
            exact = math.floor(ti * u * 2**32) % 2**32
            diff = (int(phase[i, j]) - exact + 2**31) % 2**32 - 2**31
            # the 60-bit 1 / (2 pi) and truncated pieces: a few 2**-32 turns (1e-8 rad) at t = 2**31
            assert abs(diff) <= (1 if ti < 2**24 else 8), (ti, float(fj), diff)


@pytest.mark.parametrize("window_start", [0, 131072 - 2048, 2**24 - 2048])
def test_rope_cos_sin_matches_float64_up_to_128k_and_beyond(window_start):
    """The measured angle error: ~2e-7 anywhere (naive float32 t * f: 4e-3 at 128K)."""
    f = jnp.concatenate([inv_freq(64, 500000.0), inv_freq(32, seed=window_start)])
    t = np.arange(window_start, window_start + 2048, dtype=np.int64)
    cos, sin = jax.jit(pq_math.rope_cos_sin)(jnp.asarray(t, jnp.int32), f)
    ang = t[:, None].astype(np.float64) * np.asarray(f, np.float64)[None, :]
    err = max(np.abs(np.asarray(cos, np.float64) - np.cos(ang)).max(),
              np.abs(np.asarray(sin, np.float64) - np.sin(ang)).max())
    assert err < 5e-7, err
    if window_start >= 131072 - 2048:  # the naive angle would not pass: the test can tell them apart
        naive = jnp.asarray(t, jnp.float32)[:, None] * f[None, :]
        assert np.abs(np.asarray(jnp.cos(naive), np.float64) - np.cos(ang)).max() > 1e-3


# ----------------------------------------------------------------------------- attention


PRE = Case(batch=3, num_kv_heads=2, group=3, head_dim=64, num_subspaces=32, nbits=8, seq_len=150)


@pytest.mark.parametrize("case", [PRE, dataclasses.replace(PRE, shared_codebook=False, nbits=6, group=1)])
def test_reference_matches_float64_oracle(case):
    seed = hash(case) % 1000
    x = make_inputs(case, seed)
    f = inv_freq(case.num_subspaces, seed=seed)
    got = jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=f)
    assert_close(got, rope_oracle(x, f), 2e-5)


@pytest.mark.parametrize("precision, tol", [("fp32", 2e-5), ("bf16", 5e-2)])
@pytest.mark.parametrize("num_splits, block_t", [(1, 16), (3, 32), (None, None)])
def test_kernel_matches_float64_oracle(precision, tol, num_splits, block_t):
    case = dataclasses.replace(PRE, shared_codebook=num_splits != 3)
    seed = 11 + (num_splits or 0)
    x = make_inputs(case, seed)
    f = inv_freq(case.num_subspaces, seed=seed)
    fn = functools.partial(pq_decode_attention, interpret=True, precision=precision,
                           num_splits=num_splits, block_t=block_t)
    assert_close(jax.jit(fn)(**x, rope_inv_freq=f), rope_oracle(x, f), tol)


@pytest.mark.parametrize("k_bits, v_bits", [(4, 8), (6, 4)])
def test_kernel_reads_packed_pre_rope_keys(k_bits, v_bits):
    unpacked, stored = make_packed_inputs(dataclasses.replace(PRE, seq_len=100), 5 + k_bits, k_bits, v_bits)
    f = inv_freq(PRE.num_subspaces, seed=k_bits)
    want = rope_oracle(unpacked, f)
    fn = functools.partial(pq_decode_attention, interpret=True, precision="fp32", num_splits=2)
    assert_close(jax.jit(fn)(**stored, rope_inv_freq=f), want, 2e-5)
    assert_close(jax.jit(pq_decode_attention_reference)(**stored, rope_inv_freq=f), want, 2e-5)


# Two RoPE pairs per key sub-space (dsub 4; pq2-pre-g2): frequencies [M, 2], pair p of sub-space m.
G2 = Case(batch=2, num_kv_heads=2, group=3, head_dim=64, num_subspaces=16, nbits=8, seq_len=130)


def pair_freqs(m: int, pairs: int, theta: float = 10000.0, seed: int | None = None) -> jax.Array:
    """float32[M, P]: pair p of sub-space m gets the frequency of RoPE pair m + p M (jittered)."""
    return inv_freq(m * pairs, theta, seed).reshape(pairs, m).T


@pytest.mark.parametrize("precision, tol", [("fp32", 2e-5), ("bf16", 5e-2)])
@pytest.mark.parametrize("num_splits, block_t, shared", [(1, 16, True), (3, 32, False)])
def test_two_pairs_per_subspace_kernel_and_reference(precision, tol, num_splits, block_t, shared):
    case = dataclasses.replace(G2, shared_codebook=shared)
    seed = 61 + num_splits
    x = make_inputs(case, seed, starts=np.array([0, 9]), ends=np.array([130, 77]))
    f = pair_freqs(case.num_subspaces, 2, seed=seed)
    want = rope_oracle(x, f)
    fn = functools.partial(pq_decode_attention, interpret=True, precision=precision,
                           num_splits=num_splits, block_t=block_t)
    assert_close(jax.jit(fn)(**x, rope_inv_freq=f), want, tol)
    assert_close(jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=f), want, 2e-5)
    # the pairs are told apart: the same frequencies in the other pair order give another answer
    swapped = jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=f[:, ::-1])
    assert np.abs(np.asarray(swapped[0]) - want[0]).max() > 0.1


@pytest.mark.parametrize("precision, tol", [("fp32", 2e-5), ("bf16", 5e-2)])
def test_per_kv_head_frequencies(precision, tol):
    """rope_inv_freq [Hkv, M, 1]: each KV head's sub-spaces hold the RoPE pairs in their own order
    (PQCodebooks.key_pair_order); the answer is the oracle's with that head's frequencies."""
    case = dataclasses.replace(PRE, shared_codebook=False, num_kv_heads=3, group=2, seq_len=120)
    x = make_inputs(case, 21, starts=np.array([0, 5, 30]), ends=np.array([120, 64, 100]))
    f = inv_freq(case.num_subspaces, seed=21)
    perms = np.stack([np.random.default_rng(h).permutation(case.num_subspaces) for h in range(3)])
    per_head = jnp.asarray(np.asarray(f)[perms][..., None])  # [Hkv, M, 1]
    g = case.group
    oracles = [rope_oracle(x, per_head[h, :, 0]) for h in range(3)]
    want = tuple(np.concatenate([o[i][:, h * g:(h + 1) * g] for h, o in enumerate(oracles)], axis=1)
                 for i in range(2))
    fn = functools.partial(pq_decode_attention, interpret=True, precision=precision, num_splits=2, block_t=32)
    assert_close(jax.jit(fn)(**x, rope_inv_freq=per_head), want, tol)
    assert_close(jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=per_head), want, 2e-5)
    one = jnp.asarray(np.asarray(f)[perms[:1]][..., None])  # G = 1: every head the same order
    assert_close(jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=one), rope_oracle(x, one[0, :, 0]), 2e-5)
    with pytest.raises(ValueError, match=r"G=1 or Hkv=3"):
        pq_decode_attention_reference(**x, rope_inv_freq=per_head[:2])
    bad = np.array(per_head)
    bad[2, 4, 0] = np.nan
    with pytest.raises(ValueError, match="got nan at KV head 2, sub-space 4"):
        pq_decode_attention(**x, rope_inv_freq=jnp.asarray(bad), interpret=True)


def test_two_pairs_per_subspace_packed_d256():
    """Gemma-sized heads (d 256, M 64 sub-spaces of two pairs), packed 6-bit keys, fp32."""
    case = Case(batch=2, num_kv_heads=1, group=4, head_dim=256, num_subspaces=64, nbits=8, seq_len=60,
                shared_codebook=False)
    unpacked, stored = make_packed_inputs(case, 71, 6, 8)
    f = pair_freqs(64, 2, 1e6, seed=71)
    fn = functools.partial(pq_decode_attention, interpret=True, precision="fp32", num_splits=2)
    want = rope_oracle(unpacked, f)
    assert_close(jax.jit(fn)(**stored, rope_inv_freq=f), want, 2e-5)
    assert_close(jax.jit(pq_decode_attention_reference)(**stored, rope_inv_freq=f), want, 2e-5)


# Gemma 3's global layers: 4 query heads on one KV head, head_dim 256, M 128 RoPE pairs.
GEMMA_PRE = Case(batch=2, num_kv_heads=1, group=4, head_dim=256, num_subspaces=128, nbits=8, seq_len=90,
                 shared_codebook=False)


@pytest.mark.parametrize("precision, tol", [("fp32", 2e-5), ("bf16", 5e-2)])
def test_head_dim_256_one_kv_head_default_launch(precision, tol):
    """d = 256 at its default launch (block_t 16, 8 warps, 1 stage; several tiles per split),
    the kernel and the reference against float64, ragged rows with start > 0."""
    x = make_inputs(GEMMA_PRE, 31 + len(precision), starts=np.array([0, 17]), ends=np.array([90, 61]))
    f = inv_freq(GEMMA_PRE.num_subspaces, 1e6, seed=31)  # Gemma 3's global RoPE base
    dims = pq_dims(*(x[k] for k in ("q", "k_codes", "v_codes", "k_codebooks", "v_codebooks")))
    launch = plan_pq_kernel(dims, x["k_codes"], x["v_codes"], rope=True).launch
    assert (launch.block_t, launch.num_warps, launch.num_stages) == (16, 8, 1)
    want = rope_oracle(x, f)
    fn = functools.partial(pq_decode_attention, interpret=True, precision=precision)
    assert_close(jax.jit(fn)(**x, rope_inv_freq=f), want, tol)
    if precision == "fp32":
        assert_close(jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=f), want, 2e-5)


@pytest.mark.parametrize("k_bits, v_bits", [(4, 4), (6, 8)])
def test_head_dim_256_packed_pre_rope_keys(k_bits, v_bits):
    unpacked, stored = make_packed_inputs(dataclasses.replace(GEMMA_PRE, seq_len=50), 40 + k_bits, k_bits, v_bits)
    f = inv_freq(GEMMA_PRE.num_subspaces, 1e6, seed=k_bits)
    fn = functools.partial(pq_decode_attention, interpret=True, precision="fp32", num_splits=2)
    assert_close(jax.jit(fn)(**stored, rope_inv_freq=f), rope_oracle(unpacked, f), 2e-5)


def test_kernel_and_reference_at_positions_near_128k():
    """T_max = 131072, small M / K: rows 130900..131071 attended (ragged), split-K, float32."""
    t_max, m = 131072, 16
    case = Case(batch=2, num_kv_heads=1, group=2, head_dim=2 * m, num_subspaces=m, nbits=4, seq_len=t_max)
    x = make_inputs(case, 3, starts=np.array([t_max - 172, t_max - 64]), ends=np.array([t_max, t_max - 5]))
    f = inv_freq(m, seed=3)
    want = rope_oracle(x, f)
    fn = functools.partial(pq_decode_attention, interpret=True, precision="fp32", num_splits=2)
    assert_close(jax.jit(fn)(**x, rope_inv_freq=f), want, 2e-5)
    assert_close(jax.jit(pq_decode_attention_reference)(**x, rope_inv_freq=f), want, 2e-5)


def test_pre_rope_inputs_the_kernel_refuses_are_named():
    x = make_inputs(PRE, 0)
    f = inv_freq(PRE.num_subspaces)
    with pytest.raises(ValueError, match="key_path='centroid'"):
        pq_decode_attention(**x, rope_inv_freq=f, key_path="lut", interpret=True)
    with pytest.raises(ValueError, match=r"float32\[M=32\]"):
        pq_decode_attention(**x, rope_inv_freq=f[:8], interpret=True)
    for bad, shown in ((np.nan, "nan"), (0.0, "0"), (-1e-3, "-0.001"), (np.inf, "inf")):
        g = np.array(f)
        g[5] = bad
        with pytest.raises(ValueError, match=f"finite and > 0.*got {shown} at sub-space 5"):
            pq_decode_attention(**x, rope_inv_freq=jnp.asarray(g), interpret=True)
        with pytest.raises(ValueError, match=f"finite and > 0.*got {shown} at sub-space 5"):
            pq_decode_attention_reference(**x, rope_inv_freq=jnp.asarray(g))
    dsub4 = make_inputs(dataclasses.replace(PRE, num_subspaces=16), 0)  # two pairs per sub-space: [M, 2]
    assert r"float32[M=16, P=2]" in pq_kernel_unsupported_reason(**dsub4, rope_inv_freq=inv_freq(16))
    with pytest.raises(ValueError, match=r"float32\[M=16, P=2\]"):
        pq_decode_attention_reference(**dsub4, rope_inv_freq=inv_freq(16))
    g = np.array(pair_freqs(16, 2))
    g[3, 1] = np.nan
    with pytest.raises(ValueError, match="got nan at sub-space 3, pair 1"):
        pq_decode_attention(**dsub4, rope_inv_freq=jnp.asarray(g), interpret=True)
    dsub6 = make_inputs(dataclasses.replace(PRE, head_dim=48, num_subspaces=16), 0)
    with pytest.raises(ValueError, match="whole RoPE pairs"):
        pq_decode_attention_reference(**dsub6, rope_inv_freq=inv_freq(16))
    small = make_inputs(dataclasses.replace(PRE, head_dim=16, num_subspaces=8), 0)
    assert "M >= 16 sub-spaces" in pq_kernel_unsupported_reason(**small, rope_inv_freq=inv_freq(8))
    assert pq_kernel_unsupported_reason(**x, rope_inv_freq=f) is None


# ----------------------------------------------------------------------------- CUDA lowering


ROPE_SHAPES = {
    "llama3-gqa4-b8-perhead-bf16cb": (specs(8, 32, 8, 128, 64, 16384, g=8, cb_dtype=jnp.bfloat16), {}),
    "smollm2-gqa3-odd-T": (specs(3, 9, 3, 64, 32, 8191), dict(precision="fp32")),
    "packed4-gqa4": (specs(2, 32, 8, 128, 64, 4096, nbits=4, packed=True), {}),
    "packed6-bt64-split1": (specs(1, 32, 8, 128, 64, 4096, nbits=6, packed=True), dict(block_t=64, num_splits=1)),
    # Gemma 3 global layers (d 256, M 128, one KV head, GQA 4): the wide-head default (block_t 16,
    # 8 warps, 1 stage), packed codes, and the d <= 128 launch forced
    "gemma3-d256-32k": (specs(1, 4, 1, 256, 128, 32768), {}),
    "gemma3-d256-packed4-b4": (specs(4, 4, 1, 256, 128, 16384, nbits=4, packed=True), {}),
    "gemma3-d256-packed6-bt32-w4": (specs(2, 4, 1, 256, 128, 4096, nbits=6, packed=True),
                                    dict(block_t=32, num_warps=4, num_stages=2)),
    # two RoPE pairs per key sub-space (pq2-pre-g2): SmolLM2's M 16 and Gemma 3's M 64, 8-bit codes
    "g2-smollm2-gqa3": (specs(3, 9, 3, 64, 16, 8191), {}),
    "g2-gemma3-d256": (specs(1, 4, 1, 256, 64, 32768), {}),
    # a frequency per KV head (PQCodebooks.key_pair_order): SmolLM2's shape
    "per-head-smollm2-gqa3": (specs(3, 9, 3, 64, 32, 8191), dict(per_head=True)),
}


@pytest.mark.parametrize("name", list(ROPE_SHAPES))
def test_pre_rope_kernel_exports_for_cuda(name):
    args, kw = ROPE_SHAPES[name]
    kw = dict(kw)
    m, dsub = args[3].shape[1], args[3].shape[3]
    fn = lambda *a: pq_decode_attention(*a[:-1], rope_inv_freq=a[-1], **kw)  # noqa: E731
    freqs = (m,) if dsub == 2 else (m, dsub // 2)
    if kw.pop("per_head", False):
        freqs = (args[1].shape[1], m, dsub // 2)
    exported = export_for_cuda(fn, *args, jax.ShapeDtypeStruct(freqs, jnp.float32))
    assert exported.mlir_module().count(TRITON_CUSTOM_CALL) == 1
    b, h, d = args[0].shape
    assert [tuple(a.shape) for a in exported.out_avals] == [(b, h, d), (b, h)]

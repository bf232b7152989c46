"""pq_decode_attention (interpret mode) against its jnp reference and a NumPy oracle."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_pq_data import Case, make_inputs, make_packed_inputs, numpy_oracle
from pallas_kernels import (
    plan_pq_kernel,
    pq_decode_attention,
    pq_decode_attention_reference,
    pq_dims,
    pq_kernel_unsupported_reason,
)

# fp32 dots: exact up to summation order. bf16 dots: operands rounded to 8 mantissa bits.
TOL = {"fp32": dict(atol=2e-5, rtol=2e-5), "bf16": dict(atol=4e-2, rtol=4e-2)}


def seed_of(case: Case) -> int:
    return zlib.crc32(repr(case).encode())


def run_kernel(inputs: dict, **kw):
    return pq_decode_attention(**inputs, interpret=True, **kw)


def assert_matches_reference(inputs: dict, precision: str = "fp32", **kw) -> None:
    ref_out, ref_lse = pq_decode_attention_reference(**inputs, scale=kw.get("scale"))
    out, lse = run_kernel(inputs, precision=precision, **kw)
    assert out.shape == ref_out.shape and out.dtype == jnp.float32
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), **TOL[precision])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **TOL[precision])


# Each case: (Case, kernel kwargs). Together they cover head dims 64/128, M = d/2 and d/4,
# nbits 8 and 4, GQA groups 1, 2, 3, 4, 5, 8, batch 1..8, G = 1 and G = Hkv, ragged lengths
# with a length-1 row, lengths not a multiple of block_t, empty splits, start > 0, bf16
# codebooks, a peaky softmax, both key paths and both precisions.
CASES = [
    (Case(batch=3, num_kv_heads=2, group=1, head_dim=64, num_subspaces=32, seq_len=70), dict(block_t=16, num_splits=3)),
    (Case(batch=2, num_kv_heads=1, group=4, head_dim=128, num_subspaces=64, seq_len=45, shared_codebook=False), dict(block_t=16, num_splits=2)),
    (Case(batch=1, num_kv_heads=3, group=3, head_dim=64, num_subspaces=16, seq_len=33, shared_codebook=False), dict(block_t=32, num_splits=1)),
    (Case(batch=8, num_kv_heads=1, group=2, head_dim=64, num_subspaces=16, nbits=4, seq_len=19), dict(block_t=16, num_splits=4)),
    (Case(batch=2, num_kv_heads=1, group=8, head_dim=128, num_subspaces=32, seq_len=50, q_scale=4.0), dict(block_t=16, num_splits=2)),
    (Case(batch=4, num_kv_heads=2, group=5, head_dim=64, num_subspaces=32, nbits=4, seq_len=37, codebook_dtype="bfloat16"), dict(block_t=16, num_splits=5)),
]
CASE_IDS = [
    "mha-d64-M32",
    "gqa4-d128-M64-perhead",
    "gqa3-d64-M16-perhead-1split",
    "gqa2-b8-nbits4-manysplits",
    "gqa8-d128-M32-peaky",
    "gqa5-nbits4-bf16cb",
]


@pytest.mark.parametrize("case,kw", CASES, ids=CASE_IDS)
def test_centroid_fp32_matches_reference(case: Case, kw: dict) -> None:
    assert_matches_reference(make_inputs(case, seed=seed_of(case)), precision="fp32", **kw)


@pytest.mark.parametrize("case,kw", [CASES[1], CASES[2], CASES[4]], ids=[CASE_IDS[1], CASE_IDS[2], CASE_IDS[4]])
def test_centroid_bf16_matches_reference(case: Case, kw: dict) -> None:
    assert_matches_reference(make_inputs(case, seed=1 + seed_of(case)), precision="bf16", **kw)


@pytest.mark.parametrize(
    "case,kw,precision",
    [(*CASES[0], "fp32"), (*CASES[3], "bf16"), (*CASES[5], "fp32")],
    ids=[CASE_IDS[0] + "-fp32", CASE_IDS[3] + "-bf16", CASE_IDS[5] + "-fp32"],
)
def test_lut_path_matches_reference(case: Case, kw: dict, precision: str) -> None:
    assert_matches_reference(
        make_inputs(case, seed=2 + seed_of(case)), precision=precision, key_path="lut", **kw
    )


def test_reference_matches_numpy_oracle() -> None:
    """The reference itself against dequantise-then-attend in float64."""
    for case in (CASES[1][0], CASES[3][0], dataclasses.replace(CASES[2][0], q_scale=3.0)):
        inputs = make_inputs(case, seed=7)
        out, lse = pq_decode_attention_reference(**inputs)
        o_np, l_np = numpy_oracle(inputs)
        np.testing.assert_allclose(np.asarray(out), o_np, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), l_np, atol=1e-5, rtol=1e-5)
    out, lse = pq_decode_attention_reference(**inputs, scale=0.3)
    o_np, l_np = numpy_oracle(inputs, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), o_np, atol=1e-5, rtol=1e-5)


def test_empty_ranges_and_clipping() -> None:
    """Empty rows give out 0 / lse -inf (no NaN); end > T and start < 0 are clipped."""
    case = Case(batch=4, num_kv_heads=2, group=2, seq_len=24)
    starts = np.array([5, 0, 10, -3])
    ends = np.array([5, 0, 4, 100])  # empty, empty, end < start, clipped to [0, T)
    inputs = make_inputs(case, seed=3, starts=starts, ends=ends)
    out, lse = run_kernel(inputs, block_t=16, num_splits=3, precision="fp32")
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:3], 0.0)
    assert np.all(np.isneginf(lse[:3]))
    o_np, l_np = numpy_oracle(inputs)
    np.testing.assert_allclose(out, o_np, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse[3], l_np[3], atol=2e-5, rtol=2e-5)


def test_scale_and_bf16_query_under_jit() -> None:
    case = Case(batch=2, num_kv_heads=2, group=2, seq_len=30)
    inputs = make_inputs(case, seed=4)
    inputs["q"] = inputs["q"].astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(pq_decode_attention, scale=0.25, block_t=16, num_splits=2,
                                   precision="fp32", interpret=True))
    out, lse = fn(**inputs)
    ref_out, ref_lse = pq_decode_attention_reference(**inputs, scale=0.25)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)


def test_default_launch_config_runs() -> None:
    """No knobs given: default block_t / splits (clamped for a short array) still match."""
    inputs = make_inputs(Case(batch=1, num_kv_heads=1, group=2, seq_len=300), seed=5)
    assert_matches_reference(inputs, precision="bf16")
    short = make_inputs(Case(batch=2, num_kv_heads=1, group=2, seq_len=5), seed=6)  # T < block_t
    assert_matches_reference(short, precision="fp32")


# Gemma 3's global layers: 4 query heads on one KV head (GQA 4:1), head_dim 256, M 128
# (dsub 2, one sub-space per RoPE pair) or M 64 (dsub 4); ragged rows, several splits.
GEMMA = Case(batch=3, num_kv_heads=1, group=4, head_dim=256, num_subspaces=128, seq_len=53,
             shared_codebook=False)
D256 = [
    (GEMMA, dict(block_t=16, num_splits=3)),
    (dataclasses.replace(GEMMA, batch=2, num_subspaces=64, seq_len=70, shared_codebook=True, q_scale=3.0),
     dict(block_t=32, num_splits=2)),
]
D256_IDS = ["gemma3-d256-M128", "gemma3-d256-M64-peaky"]


@pytest.mark.parametrize("case,kw", D256, ids=D256_IDS)
@pytest.mark.parametrize("key_path,precision", [("centroid", "fp32"), ("centroid", "bf16"), ("lut", "fp32")])
def test_head_dim_256_one_kv_head_matches_reference(case: Case, kw: dict, key_path: str, precision: str) -> None:
    inputs = make_inputs(case, seed=seed_of(case) + len(key_path) + len(precision))
    assert_matches_reference(inputs, precision=precision, key_path=key_path, **kw)
    if precision == "fp32":  # and the reference itself against float64 at this shape
        o_np, l_np = numpy_oracle(inputs)
        out, lse = pq_decode_attention_reference(**inputs)
        np.testing.assert_allclose(np.asarray(out), o_np, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), l_np, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key_path,block_t", [("centroid", 32), ("lut", 16)])
def test_head_dim_256_default_launch(key_path: str, block_t: int) -> None:
    """No knobs at d = 256: the wide-head tile of `pallas_kernels.launch` (several tiles per split)."""
    inputs = make_inputs(dataclasses.replace(GEMMA, batch=2, seq_len=300), seed=21 + block_t)
    dims = pq_dims(*(inputs[k] for k in ("q", "k_codes", "v_codes", "k_codebooks", "v_codebooks")))
    plan = plan_pq_kernel(dims, inputs["k_codes"], inputs["v_codes"], key_path=key_path)
    assert (plan.launch.block_t, plan.launch.num_warps) == (block_t, 4)
    assert pq_kernel_unsupported_reason(**inputs, key_path=key_path) is None
    assert_matches_reference(inputs, precision="bf16", key_path=key_path)


@settings(max_examples=4, deadline=None, database=None)
@given(
    batch=st.integers(1, 4),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4, 6, 8]),
    dims=st.sampled_from([(64, 32), (64, 16), (128, 64), (128, 32), (256, 128), (256, 64)]),
    nbits=st.sampled_from([4, 8]),
    seq_len=st.integers(1, 70),
    shared=st.booleans(),
    block_t=st.sampled_from([16, 32]),
    num_splits=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_random_shapes_match_reference(
    batch, num_kv_heads, group, dims, nbits, seq_len, shared, block_t, num_splits, seed
) -> None:
    case = Case(batch=batch, num_kv_heads=num_kv_heads, group=group, head_dim=dims[0],
                num_subspaces=dims[1], nbits=nbits, seq_len=seq_len, shared_codebook=shared)
    assert_matches_reference(make_inputs(case, seed=seed), precision="fp32",
                             block_t=block_t, num_splits=num_splits)


# Codes stored at their real width: the kernel reads each code's bytes itself. Bits cover two
# codes per byte (4), codes straddling bytes (3, 6), 12-bit pairs in 3 bytes, and keys one per
# byte with packed values (different K).
PACKED = [
    (Case(batch=3, num_kv_heads=2, group=2, head_dim=64, num_subspaces=32, seq_len=37), 4, 4),
    (Case(batch=2, num_kv_heads=1, group=4, head_dim=128, num_subspaces=64, seq_len=29, shared_codebook=False), 6, 6),
    (Case(batch=2, num_kv_heads=2, group=1, head_dim=64, num_subspaces=16, seq_len=21), 3, 5),
    (Case(batch=2, num_kv_heads=1, group=3, head_dim=64, num_subspaces=16, seq_len=33), 12, 12),
    (Case(batch=3, num_kv_heads=2, group=2, head_dim=64, num_subspaces=32, seq_len=40), 8, 4),
    # Gemma 3 global layers (d 256, one KV head, GQA 4): 4-bit codes with M 128, 6-bit with M 64
    (Case(batch=2, num_kv_heads=1, group=4, head_dim=256, num_subspaces=128, seq_len=35, shared_codebook=False), 4, 4),
    (Case(batch=3, num_kv_heads=1, group=4, head_dim=256, num_subspaces=64, seq_len=41), 6, 6),
]


@pytest.mark.parametrize("case,k_bits,v_bits", PACKED,
                         ids=[f"k{k}v{v}-d{c.head_dim}-M{c.num_subspaces}" for c, k, v in PACKED])
@pytest.mark.parametrize("key_path", ["centroid", "lut"])
def test_packed_codes_match_oracle(case: Case, k_bits: int, v_bits: int, key_path: str) -> None:
    unpacked, stored = make_packed_inputs(case, seed_of(case), k_bits, v_bits)
    if k_bits != 8:
        assert stored["k_codes"].shape[-1] == -(-case.num_subspaces * k_bits // 8)
    want_out, want_lse = numpy_oracle(unpacked)
    out, lse = run_kernel(stored, precision="fp32", key_path=key_path, block_t=16, num_splits=2)
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL["fp32"])
    np.testing.assert_allclose(np.asarray(lse), want_lse, **TOL["fp32"])
    ref_out, _ = pq_decode_attention_reference(**stored)
    np.testing.assert_allclose(np.asarray(ref_out), want_out, **TOL["fp32"])


def test_packed_codes_bad_width_or_dtype_raise() -> None:
    _, stored = make_packed_inputs(Case(batch=2, num_kv_heads=2, group=2, seq_len=8), 0, 6, 6)
    for bad, match in (
        (dict(v_codes=stored["v_codes"][..., :-1]), "does not fit v_codes"),
        (dict(k_codes=stored["k_codes"].astype(jnp.uint16)), "packed k_codes must be uint8"),
    ):
        with pytest.raises(ValueError, match=match):
            pq_decode_attention(**dict(stored, **bad), interpret=True)
        with pytest.raises(ValueError, match=match):
            pq_decode_attention_reference(**dict(stored, **bad))


# ----------------------------------------------------------------------------- bad inputs


def _good() -> dict:
    return make_inputs(Case(batch=2, num_kv_heads=2, group=2, seq_len=8), seed=0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be float"),
        (lambda a: a.update(q=a["q"].astype(jnp.int32)), "q must be a float"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of"),
        (lambda a: a.update(k_codes=a["k_codes"].astype(jnp.int32)), "uint8 or uint16"),
        (lambda a: a.update(v_codes=a["v_codes"][:, :, :4]), "v_codes shape"),
        (lambda a: a.update(k_codes=a["k_codes"][:1], v_codes=a["v_codes"][:1]), "batch"),
        (lambda a: a.update(k_codebooks=a["k_codebooks"][:, :16]), "k_codebooks shape"),
        (lambda a: a.update(v_codebooks=jnp.concatenate([a["v_codebooks"]] * 3)), "G=3"),
        (lambda a: a.update(v_codebooks=a["v_codebooks"].astype(jnp.int32)), "float array"),
        (lambda a: a.update(start=a["start"][:1]), "start must be int32"),
        (lambda a: a.update(end=a["end"].astype(jnp.float32)), "end must be an integer"),
    ],
)
def test_bad_inputs_raise(mutate, match: str) -> None:
    args = _good()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        pq_decode_attention(**args, interpret=True)
    with pytest.raises(ValueError, match=match):
        pq_decode_attention_reference(**args)


def test_kernel_only_rejections() -> None:
    args = _good()
    wide = dict(args, k_codes=args["k_codes"].astype(jnp.uint16), v_codes=args["v_codes"].astype(jnp.uint16))
    with pytest.raises(ValueError, match="uint8 codes"):
        pq_decode_attention(**wide, interpret=True)
    pq_decode_attention_reference(**wide)  # the XLA path takes uint16
    for kw, match in (
        (dict(block_t=24), "block_t"),
        (dict(block_t=8), "block_t"),
        (dict(num_splits=0), "num_splits"),
        (dict(num_warps=3), "num_warps"),
        (dict(key_path="dense"), "key_path"),
        (dict(precision="fp16"), "precision"),
    ):
        with pytest.raises(ValueError, match=match):
            pq_decode_attention(**args, interpret=True, **kw)
    big_k = dict(args, k_codebooks=jnp.zeros((1, 32, 300, 2)))
    with pytest.raises(ValueError, match="K=300"):
        pq_decode_attention(**big_k, interpret=True)
    assert "uint8 codes" in pq_kernel_unsupported_reason(**wide)
    assert "block_t" in pq_kernel_unsupported_reason(**args, block_t=24)
    assert pq_kernel_unsupported_reason(**args) is None


@pytest.mark.parametrize("key_path", ["centroid", "lut"])
def test_nan_query_gives_nan_row_not_a_finite_answer(key_path: str) -> None:
    """A NaN query row comes out NaN from the kernel and the reference (every split of it),
    the other rows are unchanged."""
    case = Case(batch=2, num_kv_heads=2, group=2, seq_len=40)
    inputs = make_inputs(case, seed=11)
    clean = run_kernel(dict(inputs), block_t=16, num_splits=3, precision="fp32", key_path=key_path)
    q = np.array(inputs["q"])
    q[1, 3, 0] = np.nan  # batch 1, query head 3
    inputs["q"] = jnp.asarray(q)
    for out, lse in (run_kernel(inputs, block_t=16, num_splits=3, precision="fp32", key_path=key_path),
                     pq_decode_attention_reference(**inputs)):
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[1, 3]).all() and np.isnan(lse[1, 3])
        keep = np.ones(lse.shape, bool)
        keep[1, 3] = False
        np.testing.assert_allclose(out[keep], np.asarray(clean[0])[keep], atol=2e-5, rtol=2e-5)

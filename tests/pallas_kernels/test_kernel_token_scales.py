"""The PQ kernel's per-token scales and code layouts of several parts (what TurboQuant's codes
need: d one-dim sub-spaces, a norm per token, 2.5 / 3.5 b as two parts of different widths), in
interpret mode against the jnp reference, the reference against a NumPy oracle, the bad inputs
refused by name, and the CUDA lowering."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import TRITON_CUSTOM_CALL, export_for_cuda
from kernel_pq_data import numpy_oracle
from pallas_kernels import pq_decode_attention, pq_decode_attention_reference
from pallas_kernels.code_packing import pack_parts, parts_width


def numpy_unpack(packed: np.ndarray, parts) -> np.ndarray:
    """Independent unpack: one little-endian bit stream per token (np.unpackbits), the parts' codes
    one after the other at their widths."""
    bits = np.unpackbits(packed, axis=-1, bitorder="little").astype(np.int64)
    out, off = [], 0
    for n, b in parts:
        chunk = bits[..., off:off + n * b].reshape(bits.shape[:-1] + (n, b))
        out.append((chunk << np.arange(b)).sum(-1))
        off += n * b
    return np.concatenate(out, axis=-1)


def make_case(seed: int, b=3, hkv=2, group=2, d=64, t=45, k_parts=((64, 4),), v_parts=((64, 4),), dsub=1,
              k_scaled=True, v_scaled=True, scale_dtype=jnp.float32):
    """(stored inputs, the same with unpacked codes for the oracle): random codes in the layouts,
    random codebooks [1, M, K, dsub], positive per-token scales, a ragged batch."""
    rng = np.random.default_rng(seed)
    m = d // dsub
    stored, plain = {}, {}
    for side, parts in (("k", k_parts), ("v", v_parts)):
        codes = [rng.integers(0, 1 << bits, (b, hkv, t, n)) for n, bits in parts]
        stored[f"{side}_codes"] = pack_parts([jnp.asarray(c, jnp.uint8) for c in codes], parts)
        plain[f"{side}_codes"] = jnp.asarray(np.concatenate(codes, -1), jnp.uint8)
        k = 1 << max(bits for _, bits in parts)
        stored[f"{side}_codebooks"] = plain[f"{side}_codebooks"] = jnp.asarray(
            rng.standard_normal((1, m, k, dsub)), jnp.float32)
        scaled = k_scaled if side == "k" else v_scaled
        stored[f"{side}_scales"] = plain[f"{side}_scales"] = (
            jnp.asarray(rng.uniform(0.2, 3.0, (b, hkv, t)), scale_dtype) if scaled else None)
    ends = rng.integers(1, t + 1, b)
    ends[0] = t
    if b > 1:
        ends[1] = 1
    starts = np.zeros(b, np.int64)
    if b > 2:
        starts[2] = min(2, ends[2] - 1)
    common = dict(q=jnp.asarray(rng.standard_normal((b, hkv * group, d)), jnp.float32),
                  start=jnp.asarray(starts, jnp.int32), end=jnp.asarray(ends, jnp.int32))
    stored.update(common, k_parts=k_parts, v_parts=v_parts)
    plain.update(common)
    return stored, plain


CASES = {  # name: (make_case kwargs, kernel kwargs)
    "tq4-d64-gqa2": (dict(), dict(block_t=16, num_splits=3)),
    "tq2.5-two-parts": (dict(k_parts=((32, 3), (32, 2)), v_parts=((32, 3), (32, 2))), dict(block_t=16, num_splits=2)),
    "tq3.5-keys-2-values-8bit": (dict(k_parts=((32, 4), (32, 3)), v_parts=((64, 8),)), dict(block_t=32, num_splits=1)),
    "tq4.5-d128-gqa4-bf16-scales": (dict(d=128, hkv=1, group=4, k_parts=((64, 5), (64, 4)), v_parts=((128, 2),),
                                         scale_dtype=jnp.bfloat16), dict(block_t=16, num_splits=2)),
    "keys-scaled-only-pq-dsub2": (dict(k_parts=((32, 6),), v_parts=((32, 6),), dsub=2, v_scaled=False),
                                  dict(block_t=16, num_splits=2)),
    "values-scaled-only-lut": (dict(k_parts=((32, 4),), v_parts=((32, 4),), dsub=2, k_scaled=False),
                               dict(block_t=16, num_splits=2, key_path="lut")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_oracle(name: str) -> None:
    case_kw, kernel_kw = CASES[name]
    stored, plain = make_case(seed=len(name), **case_kw)
    ref_out, ref_lse = pq_decode_attention_reference(**stored)
    out, lse = pq_decode_attention(**stored, interpret=True, precision="fp32", **kernel_kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)
    o_np, l_np = numpy_oracle(plain)  # unpacked codes, float64: independent of both
    np.testing.assert_allclose(np.asarray(ref_out), o_np, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(ref_lse), l_np, atol=2e-5, rtol=2e-5)
    bf16, _ = pq_decode_attention(**stored, interpret=True, **kernel_kw)  # the default bf16 dots
    np.testing.assert_allclose(np.asarray(bf16), o_np, atol=6e-2, rtol=6e-2)


def test_scales_change_the_answer() -> None:
    """A negative control: the same codes with all scales 1 give another output (the scales are read)."""
    stored, _ = make_case(seed=5)
    ones = dict(stored, k_scales=jnp.ones_like(stored["k_scales"]), v_scales=jnp.ones_like(stored["v_scales"]))
    a, _ = pq_decode_attention(**stored, interpret=True, precision="fp32", block_t=16)
    b, _ = pq_decode_attention(**ones, interpret=True, precision="fp32", block_t=16)
    assert float(jnp.max(jnp.abs(a - b))) > 0.1


def test_pack_parts_matches_an_independent_unpack() -> None:
    rng = np.random.default_rng(0)
    for parts in (((32, 3), (32, 2)), ((5, 7), (3, 8), (9, 1)), ((64, 4),)):
        codes = [rng.integers(0, 1 << b, (4, n)) for n, b in parts]
        packed = np.asarray(pack_parts([jnp.asarray(c, jnp.uint8) for c in codes], parts))
        assert packed.shape == (4, parts_width(parts))
        np.testing.assert_array_equal(numpy_unpack(packed, parts), np.concatenate(codes, -1))


def test_bad_scales_and_layouts_are_named() -> None:
    stored, _ = make_case(seed=1)
    bad = [
        (dict(k_scales=stored["k_scales"][:, :, :-1]), "k_scales must be float\\[B, Hkv, T\\]"),
        (dict(v_scales=stored["v_scales"].astype(jnp.int32)), "v_scales must be a float array"),
        (dict(k_parts=((32, 4), (16, 4))), "hold 48 codes"),
        (dict(v_parts=((32, 3), (32, 2))), "must be uint8\\[..., 20\\]"),
        (dict(k_codebooks=stored["k_codebooks"][:, :, :8]), "K=8 is smaller than the 16 codes"),
        (dict(k_parts=((64, 0),)), "bits in 1..15"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            pq_decode_attention_reference(**dict(stored, **change))
        with pytest.raises(ValueError, match=msg):
            pq_decode_attention(**dict(stored, **change), interpret=True)


def _specs(b, h, hkv, d, t, parts, scale_dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    w, k = parts_width(parts), 1 << max(bits for _, bits in parts)
    return (s((b, h, d), jnp.bfloat16), s((b, hkv, t, w), jnp.uint8), s((b, hkv, t, w), jnp.uint8),
            s((1, d, k, 1), jnp.float32), s((1, d, k, 1), jnp.float32), s((b,), jnp.int32), s((b,), jnp.int32),
            s((b, hkv, t), scale_dtype), s((b, hkv, t), scale_dtype))


EXPORTS = {  # TurboQuant codes at the LLaMA-3.1-8B shape, the Gemma 3 global shape, SmolLM2's
    "llama3-tq4-32k": (_specs(1, 32, 8, 128, 32768, ((128, 4),)), {}),
    "llama3-tq2.5-b8": (_specs(8, 32, 8, 128, 8192, ((64, 3), (64, 2))), {}),
    "gemma3-d256-tq3.5": (_specs(2, 4, 1, 256, 32768, ((128, 4), (128, 3))), {}),
    "smollm2-tq8-lut": (_specs(3, 9, 3, 64, 4095, ((64, 8),)), dict(key_path="lut")),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_turboquant_layouts_export_for_cuda(name: str) -> None:
    args, kw = EXPORTS[name]
    parts = {"llama3-tq4-32k": ((128, 4),), "llama3-tq2.5-b8": ((64, 3), (64, 2)),
             "gemma3-d256-tq3.5": ((128, 4), (128, 3)), "smollm2-tq8-lut": ((64, 8),)}[name]

    def f(q, kc, vc, kb, vb, st, en, ks, vs):
        return pq_decode_attention(q, kc, vc, kb, vb, st, en, k_scales=ks, v_scales=vs, k_parts=parts,
                                   v_parts=parts, **kw)

    exported = export_for_cuda(f, *args)
    assert exported.mlir_module().count(TRITON_CUSTOM_CALL) == 1
    b, h, d = args[0].shape
    assert [tuple(a.shape) for a in exported.out_avals] == [(b, h, d), (b, h)]

"""The PQ kernel lowers for CUDA (Pallas -> Triton) on a CPU-only machine, via jax.export.

No skip: under any supported JAX (0.10.x, 0.11.x) this must pass; a kernel that the GPU
backend cannot lower fails here before it reaches a GPU. (`flatbuffers` is needed by
jax.export; it is in the test extras.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import pq_decode_attention, pq_kernel_unsupported_reason
from cuda_export import TRITON_CUSTOM_CALL, export_for_cuda
from pallas_kernels.code_packing import packed_width


def specs(b, h, hkv, d, m, t, nbits=8, g=1, cb_dtype=jnp.float32, q_dtype=jnp.bfloat16, packed=False):
    s = jax.ShapeDtypeStruct
    k = 2**nbits
    w = packed_width(m, nbits) if packed else m
    return (
        s((b, h, d), q_dtype),
        s((b, hkv, t, w), jnp.uint8),
        s((b, hkv, t, w), jnp.uint8),
        s((g, m, k, d // m), cb_dtype),
        s((g, m, k, d // m), cb_dtype),
        s((b,), jnp.int32),
        s((b,), jnp.int32),
    )


SHAPES = {
    # LLaMA-2-7B heads (MHA), 32K context, shared codebook, default launch config.
    "llama2-mha-32k": (specs(1, 32, 32, 128, 64, 32768), {}),
    # LLaMA-3.1-8B heads (GQA 4), batch 8, per-KV-head bf16 codebooks.
    "llama3-gqa4-b8-perhead-bf16cb": (specs(8, 32, 8, 128, 64, 16384, g=8, cb_dtype=jnp.bfloat16), {}),
    # > 4 GiB of codes: 64-bit pointer offsets.
    "llama2-b8-300k-int64-offsets": (specs(8, 32, 32, 128, 64, 300000), {}),
    # SmolLM2 heads (GQA 3, d 64), odd T; nbits 4 with dsub 4, fp32 dots.
    "smollm2-gqa3-odd-T-b3": (specs(3, 9, 3, 64, 32, 8191), {}),
    "nbits4-dsub4-fp32": (specs(2, 8, 2, 128, 32, 1000, nbits=4), dict(precision="fp32")),
    # The LUT key path (MHA and GQA 8) and non-default knobs.
    "lut-mha": (specs(1, 8, 8, 128, 64, 4096), dict(key_path="lut")),
    "lut-gqa8-fp32": (specs(2, 16, 2, 64, 32, 3000, g=2), dict(key_path="lut", precision="fp32")),
    # Codes packed at their real width: 4-bit pairs, straddling 6-bit, 12-bit (LUT path too).
    "packed4-gqa4": (specs(2, 32, 8, 128, 64, 4096, nbits=4, packed=True), {}),
    "packed6-smollm2-perhead": (specs(3, 9, 3, 64, 32, 8191, nbits=6, g=3, packed=True), {}),
    "packed12-lut": (specs(1, 32, 8, 128, 32, 4096, nbits=12, packed=True), dict(key_path="lut")),
    "knobs-bt128-w8-s3": (specs(4, 32, 8, 128, 64, 4096), dict(block_t=128, num_splits=1, num_warps=8, num_stages=3)),
    # Gemma 3 global layers: 4 query heads on 1 KV head, d 256, M 128 (dsub 2) or 64 (dsub 4); the
    # wide-head defaults of pallas_kernels.launch (block_t 32 centroid, 16 LUT), packed codes.
    "gemma3-d256-M128-32k": (specs(1, 4, 1, 256, 128, 32768), {}),
    "gemma3-d256-M64-b4-odd-T-bf16cb": (specs(4, 4, 1, 256, 64, 8191, cb_dtype=jnp.bfloat16), {}),
    "gemma3-d256-lut": (specs(2, 4, 1, 256, 128, 4096), dict(key_path="lut")),
    "gemma3-d256-packed4": (specs(1, 4, 1, 256, 128, 32768, nbits=4, packed=True), {}),
    "gemma3-d256-M64-packed6-lut-fp32": (specs(2, 4, 1, 256, 64, 4096, nbits=6, packed=True),
                                         dict(key_path="lut", precision="fp32")),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_exports_for_cuda(name: str) -> None:
    args, kw = SHAPES[name]
    exported = export_for_cuda(functools.partial(pq_decode_attention, **kw), *args)
    assert tuple(exported.platforms) == ("cuda",)
    text = exported.mlir_module()
    assert text.count(TRITON_CUSTOM_CALL) == 1, "expected exactly one Triton kernel"
    b, h, d = args[0].shape
    assert [tuple(a.shape) for a in exported.out_avals] == [(b, h, d), (b, h)]


def test_refuses_codes_in_the_32bit_offset_overflow_window() -> None:
    """2**31 < numel <= 2**32: Pallas would use sign-extended 32-bit offsets (out of bounds)."""
    with pytest.raises(ValueError, match="32-bit offset"):
        jax.eval_shape(pq_decode_attention, *specs(12, 32, 32, 128, 64, 131072))
    jax.eval_shape(pq_decode_attention, *specs(8, 32, 32, 128, 64, 131072))  # exactly 2**31: ok
    assert "32-bit offset" in pq_kernel_unsupported_reason(*specs(12, 32, 32, 128, 64, 131072))
    assert pq_kernel_unsupported_reason(*specs(8, 32, 32, 128, 64, 131072)) is None

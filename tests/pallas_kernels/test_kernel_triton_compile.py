"""Optional: compile the kernel's Triton IR to sm_90a with the `triton` pip package (no GPU).

Runs when MILLION_JAX_TRITON_PYTHON names a Python that has `triton` (it need not be this
one), or when `triton` is importable here; otherwise it is skipped with that reason. The
mandatory lowering check is test_kernel_lowering.py (jax.export).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from triton_compile_check import SHAPES, capture_ttir, compile_ttir, launch_of, rope_kernel

TRITON_PYTHON = os.environ.get("MILLION_JAX_TRITON_PYTHON") or (
    sys.executable if importlib.util.find_spec("triton") else None
)


@pytest.mark.skipif(TRITON_PYTHON is None, reason="no `triton` package (set MILLION_JAX_TRITON_PYTHON)")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("key_path", ["centroid", "lut"])
def test_default_config_compiles_without_spills(shape: str, key_path: str) -> None:
    """Every shape at the default launch of its head_dim (d = 256: block_t 32 centroid / 16 LUT)."""
    fn, args, _ = rope_kernel(SHAPES[shape], dict(key_path=key_path))
    (ttir,) = capture_ttir(fn, *args)
    cfg = launch_of(SHAPES[shape], dict(key_path=key_path))
    res = compile_ttir(ttir, cfg.num_warps, cfg.num_stages, TRITON_PYTHON)
    assert res["ptxas_ok"]
    assert res["spill_stores"] == 0 and res["stack"] == 0, res
    assert res["shared"] <= 227 * 1024, res
    assert any(op.startswith("mma") or op.startswith("wgmma") for op in res["ptx_ops"]), res


@pytest.mark.skipif(TRITON_PYTHON is None, reason="no `triton` package (set MILLION_JAX_TRITON_PYTHON)")
@pytest.mark.parametrize("shape", ["llama3-gqa4", "smollm2-gqa3-d64", "llama3-gqa4-4bit", "llama3-gqa4-6bit",
                                   "gemma3-gqa4-d256", "gemma3-gqa4-d256-4bit", "gemma3-gqa4-d256-6bit"])
def test_pre_rope_default_config_compiles_without_spills(shape: str) -> None:
    """Pre-RoPE keys at their default launch: no spills. Measured (triton 3.9, sm_90a), d <= 128
    (block_t 32, 4 warps): 168 registers for llama3-gqa4 and its 4-bit codes, 128 for smollm2,
    255 (the cap, still no spill) for 6-bit codes; block_t 64 spills with packed codes, block_t
    16 needs 80-161. d = 256 (block_t 16, 8 warps, 1 stage): 170 / 171 / 205 registers for
    8 / 4 / 6-bit codes; 4 warps spill there at any block_t (`pallas_kernels.launch`).

    The stack is not asserted empty: libdevice's cosf / sinf keep a small local array for their
    Payne-Hanek branch (|x| > 1e5), which the kernel's angles in [-pi, pi) never take."""
    fn, args, _ = rope_kernel(SHAPES[shape], dict(rope=True))
    (ttir,) = capture_ttir(fn, *args)
    cfg = launch_of(SHAPES[shape], dict(rope=True))
    res = compile_ttir(ttir, cfg.num_warps, cfg.num_stages, TRITON_PYTHON)
    assert res["ptxas_ok"]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] <= 64, res
    assert res["shared"] <= 227 * 1024, res
    assert any(op.startswith("mma") or op.startswith("wgmma") for op in res["ptx_ops"]), res

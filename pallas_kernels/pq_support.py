"""What the PQ decode kernel can take: its modes, its minimum tile sizes, and the checks that
refuse a call it cannot run (the caller then takes the XLA path).

Each check raises ValueError with one sentence naming the problem; they read shapes and dtypes
only (arrays or ShapeDtypeStructs), so they work at trace time. :mod:`pallas_kernels.pq_plan`
runs them when it plans a launch.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax.numpy as jnp

from pallas_kernels._pq_inputs import PQDims, is_power_of_two
from pallas_kernels.launch import LaunchConfig

__all__ = [
    "KeyPath",
    "Precision",
    "MIN_BLOCK_H",
    "MIN_BLOCK_T",
    "check_kernel_support",
    "check_modes",
    "check_rope_support",
]

KeyPath = Literal["centroid", "lut"]
Precision = Literal["bf16", "fp32"]
MIN_BLOCK_H = 16  # tl.dot needs M >= 16
MIN_BLOCK_T = 16  # tl.dot needs N, K >= 16

# jax's Pallas Triton lowering switches to 64-bit pointer offsets only above 2**32 *bytes*
# but adds 32-bit offsets with sign extension, so an array of 2**31 < elements <= 2**32
# would be addressed with negative offsets (verified in the PTX). Such code arrays are
# refused (the caller takes the XLA path); smaller and larger ones are fine.
_UNSAFE_NUMEL = (2**31, 2**32)


def check_modes(key_path: str, precision: str) -> None:
    """ValueError unless ``key_path`` is "centroid" / "lut" and ``precision`` "bf16" / "fp32"."""
    if key_path not in ("centroid", "lut"):
        raise ValueError(f"key_path must be 'centroid' or 'lut', got {key_path!r}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")


def check_kernel_support(dims: PQDims, codes: tuple[Any, Any], cfg: LaunchConfig) -> None:
    """ValueError unless the kernel takes codes (k_codes, v_codes) of sizes ``dims`` with ``cfg``.

    codes: uint8[B, Hkv, T, width] arrays or ShapeDtypeStructs (dtype and size read). Refused:
    codes not uint8, a code array of 2**31 < n <= 2**32 elements, a d / M / dsub that is not a
    power of two, launch knobs out of range.
    """
    numel = max(math.prod(c.shape) for c in codes)
    if _UNSAFE_NUMEL[0] < numel <= _UNSAFE_NUMEL[1]:
        raise ValueError(
            f"codes arrays of {numel} elements (2**31 < n <= 2**32) hit a 32-bit offset overflow"
            " in the Pallas Triton lowering; use the XLA path (or a batch / T_max outside that range)"
        )
    for name, c in zip(("k_codes", "v_codes"), codes):
        if jnp.dtype(c.dtype) != jnp.uint8:
            raise ValueError(
                f"the Pallas PQ kernel reads uint8 codes (one per byte, or packed); got {name} {c.dtype}."
                " Pack codes of 9..15 bits (pallas_kernels.code_packing) or use the XLA path"
                " (pq_decode_attention_reference)."
            )
    for name, n in (("head_dim d", dims.head_dim), ("M", dims.num_subspaces), ("dsub", dims.sub_dim)):
        if not is_power_of_two(n):
            raise ValueError(f"the Pallas PQ kernel needs a power-of-two {name}, got {n}; use the XLA path")
    if not is_power_of_two(cfg.block_t) or cfg.block_t < MIN_BLOCK_T:
        raise ValueError(f"block_t must be a power of two >= {MIN_BLOCK_T}, got {cfg.block_t}")
    if cfg.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {cfg.num_splits}")
    if cfg.num_warps < 1 or not is_power_of_two(cfg.num_warps):
        raise ValueError(f"num_warps must be a power of two >= 1, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {cfg.num_stages}")


def check_rope_support(dims: PQDims, key_path: str) -> None:
    """ValueError unless the kernel takes pre-RoPE keys of these sizes on ``key_path``."""
    if key_path != "centroid":
        raise ValueError("pre-RoPE keys (rope_inv_freq) run on key_path='centroid' only: the LUT path would "
                         "gather two tables per query head and token (use the XLA path for the LUT form)")
    if dims.sub_dim % 2:
        raise ValueError(f"pre-RoPE keys need sub-spaces of whole RoPE pairs (even dsub), got dsub {dims.sub_dim}")
    if dims.num_subspaces < MIN_BLOCK_T:
        raise ValueError(f"pre-RoPE keys need M >= {MIN_BLOCK_T} sub-spaces in the kernel (tl.dot over the "
                         f"pair halves), got M={dims.num_subspaces}; use the XLA path")

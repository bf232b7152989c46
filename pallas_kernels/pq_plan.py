"""A launch of the PQ decode kernel, planned once: :class:`KernelPlan` and :func:`plan_pq_kernel`,
and :func:`pq_kernel_unsupported_reason` (None, or why the kernel cannot take a call).

Planning reads shapes and dtypes only (arrays or ShapeDtypeStructs) and works at trace time;
`pq_decode_attention.pq_decode_attention_planned` launches a plan without checking again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_kernels._pq_inputs import PQDims, check_pq_inputs
from pallas_kernels.launch import LaunchConfig, default_launch_config
from pallas_kernels.pq_math import check_rope_inv_freq
from pallas_kernels.pq_support import KeyPath, Precision, check_kernel_support, check_modes, check_rope_support

__all__ = ["KernelPlan", "plan_pq_kernel", "pq_kernel_unsupported_reason"]


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One checked launch of the kernel: the call's sizes, the launch config, the two modes.

    Made by :func:`plan_pq_kernel`; `pq_decode_attention_planned` launches it.
    """

    dims: PQDims
    launch: LaunchConfig
    key_path: KeyPath = "centroid"
    precision: Precision = "bf16"
    rope: bool = False  # keys quantized before RoPE (the launch takes rope_inv_freq)


def plan_pq_kernel(
    dims: PQDims, k_codes: Any, v_codes: Any,
    *,
    block_t: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_path: KeyPath = "centroid",
    precision: Precision = "bf16",
    rope: bool = False,
) -> KernelPlan:
    """The kernel's launch for a call of sizes ``dims``, or ValueError naming what it cannot take.

    dims: from `check_pq_inputs` (a user's inputs) or `pq_dims` (inputs checked where they
    were built, e.g. by the PQ cache). k_codes / v_codes: uint8[B, Hkv, T, width] arrays or
    ShapeDtypeStructs (only their dtype and size are read). ``rope``: keys quantized before
    RoPE (see `pq_decode_attention`'s ``rope_inv_freq``). Unset launch options get the
    defaults of :mod:`pallas_kernels.launch` for this head_dim and key mode. Works at trace time.
    """
    check_modes(key_path, precision)
    cfg = default_launch_config(dims.batch, dims.num_kv_heads, dims.seq_len, key_path=key_path,
                                head_dim=dims.head_dim, rope=rope, block_t=block_t, num_splits=num_splits,
                                num_warps=num_warps, num_stages=num_stages)
    check_kernel_support(dims, (k_codes, v_codes), cfg)
    if rope:
        check_rope_support(dims, key_path)
    return KernelPlan(dims, cfg, key_path, precision, rope)


def pq_kernel_unsupported_reason(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    rope_inv_freq: jax.Array | None = None,
    **launch: Any,
) -> str | None:
    """None when `pq_decode_attention` takes these inputs (arrays or ShapeDtypeStructs), else why not.

    Shapes as `pq_decode_attention`: q float[B, H, d], codes uint8[B, Hkv, T, width],
    codebooks float[G, M, K, dsub], start / end int32[B]. ``launch``: its keyword options
    (block_t, num_splits, num_warps, num_stages, key_path, precision; another name is a
    TypeError); ``rope_inv_freq``: float32[M] as there (pre-RoPE keys). A non-None answer means
    "use the XLA reference path". Only shapes / dtypes are inspected (works at trace time).
    """
    try:
        dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end)
        plan_pq_kernel(dims, k_codes, v_codes, rope=rope_inv_freq is not None, **launch)
        if rope_inv_freq is not None:
            check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim, dims.num_kv_heads)
    except ValueError as e:
        return str(e)
    return None

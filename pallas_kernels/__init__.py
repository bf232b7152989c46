"""Pallas kernels for million-jax (leaf package: imports nothing from million_jax / models).

The PQ decode kernel is split by job: ``pq_decode_attention`` (the public entry and the
launch), ``pq_kernel`` (the kernel body), ``pq_plan`` / ``pq_support`` (the launch plan and
the shapes it takes), ``pq_reference`` (its pure-jnp reference). The pure-jnp math that the
reference shares with the library lives here too, once: ``softmax`` (masked / online softmax,
log-sum-exp merge), ``pq_math`` (centroid gather, lookup tables, RoPE angles of code rows) and
``code_packing`` (codes at their real width).
"""

from pallas_kernels.launch import LaunchConfig, default_launch_config
from pallas_kernels.pq_math import build_lut, gather_centroids, lut_scores
from pallas_kernels.softmax import (
    OnlineSoftmax,
    einsum_f32,
    group_heads,
    merge_partials,
    merge_stacked,
    softmax_attention,
    ungroup_heads,
)
from pallas_kernels._pq_inputs import pq_dims
from pallas_kernels.pq_decode_attention import pq_decode_attention, pq_decode_attention_planned
from pallas_kernels.pq_plan import KernelPlan, plan_pq_kernel, pq_kernel_unsupported_reason
from pallas_kernels.pq_reference import pq_decode_attention_reference

__all__ = [
    "OnlineSoftmax",
    "build_lut",
    "einsum_f32",
    "gather_centroids",
    "group_heads",
    "lut_scores",
    "softmax_attention",
    "ungroup_heads",
    "LaunchConfig",
    "default_launch_config",
    "merge_partials",
    "merge_stacked",
    "KernelPlan",
    "plan_pq_kernel",
    "pq_decode_attention",
    "pq_decode_attention_planned",
    "pq_dims",
    "pq_decode_attention_reference",
    "pq_kernel_unsupported_reason",
]

"""Pallas kernels for million-jax (leaf package: imports nothing from million_jax / models).

Each kernel file holds the kernel and its pure-jnp reference. The pure-jnp math that the
references share with the library lives here too, once: ``softmax`` (masked / online softmax,
log-sum-exp merge) and ``pq_math`` (centroid gather, lookup tables).
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
from pallas_kernels.pq_decode_attention import (
    KernelPlan,
    plan_pq_kernel,
    pq_decode_attention,
    pq_decode_attention_planned,
    pq_decode_attention_reference,
    pq_dims,
    pq_kernel_unsupported_reason,
)

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

"""Pallas kernels for million-jax (leaf package: imports nothing from million_jax / models).

Each kernel file holds the kernel and its pure-jnp reference.
"""

from pallas_kernels.launch import LaunchConfig, default_launch_config
from pallas_kernels.merge import merge_partials, merge_stacked
from pallas_kernels.pq_decode_attention import (
    pq_decode_attention,
    pq_decode_attention_reference,
    pq_kernel_unsupported_reason,
)

__all__ = [
    "LaunchConfig",
    "default_launch_config",
    "merge_partials",
    "merge_stacked",
    "pq_decode_attention",
    "pq_decode_attention_reference",
    "pq_kernel_unsupported_reason",
]

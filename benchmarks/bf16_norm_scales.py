"""``million-jax`` with the PQ cache's norm scales stored in bfloat16, the format before 2026-12-07:
the baseline of the float16 scales' rows (``results/frontier/key_bits/norm_scale_f16``).

    PYTHONPATH=. python benchmarks/bf16_norm_scales.py eval --model gemma3-270m ... --cache pq --codebooks F

The same arguments as ``million-jax``; only ``million_jax.cache.pq_cache.NORM_SCALE_DTYPE`` differs.
"""
import sys

import jax.numpy as jnp

import million_jax.cache.pq_cache as pq_cache
from million_app.cli import main

if __name__ == "__main__":
    pq_cache.NORM_SCALE_DTYPE = jnp.bfloat16
    sys.exit(main())

"""End-to-end long-context decoding on one GPU: PQ KV cache vs bf16 KV cache, and GPU k-means.

What it measures, the outputs and how to run it: the docstring of ``cli`` (also printed by
``python -m benchmarks.gpu_e2e --help``).

Modules, each importing only those listed after it (no cycles; ``tests/test_imports.py``):
cli (command line -> Settings, main), runner (the ordered grid, one pair at a time), decode
(per-row compile / fill / time of PQ vs bf16), kmeans_gpu, calibrate (codebooks), prefill
(real and synthetic fill), state (the run's shared bookkeeping and the loaded model), caches
(every cache construction and layout use), shapes (model shapes, bytes model), memory
(compiled memory analysis, HLO), report (JSON + markdown), budget (time guard), settings.
"""

import os

from . import budget  # noqa: F401 - first: starts the time guard's clock before jax is imported

# JAX preallocates 75% of GPU memory by default; the long-context rows need more.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

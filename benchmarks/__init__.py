"""Benchmark scripts (``python benchmarks/<name>.py``) and the ``gpu_e2e`` package
(``python -m benchmarks.gpu_e2e``); results land in ``benchmarks/results/``."""

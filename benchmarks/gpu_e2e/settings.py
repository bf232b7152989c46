"""``Settings``: everything a run needs, resolved from the command line by ``cli.parse_args``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run needs, resolved from the command line (see ``parse_args``)."""

    tiny: bool
    models: tuple[str, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    new_tokens: int
    repeats: int
    M: int
    nbits: int
    window: int
    sinks: int
    pq_impl: str
    dtype: str  # weights and full-precision caches: bfloat16 (float32 for --tiny on CPU)
    prefill_batches: tuple[int, ...]
    prefill_max_context: int
    prefill_score_bytes: int
    calib_tokens: int
    calib_iters: int
    calib_chunk: int
    kmeans_vectors: int
    kmeans_dim: int
    kmeans_M: int
    kmeans_nbits: int
    kmeans_iters: int
    skip_kmeans: bool
    budget_s: float
    assume_device_bytes: int | None
    out: str
    stamp: str
    fail_pallas: bool  # test hook: pretend the Pallas kernel fails at compile time
    plan_only: bool

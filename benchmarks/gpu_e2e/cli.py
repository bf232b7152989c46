"""Command line -> Settings, and ``main``."""

from __future__ import annotations

import argparse
import dataclasses

import jax

from .._gpu_common import GiB, gpu_parser, today, warn_if_no_gpu

from .. import gpu_e2e as _package
from .runner import Runner
from .shapes import model_configs


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


def _parser() -> argparse.ArgumentParser:
    p = gpu_parser(_package.__doc__, "tiny models on CPU (smoke test)")
    p.prog = "python -m benchmarks.gpu_e2e"
    p.add_argument("--quick", action="store_true", help="reduced grid: contexts 4K + 32K, N=8")
    p.add_argument("--models", nargs="*", default=None, help="subset of model names")
    p.add_argument("--new-tokens", type=int, default=None, help="N tokens per timed generate call")
    p.add_argument("--repeats", type=int, default=None, help="timed generate calls per row")
    p.add_argument("--M", type=int, default=None, help="PQ subspaces (default d/2)")
    p.add_argument("--nbits", type=int, default=None, help="PQ bits per code (default 8; 6 with --tiny)")
    p.add_argument("--window", type=int, default=0, help="PQCache exact recent-token window")
    p.add_argument("--sinks", type=int, default=0, help="PQCache exact sink tokens")
    p.add_argument("--pq-impl", default="auto", choices=["auto", "pallas", "xla"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and bf16-cache dtype (default bfloat16; float32 with --tiny, since "
                        "XLA:CPU rejects the dense cache's batched bf16 x bf16 -> f32 dots at batch > 1)")
    p.add_argument("--prefill-batches", type=int, nargs="*", default=None,
                   help="batches whose rows are filled by a real (timed) prefill")
    p.add_argument("--prefill-max-context", type=int, default=None,
                   help="longest context filled by a real prefill (longer: synthetic fill)")
    p.add_argument("--prefill-score-gib", type=float, default=6.0,
                   help="bound on one chunk's fp32 score tensor; sets the prefill chunk size")
    p.add_argument("--calib-tokens", type=int, default=None)
    p.add_argument("--calib-iters", type=int, default=None)
    p.add_argument("--kmeans-vectors", type=int, default=None)
    p.add_argument("--skip-kmeans", action="store_true")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new work past this many seconds from start")
    p.add_argument("--assume-device-bytes", type=int, default=None,
                   help="device memory limit for the OOM prediction (default: memory_stats)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache dir")
    p.add_argument("--plan", action="store_true",
                   help="print the ordered work items with cache sizes and exit (runs nothing)")
    p.add_argument("--fail-pallas", action="store_true", help=argparse.SUPPRESS)
    return p


def _defaults(tiny: bool, quick: bool) -> dict:
    """The settings --tiny, --quick or a full run start from."""
    if tiny:
        return dict(contexts=(64,), batches=(1, 2), new_tokens=4, repeats=2, prefill_batches=(1,),
                    prefill_max_context=1 << 30, calib_tokens=64, calib_iters=2, calib_chunk=64,
                    kmeans=(4096, 16, 8, 6, 2), budget=300.0, nbits=6, dtype="float32")
    if quick:
        return dict(contexts=(4096, 32768), batches=(1, 8), new_tokens=8, repeats=2,
                    prefill_batches=(1,), prefill_max_context=4096, calib_tokens=1024,
                    calib_iters=4, calib_chunk=32, kmeans=(1 << 20, 128, 64, 8, 25), budget=300.0)
    return dict(contexts=(4096, 16384, 32768, 65536), batches=(1, 8), new_tokens=16,
                repeats=3, prefill_batches=(1,), prefill_max_context=32768,
                calib_tokens=1024, calib_iters=4, calib_chunk=32,
                kmeans=(1 << 20, 128, 64, 8, 25), budget=480.0)


def parse_args(argv: list[str] | None) -> Settings:
    """Command line -> Settings (defaults depend on --tiny / --quick)."""
    p = _parser()
    a = p.parse_args(argv)

    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
    names = model_configs(a.tiny)
    models = tuple(a.models) if a.models else (("tiny-gqa",) if a.tiny else tuple(names))
    unknown = [m for m in models if m not in names]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(names)}")
    head_dim = names[models[0]].head_dim
    dflt = _defaults(a.tiny, a.quick)
    km = dflt["kmeans"]
    return Settings(
        tiny=a.tiny,
        models=models,
        contexts=tuple(a.contexts or dflt["contexts"]),
        batches=tuple(a.batches or dflt["batches"]),
        new_tokens=a.new_tokens or dflt["new_tokens"],
        repeats=a.repeats or dflt["repeats"],
        M=a.M or head_dim // 2,
        nbits=a.nbits or dflt.get("nbits", 8),
        window=a.window,
        sinks=a.sinks,
        pq_impl=a.pq_impl,
        dtype=a.dtype or dflt.get("dtype", "bfloat16"),
        prefill_batches=tuple(dflt["prefill_batches"] if a.prefill_batches is None else a.prefill_batches),
        prefill_max_context=(dflt["prefill_max_context"] if a.prefill_max_context is None
                             else a.prefill_max_context),
        prefill_score_bytes=int(a.prefill_score_gib * GiB),
        calib_tokens=a.calib_tokens or dflt["calib_tokens"],
        calib_iters=a.calib_iters or dflt["calib_iters"],
        calib_chunk=dflt["calib_chunk"],
        kmeans_vectors=a.kmeans_vectors or km[0],
        kmeans_dim=km[1],
        kmeans_M=km[2],
        kmeans_nbits=km[3],
        kmeans_iters=km[4],
        skip_kmeans=a.skip_kmeans,
        budget_s=dflt["budget"] if a.budget_s is None else a.budget_s,
        assume_device_bytes=a.assume_device_bytes,
        out=a.out,
        stamp=today(),
        fail_pallas=a.fail_pallas,
        plan_only=a.plan,
    )


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    warn_if_no_gpu(s.tiny)
    runner = Runner(s)
    return runner.print_plan() if s.plan_only else runner.run()

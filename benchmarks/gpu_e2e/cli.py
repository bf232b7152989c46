"""End-to-end long-context decoding on one GPU: PQ KV cache vs bf16 KV cache, and GPU k-means.

MILLION's headline experiment, in our JAX model, in one call on a lent H200 (installs
nothing, reads nothing from the network):

  * models: a LLaMA-2-7B-shaped decoder (32 layers, 32 q / 32 kv heads, d 128) and a
    LLaMA-3.1-8B-shaped one (32 / 8, GQA), random bf16 weights generated on the device;
  * caches: the preallocated, donated bf16 ``DenseCache`` (the baseline) and the ``PQCache``
    (M=64, nbits=8: 4 bits / element, no exact window or sinks by default) with layer_head
    codebooks from a quick k-means on the model's own post-RoPE K/V (a short random-token
    prompt prefilled into a DenseCache -> ``collect_kv`` -> ``fit_kv_codebooks``);
  * grid: batch 1 and 8 x contexts 4K, 16K, 32K, 64K, ordered so the headline rows (batch 1
    at 32K and 4K, both models) run first;
  * the project's k-means (``million_jax.quant.pq.fit_codebooks``) on 1M vectors, d=128, M=64,
    nbits=8, 25 iterations.

Per row (model, batch, context, cache):
  fill     "prefill": the context (random tokens) is run through the model by a jitted
           ``lax.fori_loop`` of chunked ``models.prefill`` calls, cache donated; timed once
           (``prefill_seconds``; for PQ this includes encoding every token). Used for batch 1
           up to 32K by default. "synthetic": the cache is created already holding
           ``context`` tokens of hashed pseudo-random K/V (bf16) or codes (PQ); decode time
           does not depend on the values, and this keeps the O(T^2) jnp prefill of long or
           batched contexts out of the time budget. ``prefill_seconds`` is then null.
  decode   ``ms_per_token``: ``models.generate`` (inside one jit, cache donated) continuing
           the filled cache with a 1-token prompt for N new tokens: one t=1 prefill step plus
           N-1 steps of the ``lax.while_loop``, i.e. N forward passes; wall time / N, median
           of ``--repeats`` calls after one warm-up call (compiled ahead, so no compile time
           is included). EOS is disabled so every call makes exactly N tokens.
  memory   ``peak_bytes``: the compiled decode program's memory analysis (arguments +
           outputs + temporaries - donated aliases: weights + cache + scratch). JAX cannot
           reset the allocator's ``peak_bytes_in_use``, so that is recorded only as the
           process-wide running maximum (``process_peak_bytes_in_use``), next to the live
           ``bytes_in_use`` right after the fill. A row whose compiled programs would not fit
           in the free device memory is recorded as "oom" without allocating anything; a
           RESOURCE_EXHAUSTED at run time is caught and recorded the same way.
  impl     PQ decode uses the Pallas kernel on GPU when it supports the shapes (what
           ``impl="auto"`` does); if it fails to compile or run, the row is redone with
           ``impl="xla"`` (recorded in ``impl`` / ``impl_note``) and later rows use xla.

A global time guard (``--budget-s``) stops starting new work when the estimated cost of the
next step would overrun, records the rest as "skipped", and still writes the results. The
JSON and markdown are rewritten after every row, so a run cut short leaves what it had.

Outputs: <out>/gpu_e2e_<date>.json (a list of row dicts; ``kind`` is "env", "model",
"kmeans" or "decode"; every row carries model, context, batch, cache, ms_per_token, speedup,
peak_bytes, prefill_seconds, impl, device) and <out>/gpu_e2e_<date>.md (tables and a "where
the time goes" section computed from the measured numbers and a measured copy bandwidth).

Run from the repository root:

  python -m benchmarks.gpu_e2e --out DIR           # full grid, about 8 min on an H200
  python -m benchmarks.gpu_e2e --quick --out DIR   # contexts 4K + 32K, fewer tokens
  python -m benchmarks.gpu_e2e --tiny --out DIR    # CPU smoke test, tiny models (< 1 min)

This module: the command line -> ``Settings``, and ``main``. The package docstring lists the
other modules.
"""

from __future__ import annotations

import argparse

import jax

from .._gpu_common import GiB, gpu_parser, today, warn_if_no_gpu
from .runner import Runner
from .settings import Settings
from .shapes import model_configs


def _parser() -> argparse.ArgumentParser:
    p = gpu_parser(__doc__, "tiny models on CPU (smoke test)")
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

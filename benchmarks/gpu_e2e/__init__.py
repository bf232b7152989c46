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

Modules: cli (command line, main), budget (time guard), shapes (model shapes, bytes model),
caches (every cache construction and layout use), calibrate (codebooks), prefill (real and
synthetic fill), decode (per-row compile / fill / time of PQ vs bf16), memory (compiled
memory analysis, HLO), kmeans_gpu, runner (the grid), report (JSON + markdown).
"""

import os

from . import budget  # noqa: F401 - first: starts the time guard's clock before jax is imported

# JAX preallocates 75% of GPU memory by default; the long-context rows need more.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

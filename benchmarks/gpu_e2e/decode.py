"""One decode row (model, batch, context, cache): guard, compile, fill, time PQ vs bf16."""

from __future__ import annotations

import gc
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import LlamaConfig, generate

from .._gpu_common import GiB, memory_stats
from .caches import empty_cache_fn, max_length, pq_kernel_supported
from .calibrate import calibrate
from .memory import compile_program, failure_status, is_oom, layer_state_ops, short_error
from .prefill import compile_fill, fill_cache, prefill_work
from .report import new_row
from .shapes import cache_bytes_per_step, param_bytes, t_max_for, tree_bytes, weight_bytes_per_step
from .state import ModelState, RunState


def make_generate_fn(config: LlamaConfig, new_tokens: int) -> Callable[..., Any]:
    """jit(params, cache, token int[B], consts) -> (tokens, num_generated, cache).

    ``models.generate`` continuing the cache with a 1-token prompt, EOS disabled: N forward
    passes (the prompt step + N-1 while_loop steps). The cache is donated.
    """

    def run(params, cache, token, consts):
        b = token.shape[0]
        res = generate(config, params, cache, token[:, None], jnp.ones((b,), jnp.int32),
                       max_new_tokens=new_tokens, eos_id=(), cache_consts=consts)
        return res.tokens, res.num_generated, res.cache

    return jax.jit(run, donate_argnums=(1,))


def pq_impl(r: RunState, m: ModelState, batch: int, t_max: int) -> str:
    """'pallas' or 'xla': what impl='auto' picks on this backend (or the forced choice)."""
    if r.s.pq_impl != "auto":
        return r.s.pq_impl
    if not r.on_gpu and not r.s.fail_pallas:
        return "xla"
    return "pallas" if pq_kernel_supported(m.config, r.s, batch, t_max) else "xla"


def estimate_row(r: RunState, m: ModelState, batch: int, context: int, t_max: int, cache: str,
                 real: bool) -> float:
    """Seconds a row is expected to take (compiles + runs), for the time guard."""
    c, s = m.config, r.s
    est = r.compile_estimate(f"generate-{cache}")
    if real:
        est += r.compile_estimate(f"prefill-{cache}")
        rate = r.prefill_rate or (5e-12 if not s.tiny else 1e-9)
        est += prefill_work(c, batch, context, t_max, cache) * rate
    else:
        est += 2.0
    bw = r.copy_bw if math.isfinite(r.copy_bw) else 1e12
    floor = (weight_bytes_per_step(c, batch, jnp.dtype(s.dtype).itemsize)
             + cache_bytes_per_step(c, s, cache, "xla", batch, context, t_max)) / bw
    est += (1 + s.repeats) * s.new_tokens * floor * 4 + 1.0
    if cache == "pq" and m.codebooks is None:
        est += 20.0
    return est


def cache_row(r: RunState, m: ModelState, batch: int, context: int, cache: str) -> dict[str, Any]:
    """Append and run one decode row; PQ falls back to xla when the Pallas kernel fails."""
    s, c = r.s, m.config
    t_max = t_max_for(s, context)
    real = r.uses_prefill(batch, context)
    pq = cache == "pq"
    row = new_row("decode", r.device, model=m.name, context=context, batch=batch, cache=cache,
                  t_max=t_max, new_tokens=s.new_tokens, repeats=s.repeats,
                  fill="prefill" if real else "synthetic",
                  M=s.M if pq else None, nbits=s.nbits if pq else None,
                  window=s.window if pq else None, sinks=s.sinks if pq else None,
                  weight_bytes_per_step=weight_bytes_per_step(c, batch, jnp.dtype(s.dtype).itemsize))
    r.rows.append(row)
    where = f"{m.name} B={batch} T={context} {cache}"
    est = estimate_row(r, m, batch, context, t_max, cache, real)
    if not r.budget.allows(est):
        row.update(status="skipped", error=r.budget.skip_reason(est))
        r.log(f"{where}: skipped (time budget)")
        return row
    limit = r.device_limit()
    if limit is not None:  # cheap check before compiling anything: weights + cache alone
        other = r.bytes_in_use() - (0 if r.loaded is None else tree_bytes(r.loaded.params))
        cache_b = r.cache_bytes(m, batch, t_max, cache)
        need = other + param_bytes(c, jnp.dtype(s.dtype).itemsize) + cache_b
        if need > 0.98 * limit:
            row.update(status="oom", cache_bytes=cache_b, predicted_bytes=need,
                       error=f"predicted: weights + cache need {need / GiB:.1f} GiB of {limit / GiB:.1f} GiB")
            r.log(f"{where}: oom ({row['error']})")
            return row
    try:
        r.load(m)
        if pq and m.codebooks is None:
            calibrate(s, m, r.log)
    except Exception as e:  # noqa: BLE001
        row.update(status=failure_status(e), error=f"setup: {short_error(e)}")
        r.log(f"{m.name}: setup FAILED {short_error(e)}")
        return row
    impl = pq_impl(r, m, batch, t_max) if pq else "xla"
    note = None
    if pq and r.pallas_broken and impl == "pallas":
        impl, note = "xla", f"pallas failed earlier: {r.pallas_broken}"
    result = run_row(r, m, batch, context, t_max, cache, impl, real, row)
    if pq and impl == "pallas" and result == "pallas-failed":
        note = f"pallas failed: {row.get('error')}"
        r.pallas_broken = row.get("error")
        row.update(status=None, error=None)
        gc.collect()
        impl = "xla"
        result = run_row(r, m, batch, context, t_max, cache, impl, real, row)
    row.update(impl=impl, impl_note=note)
    if row["status"] == "ok":
        r.log(f"{where}[{impl}] {row['fill']}: "
              f"{row['ms_per_token']:.2f} ms/token, peak {(row['peak_bytes'] or 0) / GiB:.1f} GiB, "
              f"compile {row['compile_seconds']:.1f}s"
              + ("" if row["prefill_seconds"] is None else
                 f", prefill {row['prefill_seconds']:.2f}s (compile {row['prefill_compile_seconds']:.1f}s)"))
    else:
        r.log(f"{where}[{impl}]: {row['status']} {row.get('error') or ''}")
    gc.collect()
    return row


def run_row(r: RunState, m: ModelState, batch: int, context: int, t_max: int, cache: str, impl: str,
            real: bool, row: dict[str, Any]) -> str:
    """Compile, check memory, fill, time. Returns 'ok', 'failed' or 'pallas-failed'."""
    s, c = r.s, m.config
    consts = m.codebooks if cache == "pq" else None
    make_empty = empty_cache_fn(s, c, m.codebooks, batch, t_max, cache, impl)
    cache_struct = jax.eval_shape(make_empty)
    tok_struct = jax.ShapeDtypeStruct((batch,), jnp.int32)
    stage = "compile"
    filled = None
    try:
        if s.fail_pallas and impl == "pallas":
            raise RuntimeError("simulated Pallas failure (--fail-pallas)")
        # 1. compile the fill and decode programs (no device memory for the cache yet)
        fill = compile_fill(s, m, batch, context, t_max, cache, make_empty, cache_struct, consts, real, row)
        if real:
            r.note_compile(f"prefill-{cache}", fill.compile_seconds)
        gen = compile_program(make_generate_fn(c, s.new_tokens), m.params, cache_struct, tok_struct, consts)
        r.note_compile(f"generate-{cache}", gen.compile_seconds)
        row.update(compile_seconds=gen.compile_seconds, peak_bytes=gen.peak_bytes,
                   peak_source="compiled memory analysis (arguments + outputs + temporaries - aliases)",
                   memory_analysis=gen.memory, cache_bytes=tree_bytes(cache_struct),
                   codebook_bytes=None if consts is None else consts.nbytes,
                   cache_read_bytes_per_step=cache_bytes_per_step(c, s, cache, impl, batch, context, t_max),
                   hlo_layer_state_ops=layer_state_ops(gen.hlo_text, cache_struct))
        # 2. memory check: the cache and scratch must fit next to what is already resident
        limit = r.device_limit()
        resident = tree_bytes(m.params) + (0 if consts is None else tree_bytes(consts))
        need = max(p.peak_bytes or 0 for p in (fill, gen)) - resident
        if not real:
            need = max(need, tree_bytes(cache_struct))
        row["predicted_bytes"] = r.bytes_in_use() + need
        if limit is not None and row["predicted_bytes"] > 0.98 * limit:
            row.update(status="oom", error=(f"predicted: needs {row['predicted_bytes'] / GiB:.1f} GiB "
                                            f"of {limit / GiB:.1f} GiB (compiled memory analysis)"))
            return "failed"
        # 3. fill the cache
        stage = "fill"
        filled = fill_cache(fill, m, batch, context, make_empty, consts, real, row)
        if real:
            rate = row["prefill_seconds"] / prefill_work(c, batch, context, t_max, cache)
            r.prefill_rate = max(r.prefill_rate or 0.0, rate)
        stats = memory_stats()
        row["bytes_in_use_after_fill"] = None if stats is None else stats.get("bytes_in_use")
        if cache == "bf16" and real and m.codebooks is None:
            calibrate(s, m, r.log, filled)  # reuse this prefill's K/V for the PQ rows
        # 4. decode: warm-up, then timed calls; each continues the cache (N tokens per call)
        stage = "decode"
        token = jax.random.randint(jax.random.key(12), (batch,), 0, c.vocab, jnp.int32)
        times, counts = [], []
        for i in range(1 + s.repeats):
            t0 = time.perf_counter()
            out = gen(m.params, filled, token, consts)
            filled = None
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            _, n_gen, filled = out
            out = None
            counts.append(int(jnp.min(n_gen)))
            if i:
                times.append(dt)
        ms = [1e3 * t / s.new_tokens for t in times]
        stats = memory_stats()
        row.update(status="ok", ms_per_token=float(np.median(ms)), ms_per_token_min=min(ms),
                   times_ms_per_token=ms, tokens_per_s=1e3 * batch / float(np.median(ms)),
                   final_length=max_length(filled),
                   process_peak_bytes_in_use=None if stats is None else stats.get("peak_bytes_in_use"))
        if min(counts) != s.new_tokens:
            row.update(status="error", error=f"a generate call stopped early: {counts} tokens")
        return "ok" if row["status"] == "ok" else "failed"
    except Exception as e:  # noqa: BLE001 - record the row, carry on with the next
        oom = is_oom(e)
        row.update(status=failure_status(e), error=f"{stage}: {short_error(e)}")
        if not oom and not s.tiny:
            traceback.print_exc(limit=3)
        if cache == "pq" and impl == "pallas" and not oom:
            return "pallas-failed"
        return "failed"
    finally:
        filled = out = None  # noqa: F841
        gc.collect()

"""The run: the ordered grid of (model, batch, context) pairs, results after every row."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._gpu_common import GiB, copy_bandwidth
from .decode import cache_row
from .kmeans_gpu import bench_kmeans
from .report import new_row, print_summary
from .settings import Settings
from .shapes import param_bytes, t_max_for
from .state import ModelState, RunState


def plan(s: Settings) -> list[tuple[str, Any]]:
    """Work items in priority order: headline pairs first, then k-means, then the rest.

    Pairs (batch, context) run for every model before the next pair, so a run cut short by
    the time guard still has both models at the most important shapes.
    """
    bmin = min(s.batches)
    short = [c for c in s.contexts if c <= 32768]
    head = max(short) if short else min(s.contexts)  # MILLION's headline is 32K
    stage1 = [(bmin, head)] + ([(bmin, min(s.contexts))] if min(s.contexts) != head else [])
    rest = sorted(((b, t) for b in s.batches for t in s.contexts if (b, t) not in stage1),
                  key=lambda bt: (bt[0] * bt[1], bt[0]))
    items: list[tuple[str, Any]] = [("pair", bt) for bt in stage1]
    if not s.skip_kmeans:
        items.append(("kmeans", None))
    items += [("pair", bt) for bt in rest]
    return items


class Runner(RunState):
    """Runs the grid (``plan``): a bf16 and a PQ row per pair, k-means, results after every row."""

    # --- the whole run -----------------------------------------------------------------
    def pair(self, m: ModelState, batch: int, context: int) -> None:
        """The bf16 row, then the PQ row, of one (model, batch, context); sets the speedup."""
        dense = cache_row(self, m, batch, context, "bf16")
        pq = cache_row(self, m, batch, context, "pq")
        if dense["status"] == "ok":
            dense["speedup"] = 1.0
        if dense["status"] == "ok" and pq["status"] == "ok":
            pq["speedup"] = dense["ms_per_token"] / pq["ms_per_token"]
        self.write()

    def print_plan(self) -> int:
        """The work items in order, with the fill kind and weight / cache sizes (nothing runs)."""
        s = self.s
        limit = self.device_limit()
        fp = jnp.dtype(s.dtype).itemsize
        print(f"budget {s.budget_s:.0f}s, device limit {self.limit_text()}; N={s.new_tokens}, "
              f"repeats={s.repeats}", flush=True)
        for what, arg in plan(s):
            if what == "kmeans":
                print(f"k-means {s.kmeans_vectors} x {s.kmeans_dim}, M={s.kmeans_M}, nbits={s.kmeans_nbits}, "
                      f"{s.kmeans_iters} iterations", flush=True)
                continue
            batch, context = arg
            t_max = t_max_for(s, context)
            for m in self.models:
                w = param_bytes(m.config, fp)
                sizes = []
                for cache in ("bf16", "pq"):
                    cb = self.cache_bytes(m, batch, t_max, cache)
                    fits = "" if limit is None or w + cb <= 0.98 * limit else " (OOM)"
                    sizes.append(f"{cache} {cb / GiB:6.1f} GiB{fits}")
                fill = "prefill" if self.uses_prefill(batch, context) else "synthetic"
                print(f"{m.name:12s} B={batch} T={context:6d} {fill:9s} "
                      f"weights {w / GiB:5.1f} GiB, " + ", ".join(sizes), flush=True)
        return 0

    def run(self) -> int:
        s = self.s
        self.copy_bw = copy_bandwidth(s.tiny)
        self.meta = dict(self.info, copy_gbps=self.copy_bw / 1e9, date=s.stamp, M=s.M, nbits=s.nbits,
                         window=s.window, sinks=s.sinks, granularity="layer_head", dtype=s.dtype,
                         new_tokens=s.new_tokens, repeats=s.repeats, pq_impl_requested=s.pq_impl,
                         budget_s=s.budget_s, tiny=s.tiny, models=list(s.models),
                         contexts=list(s.contexts), batches=list(s.batches),
                         prefill_batches=list(s.prefill_batches), prefill_max_context=s.prefill_max_context,
                         calib_tokens=s.calib_tokens, calib_iters=s.calib_iters,
                         timing=("decode: models.generate in one jit (cache donated) continuing the filled "
                                 "cache with a 1-token prompt for N tokens = N forward passes; wall time / N, "
                                 "median of the timed calls after one warm-up; compile excluded"),
                         peak_source="compiled memory analysis of the decode program (arguments + outputs "
                                     "+ temporaries - donated aliases); allocator peak not resettable")
        self.rows.append(new_row("env", self.device, copy_gbps=self.copy_bw / 1e9,
                                 **{k: v for k, v in self.info.items() if k != "device"}))
        self.log(f"device {self.device} ({self.info['platform']}), jax {jax.__version__}, copy bandwidth "
                 f"{self.copy_bw / 1e9:.0f} GB/s, memory limit {self.limit_text()}, budget {s.budget_s:.0f}s")
        self.write()
        for what, arg in plan(s):
            if what == "kmeans":
                bench_kmeans(self)
                self.write()
                continue
            batch, context = arg
            for m in self.models:
                self.pair(m, batch, context)
        self.meta["elapsed_s"] = self.budget.elapsed()
        base = self.write()
        print_summary(self.rows)
        self.log(f"wrote {base}.json and {base}.md")
        return 0

"""The run's shared state: the settings, the time guard, the rows, the one loaded model.

``RunState`` is what the per-row code (``decode``, ``kmeans_gpu``) reads and updates;
``runner.Runner`` extends it with the grid. Nothing here imports the row code.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import jax
import jax.numpy as jnp

from models import LlamaConfig, init_params

from .._gpu_common import GiB, device_info, memory_stats
from .budget import Budget
from .caches import PQCodebooks, empty_cache_fn
from .report import new_row, write_results
from .settings import Settings
from .shapes import model_configs, tree_bytes


@dataclasses.dataclass
class ModelState:
    """A model's config, its live params (while loaded) and its codebooks once fitted."""

    name: str
    config: LlamaConfig
    seed: int
    params: Any = None
    codebooks: PQCodebooks | None = None
    info_row: dict[str, Any] | None = None


class RunState:
    """Keeps the rows (written after every row), the compile and prefill rates, the loaded model."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.budget = Budget(s.budget_s)
        self.info = device_info()
        self.device = self.info["device"]
        self.on_gpu = self.info["platform"] == "gpu"
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.copy_bw = float("nan")
        self.pallas_broken: str | None = None
        self.compile_s: dict[str, float] = {}  # worst compile time seen per program kind
        self.prefill_rate: float | None = None  # seconds per unit of prefill.prefill_work
        configs = model_configs(s.tiny)
        self.models = [ModelState(n, configs[n], seed=i) for i, n in enumerate(s.models)]
        self.loaded: ModelState | None = None

    # --- bookkeeping ------------------------------------------------------------
    def log(self, msg: str) -> None:
        print(f"[{self.budget.elapsed():6.1f}s] {msg}", flush=True)

    def write(self) -> str:
        return write_results(self.rows, self.meta, self.s.out, self.s.stamp)

    def device_limit(self) -> int | None:
        if self.s.assume_device_bytes is not None:
            return self.s.assume_device_bytes
        stats = memory_stats()
        return None if stats is None else stats.get("bytes_limit")

    def limit_text(self) -> str:
        limit = self.device_limit()
        return "unknown" if limit is None else f"{limit / GiB:.1f} GiB"

    def bytes_in_use(self) -> int:
        stats = memory_stats()
        if stats is None:  # CPU: count what we hold
            return 0 if self.loaded is None else tree_bytes(self.loaded.params)
        return int(stats.get("bytes_in_use", 0))

    def cache_bytes(self, m: ModelState, batch: int, t_max: int, cache: str) -> int:
        """Bytes of a row's cache (shapes only; nothing is allocated)."""
        return tree_bytes(jax.eval_shape(empty_cache_fn(self.s, m.config, m.codebooks, batch, t_max,
                                                        cache, "xla")))

    def note_compile(self, kind: str, seconds: float) -> None:
        self.compile_s[kind] = max(self.compile_s.get(kind, 0.0), seconds)

    def compile_estimate(self, kind: str) -> float:
        default = 5.0 if self.s.tiny else 30.0
        return self.compile_s.get(kind, max(self.compile_s.values(), default=default))

    def uses_prefill(self, batch: int, context: int) -> bool:
        return batch in self.s.prefill_batches and context <= self.s.prefill_max_context

    # --- models -------------------------------------------------------------------
    def load(self, m: ModelState) -> None:
        """Make ``m`` the one model with weights on the device (random bf16, made there)."""
        if self.loaded is m:
            return
        if self.loaded is not None:
            self.loaded.params = None
            self.loaded = None
            gc.collect()
        t0 = time.perf_counter()
        m.params = jax.block_until_ready(init_params(m.config, jax.random.key(1000 + m.seed), jnp.dtype(self.s.dtype)))
        dt = time.perf_counter() - t0
        self.loaded = m
        if m.info_row is None:
            m.info_row = new_row("model", self.device, model=m.name, init_seconds=dt,
                                 param_bytes=tree_bytes(m.params),
                                 config=dataclasses.asdict(m.config))
            self.rows.append(m.info_row)
        self.log(f"{m.name}: weights {tree_bytes(m.params) / GiB:.2f} GiB in {dt:.1f}s")

"""The project's k-means (``million_jax.quant.pq.fit_codebooks``) timed on the device."""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.quant.pq import Codebooks, fit_codebooks, reconstruction_mse

from .memory import failure_status, short_error
from .report import new_row
from .state import RunState


def bench_kmeans(r: RunState) -> None:
    """Append the "kmeans" row: a first call (incl. compile), then a timed second call."""
    s = r.s
    row = new_row("kmeans", r.device, model="kmeans", n_vectors=s.kmeans_vectors,
                  dim=s.kmeans_dim, M=s.kmeans_M, nbits=s.kmeans_nbits, iters=s.kmeans_iters,
                  data="standard normal, generated on the device")
    r.rows.append(row)
    est = 2 * r.compile_estimate("kmeans") + 10
    if not r.budget.allows(est):
        row.update(status="skipped", error=r.budget.skip_reason(est))
        return
    try:
        x = jax.random.normal(jax.random.key(3), (s.kmeans_vectors, s.kmeans_dim), jnp.float32)
        fit = lambda key: fit_codebooks(x, s.kmeans_M, s.kmeans_nbits, key=key,  # noqa: E731
                                        iters=s.kmeans_iters).centroids
        t0 = time.perf_counter()
        c = jax.block_until_ready(fit(jax.random.key(0)))
        first = time.perf_counter() - t0
        r.note_compile("kmeans", first)
        t0 = time.perf_counter()
        c = jax.block_until_ready(fit(jax.random.key(1)))
        second = time.perf_counter() - t0
        mse = float(reconstruction_mse(Codebooks(c), x))
        t0 = time.perf_counter()  # kmeans() checks its input for NaN on the host: part of the time
        bool(np.isfinite(np.asarray(x)).all())
        host_check = time.perf_counter() - t0
        row.update(status="ok", seconds=second, first_call_seconds=first,
                   seconds_per_iter=second / s.kmeans_iters, reconstruction_mse=mse,
                   host_finite_check_seconds=host_check)
        r.log(f"k-means {s.kmeans_vectors} x {s.kmeans_dim}, M={s.kmeans_M}, "
              f"nbits={s.kmeans_nbits}, {s.kmeans_iters} it: {second:.2f}s "
              f"(first call incl. compile {first:.2f}s), MSE {mse:.4f}")
    except Exception as e:  # noqa: BLE001
        row.update(status=failure_status(e), error=short_error(e))
        r.log(f"k-means FAILED {short_error(e)}")
    finally:
        x = c = None  # noqa: F841
        gc.collect()

"""Shared by the GPU benchmarks (``gpu_attention.py`` and the ``gpu_e2e`` package).

The device facts, the measured copy bandwidth, the no-GPU warning, the date stamp, the
command-line options both take, and the writer of the ``<name>_<date>.json`` / ``.md`` pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

GiB = 2**30
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def memory_stats() -> dict[str, int] | None:
    """The first device's allocator statistics (None where the backend keeps none)."""
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has allocator stats
        return None


def device_info() -> dict[str, Any]:
    """Device kind, platform, versions and the memory the allocator manages."""
    dev = jax.devices()[0]
    stats = memory_stats()
    import jaxlib

    return dict(device=dev.device_kind, platform=dev.platform, num_devices=jax.device_count(),
                jax=jax.__version__, jaxlib=getattr(jaxlib, "__version__", "?"),
                bytes_limit=None if stats is None else stats.get("bytes_limit"),
                mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))


def copy_bandwidth(tiny: bool) -> float:
    """Bytes (read + written) per second of x -> x + 1 over a large uint32 array."""
    n = (1 << 16) if tiny else (1 << 30)  # 4 GiB on the GPU
    x = jnp.zeros((n,), jnp.uint32)
    f = jax.jit(lambda a: a + 1)
    x = jax.block_until_ready(f(x))  # compile + warm-up
    reps = 2 if tiny else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        x = f(x)
    jax.block_until_ready(x)
    dt = time.perf_counter() - t0
    del x
    return 2 * n * 4 * reps / dt


def warn_if_no_gpu(tiny: bool) -> None:
    """Say so when a full (not --tiny) run finds no GPU."""
    dev = jax.devices()[0]
    if not tiny and dev.platform != "gpu":
        print(f"warning: no GPU ({dev.device_kind}); timings are not meaningful "
              "(use --tiny on CPU)", flush=True)


def today() -> str:
    """The date stamp in the results file names."""
    return datetime.datetime.now().strftime("%Y-%m-%d")


def gpu_parser(doc: str | None, tiny_help: str) -> argparse.ArgumentParser:
    """A parser with the options both GPU benchmarks take: --tiny, --out, --contexts, --batches."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--contexts", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    return p


def write_json_md(out_dir: str, name: str, stamp: str, rows: list[dict[str, Any]],
                  md_lines: list[str]) -> str:
    """Write <out>/<name>_<stamp>.json (the rows) and .md (the lines); return the path without suffix."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(rows, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write("\n".join(md_lines) + "\n")
    return base

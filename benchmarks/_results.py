"""Shared by the CPU benchmark scripts: the run environment and the JSON results file."""
from __future__ import annotations

import json
import os
import platform
import time

import jax


def run_env(**extra) -> dict:
    """Where and when the numbers were measured (plus any extra fields)."""
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"), **extra}


def write_results(path: str, rows: list[dict], **extra_env) -> None:
    """Write {"env": run_env(...), "rows": rows} to ``path`` and say so."""
    with open(path, "w") as f:
        json.dump({"env": run_env(**extra_env), "rows": rows}, f, indent=2)
    print(f"wrote {path}")

"""Formatting helpers shared by the commands: sizes, JSON files, environment facts."""
from __future__ import annotations

import json
import os
import platform
from typing import Any

import jax

from million_app.errors import UsageError


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_out_dir(path: str, flag: str) -> None:
    """UsageError unless the directory that will hold ``path`` exists."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}: directory {parent} does not exist")


def write_json(path: str, obj: Any, flag: str = "--json") -> None:
    """Write ``obj`` as indented JSON (parent directory must exist)."""
    check_out_dir(path, flag)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
        f.write("\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded next to every result."""
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "machine": platform.machine()}


def memory_line(r: dict) -> str:
    """'4.00 bits/elem; cache 1.5 MiB vs dense bfloat16 6.0 MiB (4.00x smaller)' from an eval dict."""
    if r.get("cache") == "dense":
        line = f"{r['bits_per_elem']:.0f} bits/elem; cache {human_bytes(r['cache_bytes'])}"
        return line + (f" ({r['note']})" if r.get("note") else "")
    ratio = r["dense_cache_bytes"] / max(r["cache_bytes"], 1)
    line = (f"{r['bits_per_elem']:.2f} bits/elem; cache {human_bytes(r['cache_bytes'])} vs "
            f"dense {r['dense_cache_dtype']} {human_bytes(r['dense_cache_bytes'])} "
            f"({ratio:.2f}x smaller)")
    if r.get("codebook_bytes"):
        line += f"; codebooks {human_bytes(r['codebook_bytes'])} (once per model)"
    return line

"""Ahead-of-time compiled programs: compile time, memory analysis, optimized-HLO counts; OOMs."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Program:
    """An ahead-of-time compiled function with its compile time and memory analysis."""

    compiled: Any
    compile_seconds: float
    peak_bytes: int | None  # arguments + outputs + temporaries - aliases
    memory: dict[str, int]
    hlo_text: Callable[[], str]

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)


def compile_program(fn: Callable[..., Any], *args: Any) -> Program:
    """Lower and compile ``fn`` (a jitted function) for ``args`` (arrays or ShapeDtypeStructs)."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    dt = time.perf_counter() - t0
    memory: dict[str, int] = {}
    peak = None
    try:
        m = compiled.memory_analysis()
        if m is not None:
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                      "alias_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes"):
                if hasattr(m, k):
                    memory[k] = int(getattr(m, k))
            peak = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                    + memory["temp_size_in_bytes"] - memory["alias_size_in_bytes"])
    except Exception:  # noqa: BLE001 - memory analysis is optional
        pass
    return Program(compiled, dt, peak, memory, compiled.as_text)


def layer_state_ops(hlo_text: Callable[[], str], cache_struct: Any) -> dict[str, int] | None:
    """Count optimized-HLO instructions that produce a whole per-layer cache array, by opcode.

    A hint for 'where the time goes': each such op per decoded layer moves a full layer of
    cache (e.g. a copy of the layer slice for an in-place update or a custom call operand).
    """
    try:
        text = hlo_text()
    except Exception:  # noqa: BLE001
        return None
    shapes = set()
    for leaf in jax.tree.leaves(cache_struct):
        if len(leaf.shape) == 5 and int(np.prod(leaf.shape)) > 0:
            dt = {"bfloat16": "bf16", "uint8": "u8", "uint16": "u16", "float32": "f32"}.get(
                jnp.dtype(leaf.dtype).name, jnp.dtype(leaf.dtype).name)
            shapes.add(f"{dt}[{','.join(str(d) for d in leaf.shape[1:])}]")
    counts: dict[str, int] = {}
    pat = re.compile(r"=\s*(\S+?)(?:\{[^}]*\})?\s+([a-z][\w-]*)\(")
    for line in text.splitlines():
        mm = pat.search(line)
        if mm and mm.group(1) in shapes:
            counts[mm.group(2)] = counts.get(mm.group(2), 0) + 1
    return counts


def is_oom(e: BaseException) -> bool:
    """True for allocator exhaustion (XLA's RESOURCE_EXHAUSTED / out of memory)."""
    s = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower() or "Out of memory" in s


def short_error(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:n]


def failure_status(e: BaseException) -> str:
    """A failed row's status: "oom" for allocator exhaustion, else "error"."""
    return "oom" if is_oom(e) else "error"

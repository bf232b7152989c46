"""Version shims for the Pallas Triton API across jax 0.10.x - 0.12.x.

Everything version-dependent that the kernels or their tests touch lives here:

* `triton_compiler_params(num_warps, num_stages)`: the Triton backend's compiler params
  (`jax.experimental.pallas.triton.CompilerParams`; older JAX called it
  `TritonCompilerParams` in `pallas.gpu` / `pallas.triton`).
* `plgpu`: the Triton-specific Pallas module (masked `load` / `store`).

The CUDA-export shims the tests use to lower kernels without a GPU live with the tests
(`tests/pallas_kernels/cuda_export.py`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

try:  # jax >= 0.4.3x: the Triton-specific module.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old JAX
    from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]

__all__ = [
    "JAX_VERSION",
    "pl",
    "plgpu",
    "triton_compiler_params",
    "triton_dot",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def triton_dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False, precision: Any = None) -> jax.Array:
    """2-D dot inside a Triton kernel (`tl.dot`; fp32 result). `pl.dot` left in jax 0.12."""
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """The Pallas Triton backend's compiler params (selects Triton over Mosaic GPU)."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)

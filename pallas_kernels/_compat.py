"""Version shims for the Pallas Triton API across jax 0.10.x - 0.12.x.

Everything version-dependent that the kernels or their tests touch lives here:

* `triton_compiler_params(num_warps, num_stages)`: the Triton backend's compiler params
  (`jax.experimental.pallas.triton.CompilerParams`; older JAX called it
  `TritonCompilerParams` in `pallas.gpu` / `pallas.triton`).
* `plgpu`: the Triton-specific Pallas module (masked `load` / `store`).
* `cuda_lowering_context()`: what `jax.export(..., platforms=["cuda"])` of a Pallas Triton
  kernel needs on a machine without a GPU. jax 0.10 falls back to compute capability 9.0
  by itself; jax >= 0.11 asks for an abstract GPU device (an `AbstractMesh` whose
  `abstract_device` is an NVIDIA H200), otherwise it raises "No supported GPU devices found".
* `export_for_cuda(fn, *args)`: exports `jax.jit(fn)` for CUDA with the Triton custom call
  allowed; returns the `jax.export.Exported`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import pallas as pl

try:  # jax >= 0.4.3x: the Triton-specific module.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old JAX
    from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]

__all__ = [
    "JAX_VERSION",
    "TRITON_CUSTOM_CALL",
    "cuda_lowering_context",
    "export_for_cuda",
    "pl",
    "plgpu",
    "triton_compiler_params",
    "triton_dot",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
# The device the CUDA export pretends to target when no GPU is attached (jax >= 0.11).
EXPORT_DEVICE_KIND = "NVIDIA H200"


def triton_dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False, precision: Any = None) -> jax.Array:
    """2-D dot inside a Triton kernel (`tl.dot`; fp32 result). `pl.dot` left in jax 0.12."""
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """The Pallas Triton backend's compiler params (selects Triton over Mosaic GPU)."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _needs_abstract_device() -> bool:
    """True when the Triton lowering needs an explicit GPU target (no GPU attached)."""
    try:
        from jax._src.pallas.triton import gpu_info  # jax >= 0.11
    except ImportError:
        return False  # jax 0.10: lowering falls back to sm_90 by itself.
    try:
        gpu_info.get_gpu_info()
        return False
    except ValueError:
        return True


@contextlib.contextmanager
def cuda_lowering_context() -> Iterator[None]:
    """Context in which Pallas Triton kernels lower for CUDA even without a GPU."""
    with warnings.catch_warnings():
        # jax >= 0.11 warns that the Pallas Triton backend is deprecated (it still works).
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        if not _needs_abstract_device():
            yield
            return
        sharding = jax.sharding
        device = sharding.AbstractDevice(
            device_kind=EXPORT_DEVICE_KIND, num_cores=None, platform="gpu"
        )
        mesh = sharding.AbstractMesh(
            (1,), ("x",), (sharding.AxisType.Explicit,), abstract_device=device
        )
        with sharding.use_abstract_mesh(mesh):
            yield


def export_for_cuda(fn: Callable[..., Any], *args: Any) -> jax.export.Exported:
    """`jax.export` of `jax.jit(fn)` for platforms=["cuda"] (runs the Pallas->Triton lowering).

    Works on a CPU-only machine. Raises whatever the lowering raises (a kernel the GPU backend
    cannot lower fails here, before it reaches a GPU).
    """
    from jax import export

    with cuda_lowering_context():
        return export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)

"""`jax.export` of Pallas Triton kernels for CUDA on a machine without a GPU (test tooling).

* `cuda_lowering_context()`: what `jax.export(..., platforms=["cuda"])` of a Pallas Triton
  kernel needs without a GPU. jax 0.10 falls back to compute capability 9.0 by itself;
  jax >= 0.11 asks for an abstract GPU device (an `AbstractMesh` whose `abstract_device` is an
  NVIDIA H200), otherwise it raises "No supported GPU devices found".
* `export_for_cuda(fn, *args)`: exports `jax.jit(fn)` for CUDA with the Triton custom call
  allowed; returns the `jax.export.Exported`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["TRITON_CUSTOM_CALL", "cuda_lowering_context", "export_for_cuda"]

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
# The device the CUDA export pretends to target when no GPU is attached (jax >= 0.11).
EXPORT_DEVICE_KIND = "NVIDIA H200"


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

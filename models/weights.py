"""Assembling the stacked params pytree from per-tensor checkpoint reads.

Both loaders (HF safetensors, GGUF) present tensors in HF/PyTorch orientation
(matrices ``[out, in]``); this module checks every shape, transposes matrices
to ``[in, out]``, stacks layers on a leading ``L`` axis and casts.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.errors import CheckpointError
from models.decoder import Params, param_shapes

# fetch(key, layer) -> (tensor name in the checkpoint, array in [out, in] orientation)
Fetch = Callable[[str, "int | None"], "tuple[str, np.ndarray]"]

_MATRICES = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}


def build_params(config: LlamaConfig, fetch: Fetch, dtype: Any, source: str) -> Params:
    """Read every tensor the config needs through ``fetch`` and build the params tree.

    Raises CheckpointError naming the tensor (and ``source``) on a shape mismatch;
    ``fetch`` raises it for a missing tensor.
    """
    shapes = param_shapes(config)
    np_dtype = jnp.dtype(dtype)

    def one(key: str, layer: int | None, want: tuple[int, ...]) -> np.ndarray:
        name, arr = fetch(key, layer)
        arr = np.asarray(arr)
        hf_shape = tuple(reversed(want)) if key in _MATRICES else want
        if tuple(arr.shape) != hf_shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {hf_shape} "
                "for this config")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != jnp.dtype(jnp.bfloat16):
            raise CheckpointError(f"{source}: tensor {name!r} has non-float dtype {arr.dtype}")
        arr = arr.T if key in _MATRICES else arr
        return np.ascontiguousarray(arr.astype(np_dtype))

    params: Params = {}
    for key, shape in shapes.items():
        if key == "layers":
            continue
        params[key] = jnp.asarray(one(key, None, shape))
    layers = {}
    for key, shape in shapes["layers"].items():
        per_layer = [one(key, i, shape[1:]) for i in range(config.n_layers)]
        layers[key] = jnp.asarray(np.stack(per_layer))
        del per_layer
    params["layers"] = layers
    return params

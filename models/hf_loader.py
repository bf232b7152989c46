"""Loading an HF-format directory (LLaMA, Gemma 3 text): config.json + *.safetensors (+ tokenizer.json).

Tensor names come from the family (``models/families.py``); Gemma's norms are stored as
``w`` and held as ``1 + w`` (``Family.hf_norm_offset``).

Safetensors files are read with a small header parser and ``np.memmap`` (no
pickle, no torch), so every problem can be reported precisely: a header that
does not parse, a tensor whose bytes run past the end of a truncated file, a
missing or mis-shaped tensor. bf16 tensors come out as ``ml_dtypes`` bfloat16.
Sharded checkpoints are found through ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.errors import CheckpointError, ConfigError
from models.decoder import Params
from models.families import FAMILIES
from models.weights import build_params

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}

def hf_tensor_name(key: str, layer: int | None, family: str = "llama") -> str:
    """The HF checkpoint name of our param ``key`` (``layer`` for per-layer ones)."""
    return FAMILIES[family].hf_name(key, layer)


class SafetensorsFile:
    """Lazy, validated view of one .safetensors file: ``names()``, ``get(name)``."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: truncated or not a safetensors file (header of {n} bytes, "
                    f"file of {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._size = size
        self._header: dict[str, Any] = header

    def names(self) -> list[str]:
        return list(self._header)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only memmapped array."""
        info = self._header[name]
        dtype_name = info.get("dtype")
        if dtype_name not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
        dtype = np.dtype(_DTYPES[dtype_name])
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes, but shape {shape} "
                f"of {dtype_name} needs {int(np.prod(shape)) * dtype.itemsize}")
        if self._base + end > self._size:
            raise CheckpointError(
                f"{self.path}: file is truncated: tensor {name!r} ends at byte "
                f"{self._base + end}, the file has {self._size}")
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._base + begin, shape=shape)


def _open_shards(path: str) -> dict[str, SafetensorsFile]:
    """Map tensor name -> the file holding it, for a single or sharded checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: invalid index ({e})") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        weight_map = None
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors are supported)")
    opened = {}
    for fn in files:
        fp = os.path.join(path, fn)
        if not os.path.exists(fp):
            raise CheckpointError(f"{index}: shard {fn!r} listed in the index does not exist")
        opened[fn] = SafetensorsFile(fp)
    where: dict[str, SafetensorsFile] = {}
    for fn, sf in opened.items():
        for name in sf.names():
            where[name] = sf
    if weight_map is not None:
        for name, fn in weight_map.items():
            if name not in where:
                raise CheckpointError(f"{os.path.join(path, fn)}: tensor {name!r} listed in "
                                      "the index is not in the shard")
    return where


def read_hf_config(path: str) -> LlamaConfig:
    """LlamaConfig from ``path/config.json``; CheckpointError naming the field on failure."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: no config.json (not an HF model directory)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
        return LlamaConfig.from_hf_dict(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def load_hf_dir(path: str, dtype: Any = None) -> tuple[LlamaConfig, Params, Any]:
    """(config, params, tokenizer or None) from an HF directory.

    dtype: params dtype (default: bf16 if the checkpoint stores bf16, else fp32).
    """
    config = read_hf_config(path)
    where = _open_shards(path)

    fam = config.traits

    def fetch(key: str, layer: int | None) -> tuple[str, np.ndarray]:
        name = fam.hf_name(key, layer)
        if name not in where:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        arr = where[name].get(name)
        if fam.hf_norm_offset and key.endswith("norm"):
            arr = np.asarray(arr, np.float32) + np.float32(fam.hf_norm_offset)
        return name, arr

    if dtype is None:
        emb = hf_tensor_name("embed", None)
        stored = where[emb].get(emb).dtype if emb in where else np.dtype(np.float32)
        dtype = jnp.bfloat16 if stored == jnp.dtype(jnp.bfloat16) else jnp.float32
    params = build_params(config, fetch, dtype, path)
    tokenizer = None
    tok_path = os.path.join(path, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer
        try:
            tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"{tok_path}: cannot be read by `tokenizers` ({e})") from e
    return config, params, tokenizer

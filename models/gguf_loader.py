"""Loading a LLaMA-architecture GGUF file (llama.cpp format) with the ``gguf`` package.

* hyper-parameters come from ``{arch}.*`` metadata (arch must be ``llama``);
* every tensor is dequantized to f32 with ``gguf.quants.dequantize`` (any
  llama.cpp quant type: Q4_0/Q4_1/Q8_0/K-quants/F16/...);
* llama.cpp's converter permutes the rows of the Q and K projections (it
  interleaves the two RoPE halves of each head); we undo it so the weights use
  HF's half-split RoPE layout (``_unpermute``);
* a ``rope_freqs.weight`` tensor (LLaMA-3.1 files) becomes
  ``RopeScaling(kind="freq_factors")``;
* the tokenizer is built from ``tokenizer.ggml.*`` (models/tokenizer.py).
"""
from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig, RopeScaling
from models.errors import CheckpointError, ConfigError
from models.llama import Params
from models.weights import build_params

_GLOBAL = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
           "lm_head": "output.weight"}
_LAYER = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "b_gate": "ffn_gate.bias", "b_up": "ffn_up.bias", "b_down": "ffn_down.bias",
}


def gguf_tensor_name(key: str, layer: int | None) -> str:
    """The GGUF name of our param ``key`` (``layer`` for per-layer ones)."""
    return _GLOBAL[key] if layer is None else f"blk.{layer}.{_LAYER[key]}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: w [rows, ...] with rows = n_heads * d."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def permute_for_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of ``_unpermute``); for writing test files."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _open(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises bare ValueError/IndexError on bad bytes
        size = os.path.getsize(path)
        raise CheckpointError(
            f"{path}: cannot parse GGUF file ({size} bytes); it is truncated or corrupt: "
            f"{type(e).__name__}: {e}") from e


def _metadata(reader) -> dict[str, Any]:
    """All metadata fields as python values."""
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception as e:
            raise CheckpointError(f"metadata field {name!r} cannot be decoded: {e}") from e
    return out


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> LlamaConfig:
    """LlamaConfig from GGUF metadata; CheckpointError naming the missing field."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{source}: unsupported architecture general.architecture={arch!r}; "
            "only 'llama' is supported")

    def need(field: str) -> Any:
        key = f"{arch}.{field}"
        if key not in meta:
            raise CheckpointError(f"{source}: metadata field {key!r} is missing")
        return meta[key]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or meta.get(f"{arch}.rope.dimension_count") or hidden // n_heads)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise CheckpointError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens "
                              "is present")
    scaling = None
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(_dequant(tensors["rope_freqs.weight"], source), np.float32).ravel()
        scaling = RopeScaling(kind="freq_factors", freq_factors=tuple(float(x) for x in factors))
    elif meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    elif meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{source}: unsupported {arch}.rope.scaling.type="
                              f"{meta[f'{arch}.rope.scaling.type']!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    try:
        return LlamaConfig(
            vocab=int(vocab),
            hidden=hidden,
            intermediate=int(need("feed_forward_length")),
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or n_heads),
            head_dim=head_dim,
            rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            mlp_bias="blk.0.ffn_gate.bias" in tensors,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=() if eos is None else (int(eos),),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _f32(x: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _dequant(t, source: str) -> np.ndarray:
    """Tensor ``t`` (a gguf ReaderTensor) as f32 in PyTorch orientation [rows, cols]."""
    import gguf

    want = int(t.n_bytes)
    if t.data.nbytes != want:
        raise CheckpointError(f"{source}: tensor {t.name!r} is truncated "
                              f"({t.data.nbytes} of {want} bytes)")
    try:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"{source}: tensor {t.name!r} uses quant type "
                              f"{t.tensor_type.name}, which gguf cannot dequantize") from e
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml order is innermost-first
    return np.asarray(arr, np.float32).reshape(shape)


def load_gguf(path: str, dtype: Any = jnp.float32,
              with_tokenizer: bool = True) -> tuple[LlamaConfig, Params, Any]:
    """(config, params, tokenizer or None) from a .gguf file; dequantized to ``dtype``."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors, path)

    def fetch(key: str, layer: int | None) -> tuple[str, np.ndarray]:
        name = gguf_tensor_name(key, layer)
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        w = _dequant(tensors[name], path)
        heads = {"wq": config.n_heads, "bq": config.n_heads,
                 "wk": config.n_kv_heads, "bk": config.n_kv_heads}.get(key)
        # (a wrong row count is left for build_params to report with the tensor name)
        if heads is not None and w.shape[0] == heads * config.head_dim:
            w = _unpermute(w, heads)
        return name, w

    params = build_params(config, fetch, dtype, path)
    tokenizer = None
    if with_tokenizer:
        from models.tokenizer import tokenizer_from_gguf_fields
        tokenizer = tokenizer_from_gguf_fields(meta, path)
    return config, params, tokenizer

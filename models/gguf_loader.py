"""Loading a GGUF file (llama.cpp format; LLaMA or Gemma 3) with the ``gguf`` package.

* hyper-parameters come from ``{arch}.*`` metadata (arch ``llama`` or ``gemma3``; what a
  Gemma 3 file does not carry, the sliding pattern and the local RoPE base, comes from
  ``models.families.GEMMA3_DEFAULTS``);
* every tensor is dequantized to f32 with ``gguf.quants.dequantize`` (any
  llama.cpp quant type: Q4_0/Q4_1/Q8_0/K-quants/F16/...);
* llama.cpp's converter permutes the rows of LLaMA's Q and K projections (it
  interleaves the two RoPE halves of each head); we undo it so the weights use
  HF's half-split RoPE layout (``_unpermute``); Gemma 3 files are not permuted, and store
  their norms with the +1 already added, as we hold them;
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
from models.config import gemma3_layer_types
from models.decoder import Params
from models.families import FAMILIES, GEMMA3_DEFAULTS
from models.gguf_metadata import GGUFTensorInfo, read_gguf_header, tensor_bytes
from models.paths import model_cache_dir
from models.tokenizer import cached_tokenizer
from models.weights import build_params

def gguf_tensor_name(key: str, layer: int | None, family: str = "llama") -> str:
    """The GGUF name of our param ``key`` (``layer`` for per-layer ones)."""
    return FAMILIES[family].gguf_name(key, layer)


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


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> LlamaConfig:
    """LlamaConfig from GGUF metadata; CheckpointError naming the missing field."""
    arch = meta.get("general.architecture")
    fam = next((f for f in FAMILIES.values() if f.gguf_arch == arch), None)
    if fam is None:
        raise CheckpointError(
            f"{source}: unsupported architecture general.architecture={arch!r}; "
            f"supported: {sorted(f.gguf_arch for f in FAMILIES.values())}")

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
    extra: dict[str, Any] = {}
    if fam.name == "gemma3":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if meta.get(f"{arch}.{key}"):
                raise CheckpointError(f"{source}: {arch}.{key} is set; soft-capping is not supported")
        n_layers = int(need("block_count"))
        extra = dict(family="gemma3", layer_types=gemma3_layer_types(n_layers),
                     sliding_window=int(meta.get(f"{arch}.attention.sliding_window")
                                        or GEMMA3_DEFAULTS["sliding_window"]),
                     rope_local_theta=GEMMA3_DEFAULTS["rope_local_theta"],
                     query_pre_attn_scalar=float(head_dim))
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
            **extra,
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _f32(x: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _dequant(t: GGUFTensorInfo, source: str) -> np.ndarray:
    """Tensor ``t`` as f32 in PyTorch orientation [rows, cols] (CheckpointError when its bytes
    run past the end of the file or its quant type cannot be read)."""
    import gguf

    size = os.path.getsize(source)
    if t.offset + t.n_bytes > size:
        raise CheckpointError(f"{source}: the file is truncated or corrupt: tensor {t.name!r} has "
                              f"{max(0, size - t.offset)} of its {t.n_bytes} bytes")
    try:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        arr = gguf.quants.dequantize(np.asarray(tensor_bytes(source, t)), qtype)
    except (NotImplementedError, ValueError) as e:
        raise CheckpointError(f"{source}: tensor {t.name!r} uses quant type "
                              f"{t.type_name}, which gguf cannot dequantize") from e
    return np.asarray(arr, np.float32).reshape(t.shape)


def load_gguf(path: str, dtype: Any = jnp.float32,
              with_tokenizer: bool = True) -> tuple[LlamaConfig, Params, Any]:
    """(config, params, tokenizer or None) from a .gguf file; dequantized to ``dtype``.

    The header is read with :mod:`models.gguf_metadata` (a 262K-token vocabulary in ~1 s);
    the tokenizer built from it is kept as JSON in ``models.paths.model_cache_dir()`` and
    rebuilt whenever the vocabulary differs."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    header = read_gguf_header(path)
    meta, tensors = header.metadata, header.tensors
    config = config_from_gguf(meta, tensors, path)

    fam = config.traits

    def fetch(key: str, layer: int | None) -> tuple[str, np.ndarray]:
        name = fam.gguf_name(key, layer)
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        w = _dequant(tensors[name], path)
        if not fam.permuted_qk_gguf:
            return name, w
        heads = {"wq": config.n_heads, "bq": config.n_heads,
                 "wk": config.n_kv_heads, "bk": config.n_kv_heads}.get(key)
        # (a wrong row count is left for build_params to report with the tensor name)
        if heads is not None and w.shape[0] == heads * config.head_dim:
            w = _unpermute(w, heads)
        return name, w

    params = build_params(config, fetch, dtype, path)
    tokenizer = None
    if with_tokenizer:
        cache = os.path.join(model_cache_dir(), "tokenizers", os.path.basename(path) + ".json")
        tokenizer = cached_tokenizer(meta, path, cache)
    return config, params, tokenizer

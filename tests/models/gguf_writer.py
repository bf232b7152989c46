"""Test helper: write an HF LlamaForCausalLM / Gemma3ForCausalLM as a llama.cpp-style GGUF
(LLaMA: Q/K rows permuted; Gemma 3: norms stored as 1 + w)."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from models.config import LlamaConfig
from models.gguf_loader import permute_for_gguf
from models.decoder import param_shapes, rope_inv_freq

def write_gguf(path, config: LlamaConfig, hf_model, *, quant: str | None = None,
               arch: str | None = None, drop: Iterable[str] = (), skip_fields: Iterable[str] = (),
               reshape: dict[str, tuple[int, ...]] | None = None, unreadable: Iterable[str] = ()) -> None:
    """Write ``hf_model`` (fp32) to ``path``.

    quant: None (F32) or "Q8_0" for the 2-D matrices. drop: GGUF tensor names
    to leave out. skip_fields: metadata keys (without the arch prefix) to omit.
    reshape: tensor name -> shape to write instead (to make a bad file). unreadable: tensor
    names written as Q8_1 bytes, a type the ``gguf`` package cannot dequantize. arch: the
    file's ``general.architecture`` (default: the family's).
    """
    import gguf

    skip = set(skip_fields)
    fam = config.traits
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def stored(key: str, layer: int | None) -> np.ndarray:
        w = sd[fam.hf_name(key, layer)]
        if key.endswith("norm"):
            w = w + np.float32(fam.hf_norm_offset)
        if fam.permuted_qk_gguf and key in ("wq", "wk"):
            w = permute_for_gguf(w, config.n_heads if key == "wq" else config.n_kv_heads)
        return w

    shapes = param_shapes(config)
    tensors: dict[str, np.ndarray] = {fam.gguf_name(k, None): stored(k, None)
                                      for k in shapes if k != "layers"}
    for i in range(config.n_layers):
        for key in shapes["layers"]:
            tensors[fam.gguf_name(key, i)] = stored(key, i)
    if config.rope_scaling is not None:      # llama.cpp stores llama3 scaling as divisors
        base = rope_inv_freq(config.replace(rope_scaling=None)).astype(np.float64)
        tensors["rope_freqs.weight"] = (base / rope_inv_freq(config)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch or fam.gguf_arch)
    fields = {
        "block_count": lambda: w.add_block_count(config.n_layers),
        "context_length": lambda: w.add_context_length(config.max_position_embeddings),
        "embedding_length": lambda: w.add_embedding_length(config.hidden),
        "feed_forward_length": lambda: w.add_feed_forward_length(config.intermediate),
        "attention.head_count": lambda: w.add_head_count(config.n_heads),
        "attention.head_count_kv": lambda: w.add_head_count_kv(config.n_kv_heads),
        "rope.freq_base": lambda: w.add_rope_freq_base(config.rope_theta),
        "attention.layer_norm_rms_epsilon": lambda: w.add_layer_norm_rms_eps(config.rms_norm_eps),
        "rope.dimension_count": lambda: w.add_rope_dimension_count(config.head_dim),
        "vocab_size": lambda: w.add_vocab_size(config.vocab),
        "attention.key_length": lambda: w.add_key_length(config.head_dim),
    }
    if config.family == "gemma3":
        fields["attention.sliding_window"] = lambda: w.add_sliding_window(config.sliding_window)
    for name, add in fields.items():
        if name not in skip:
            add()
    for name, arr in tensors.items():
        if name in set(drop):
            continue
        arr = np.ascontiguousarray(arr, np.float32)
        if reshape and name in reshape:
            arr = np.resize(arr, reshape[name]).astype(np.float32)
        if name in set(unreadable):
            qt = gguf.GGMLQuantizationType.Q8_1
            blocks, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.zeros((arr.shape[0], arr.shape[-1] // blocks * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        elif quant == "Q8_0" and arr.ndim == 2 and arr.shape[1] % 32 == 0:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""Test helper: write an HF LlamaForCausalLM as a llama.cpp-style GGUF (Q/K rows permuted)."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from models.config import LlamaConfig
from models.gguf_loader import permute_for_gguf
from models.llama import rope_inv_freq

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(path, config: LlamaConfig, hf_model, *, quant: str | None = None,
               arch: str = "llama", drop: Iterable[str] = (), skip_fields: Iterable[str] = (),
               reshape: dict[str, tuple[int, ...]] | None = None) -> None:
    """Write ``hf_model`` (fp32) to ``path``.

    quant: None (F32) or "Q8_0" for the 2-D matrices. drop: GGUF tensor names
    to leave out. skip_fields: metadata keys (without the arch prefix) to omit.
    reshape: tensor name -> shape to write instead (to make a bad file).
    """
    import gguf

    skip = set(skip_fields)
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {"token_embd.weight": sd["model.embed_tokens.weight"],
                                      "output_norm.weight": sd["model.norm.weight"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(config.n_layers):
        for hf, gg in _NAMES.items():
            w = sd[f"model.layers.{i}.{hf}"]
            if gg == "attn_q.weight":
                w = permute_for_gguf(w, config.n_heads)
            elif gg == "attn_k.weight":
                w = permute_for_gguf(w, config.n_kv_heads)
            tensors[f"blk.{i}.{gg}"] = w
    if config.rope_scaling is not None:      # llama.cpp stores llama3 scaling as divisors
        base = rope_inv_freq(config.replace(rope_scaling=None)).astype(np.float64)
        tensors["rope_freqs.weight"] = (base / rope_inv_freq(config)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
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
    }
    for name, add in fields.items():
        if name not in skip:
            add()
    for name, arr in tensors.items():
        if name in set(drop):
            continue
        arr = np.ascontiguousarray(arr, np.float32)
        if reshape and name in reshape:
            arr = np.resize(arr, reshape[name]).astype(np.float32)
        if quant == "Q8_0" and arr.ndim == 2 and arr.shape[1] % 32 == 0:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""Helpers for the model tests: random HF LLaMA models and logits comparison."""
from __future__ import annotations

import numpy as np

from models.config import LlamaConfig, RopeScaling, preset

# Small configs covering the variants the loader and model must get right.
HF_CONFIGS = {
    "mha_untied": LlamaConfig(vocab=97, hidden=32, intermediate=48, n_layers=2, n_heads=4,
                              n_kv_heads=4, rope_theta=10000.0, rms_norm_eps=1e-6),
    "gqa_tied": LlamaConfig(vocab=97, hidden=48, intermediate=64, n_layers=3, n_heads=6,
                            n_kv_heads=2, head_dim=12, rope_theta=500.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True),
    "gqa_llama3_rope": LlamaConfig(
        vocab=97, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=1,
        head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16)),
    "bias_mqa": LlamaConfig(vocab=97, hidden=32, intermediate=40, n_layers=2, n_heads=4,
                            n_kv_heads=1, rope_theta=10000.0, attention_bias=True,
                            mlp_bias=True),
}


# Gemma 3 variants: sliding + global layers (window 8), query_pre_attn_scalar != head_dim,
# and a GQA 2:1 one with linear RoPE scaling on the global layers.
HF_GEMMA3_CONFIGS = {
    "gemma3_tiny": preset("tiny-gemma3"),
    "gemma3_gqa_linear": preset("tiny-gemma3").replace(
        n_layers=4, n_kv_heads=2, head_dim=16, query_pre_attn_scalar=0.0, sliding_window=5,
        layer_types=("sliding", "global", "sliding", "global"),
        rope_scaling=RopeScaling("linear", factor=4.0)),
}


def make_hf_model(config: LlamaConfig, seed: int = 0, std: float = 0.15):
    """A random-weight transformers LlamaForCausalLM (fp32, eval mode) for ``config``.

    Weights use a larger std than HF's 0.02 so attention patterns are peaked
    and RoPE / masking mistakes change the logits visibly; biases and norm
    scales are randomised too (HF initialises them to 0 / 1).
    """
    import torch
    import transformers

    if config.family == "gemma3":
        hf_cfg = transformers.Gemma3TextConfig(**config.to_hf_dict(), initializer_range=std)
        hf_cfg._attn_implementation = "eager"
        cls = transformers.Gemma3ForCausalLM
    else:
        hf_cfg = transformers.LlamaConfig(**config.to_hf_dict(), initializer_range=std)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_cfg).float().eval()
    offset = 0.0 if config.family == "gemma3" else 1.0  # Gemma's norm weight w scales by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(offset + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def rel_err(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

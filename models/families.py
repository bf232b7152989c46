"""What differs between decoder families: a few traits and the checkpoint tensor names.

The decoder skeleton (``models/decoder.py``) owns the layer scan, the cache protocol and the
entry points; a family only says how its block differs from LLaMA's and what its tensors are
called in GGUF and HF checkpoints. A third family (Qwen3: QK-norm; Mistral: LLaMA with a
sliding window) is one more :class:`Family` here, not one more model file.

    llama   RMSNorm -> attention -> residual; RMSNorm -> SwiGLU -> residual.
    gemma3  RMSNorm -> attention (per-head RMSNorm on q and k before RoPE) -> RMSNorm ->
            residual; RMSNorm -> tanh-GELU gated MLP -> RMSNorm -> residual; embeddings
            times sqrt(hidden); sliding-window layers with their own RoPE base.

Norm weights are held as the multiplier itself (Gemma's ``1 + w``, as GGUF stores it), so one
RMSNorm serves every family; the HF loader adds ``hf_norm_offset`` to Gemma's stored ``w``.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

__all__ = ["Family", "FAMILIES", "family", "GEMMA3_DEFAULTS"]

# Per-layer tensors every family has (our key -> GGUF suffix / HF suffix under "model.layers.{i}.").
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "b_gate": "ffn_gate.bias", "b_up": "ffn_up.bias", "b_down": "ffn_down.bias",
}
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "b_gate": "mlp.gate_proj.bias", "b_up": "mlp.up_proj.bias", "b_down": "mlp.down_proj.bias",
}
_GLOBAL_GGUF = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                "lm_head": "output.weight"}
_GLOBAL_HF = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}


@dataclasses.dataclass(frozen=True)
class Family:
    """The traits of one decoder family (module docstring).

    qk_norm:          per-head RMSNorm on q and k (weights ``q_norm`` / ``k_norm`` [L, d])
    sandwich_norms:   RMSNorm after attention and after the MLP, before each residual add
                      (``post_attn_norm`` / ``post_mlp_norm`` [L, D])
    activation:       "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale:      embeddings multiplied by sqrt(hidden)
    hf_norm_offset:   added to every norm weight an HF checkpoint stores (Gemma stores w of 1 + w)
    permuted_qk_gguf: llama.cpp permuted the Q/K rows of this family's GGUF (LLaMA: yes)
    gguf_arch:        ``general.architecture`` of its GGUF files
    hf_model_types:   HF ``model_type`` values of its config.json
    """

    name: str
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    hf_norm_offset: float = 0.0
    permuted_qk_gguf: bool = True
    gguf_arch: str = "llama"
    hf_model_types: tuple[str, ...] = ("llama",)
    gguf_layer: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(_GGUF_LAYER))
    hf_layer: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(_HF_LAYER))

    @property
    def extra_layer_params(self) -> tuple[str, ...]:
        """Per-layer norm weights beyond LLaMA's: ("q_norm", "k_norm", ...)."""
        extra = ("q_norm", "k_norm") if self.qk_norm else ()
        return extra + (("post_attn_norm", "post_mlp_norm") if self.sandwich_norms else ())

    def gguf_name(self, key: str, layer: int | None) -> str:
        """The GGUF tensor name of our param ``key`` (``layer`` for per-layer ones)."""
        return _GLOBAL_GGUF[key] if layer is None else f"blk.{layer}.{self.gguf_layer[key]}"

    def hf_name(self, key: str, layer: int | None) -> str:
        """The HF safetensors name of our param ``key`` (``layer`` for per-layer ones)."""
        return _GLOBAL_HF[key] if layer is None else f"model.layers.{layer}.{self.hf_layer[key]}"


LLAMA = Family("llama")
GEMMA3 = Family(
    "gemma3", qk_norm=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
    hf_norm_offset=1.0, permuted_qk_gguf=False, gguf_arch="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_layer={**_GGUF_LAYER, "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
                "post_attn_norm": "post_attention_norm.weight",
                "post_mlp_norm": "post_ffw_norm.weight"},
    hf_layer={**_HF_LAYER, "mlp_norm": "pre_feedforward_layernorm.weight",
              "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
              "post_attn_norm": "post_attention_layernorm.weight",
              "post_mlp_norm": "post_feedforward_layernorm.weight"},
)

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, GEMMA3)}

# What a Gemma 3 GGUF does not carry, in one place: every 6th layer is global (5 sliding, then
# 1 global), and sliding layers rotate with RoPE base 1e4 (the file's freq_base is the global one).
GEMMA3_DEFAULTS = {"sliding_pattern": 6, "rope_local_theta": 10000.0, "sliding_window": 512}


def family(name: str) -> Family:
    """The :class:`Family` called ``name`` ("llama" | "gemma3")."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None

"""LLaMA-family hyper-parameters: a frozen, hashable dataclass.

The config is a static argument of every jitted model function, so it must be
hashable: all fields are scalars, strings, tuples or a frozen ``RopeScaling``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from million_jax.rope import ROPE_SCALING_KINDS, RopeScaling
from models.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a LLaMA-architecture decoder.

    ``head_dim`` defaults to ``hidden // n_heads`` when 0. ``eos_ids`` is a tuple
    because LLaMA-3 instruct models stop on several tokens.
    """

    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_id: int | None = 1
    eos_ids: tuple[int, ...] = (2,)
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden % self.n_heads:
                raise ConfigError(
                    f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if isinstance(self.eos_ids, int):
            object.__setattr__(self, "eos_ids", (self.eos_ids,))
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        for name in ("vocab", "hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and self.rope_scaling.kind not in ROPE_SCALING_KINDS:
            raise ConfigError(f"unsupported rope_scaling kind {self.rope_scaling.kind!r}")
        if (self.rope_scaling is not None and self.rope_scaling.kind == "freq_factors"
                and len(self.rope_scaling.freq_factors) != self.head_dim // 2):
            raise ConfigError(f"rope freq_factors has {len(self.rope_scaling.freq_factors)} "
                              f"entries, expected head_dim/2 = {self.head_dim // 2}")

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises ConfigError naming the field for unsupported architectures,
        activations or RoPE variants.
        """
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type != "llama" and "LlamaForCausalLM" not in archs:
            raise ConfigError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs!r}; "
                "only LLaMA-family models (model_type 'llama') are supported")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"unsupported hidden_act {act!r}; LLaMA uses 'silu'")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"config.json is missing the field {key!r}")
        n_heads = int(d["num_attention_heads"])
        # transformers >= 5 nests RoPE settings under "rope_parameters".
        rope = dict(d.get("rope_parameters") or {})
        if d.get("rope_scaling"):
            rope = {**dict(d["rope_scaling"]), **rope}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in (None, "default"):
            scaling = None
        elif rope_type == "llama3":
            scaling = RopeScaling(
                kind="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            scaling = RopeScaling(kind="linear", factor=float(rope["factor"]))
        else:
            raise ConfigError(
                f"unsupported rope_type {rope_type!r} in rope_scaling/rope_parameters")
        eos = d.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab=int(d["vocab_size"]),
            hidden=int(d["hidden_size"]),
            intermediate=int(d["intermediate_size"]),
            n_layers=int(d["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or 0),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_id=d.get("bos_token_id"),
            eos_ids=eos_ids,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent HF ``LlamaConfig`` keyword arguments."""
        out: dict[str, Any] = dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            bos_token_id=self.bos_id,
            eos_token_id=list(self.eos_ids) if len(self.eos_ids) != 1 else self.eos_ids[0],
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.rope_scaling is not None:
            s = self.rope_scaling
            if s.kind == "freq_factors":
                raise ConfigError("rope_scaling kind 'freq_factors' has no HF config equivalent")
            scaling: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                scaling.update(low_freq_factor=s.low_freq_factor,
                               high_freq_factor=s.high_freq_factor,
                               original_max_position_embeddings=s.original_max_position_embeddings)
            out["rope_scaling"] = scaling
        return out


PRESETS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(
        vocab=32000, hidden=4096, intermediate=11008, n_layers=32, n_heads=32, n_kv_heads=32,
        head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5, bos_id=1, eos_ids=(2,),
        max_position_embeddings=4096),
    "llama3.1-8b": LlamaConfig(
        vocab=128256, hidden=4096, intermediate=14336, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        rms_norm_eps=1e-5, bos_id=128000, eos_ids=(128001, 128008, 128009),
        max_position_embeddings=131072),
    "smollm2-135m": LlamaConfig(
        vocab=49152, hidden=576, intermediate=1536, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_id=1, eos_ids=(2,), max_position_embeddings=8192),
    # A few-KB model for unit tests of caches and kernels.
    "tiny": LlamaConfig(
        vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, bos_id=1, eos_ids=(2,),
        max_position_embeddings=512),
}


def preset(name: str) -> LlamaConfig:
    """A named config: one of ``PRESETS`` (llama2-7b, llama3.1-8b, smollm2-135m, tiny)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None

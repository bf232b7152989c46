"""Decoder hyper-parameters (LLaMA, Gemma 3): a frozen, hashable dataclass.

The config is a static argument of every jitted model function, so it must be
hashable: all fields are scalars, strings, tuples or a frozen ``RopeScaling``.
``family`` names the block's traits (``models/families.py``); ``layer_types`` says which
layers attend globally and which through a sliding window (hybrid models such as Gemma 3).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from million_jax.rope import ROPE_SCALING_KINDS, RopeScaling
from models.errors import ConfigError
from models.families import FAMILIES, GEMMA3_DEFAULTS, Family

LAYER_TYPES = ("global", "sliding")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and constants of a decoder (``LlamaConfig`` is the same class).

    ``head_dim`` defaults to ``hidden // n_heads`` when 0. ``eos_ids`` is a tuple
    because LLaMA-3 instruct models stop on several tokens.
    family:                "llama" | "gemma3" (the block's traits, ``models/families.py``)
    layer_types:           per layer "global" or "sliding"; () means every layer is global
    sliding_window:        tokens a sliding layer sees, its own included (query p reads
                           p - W < s <= p)
    rope_theta:            RoPE base of the global layers; ``rope_local_theta`` of the sliding
                           ones (RoPE scaling applies to global layers only, as in Gemma 3)
    query_pre_attn_scalar: attention scale is its -1/2 power (0: head_dim, the usual scale)
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
    family: str = "llama"
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden % self.n_heads:
                raise ConfigError(
                    f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if not self.query_pre_attn_scalar:  # 0: the usual head_dim ** -0.5 scale
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))
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
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; known: {sorted(FAMILIES)}")
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"n_layers={self.n_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ConfigError(f"layer_types holds {bad}; each must be one of {LAYER_TYPES}")
            if "global" not in self.layer_types:
                raise ConfigError("layer_types has no global layer; at least one is needed")
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ConfigError(f"sliding layers need sliding_window >= 1, got {self.sliding_window}")
        if self.sliding_window < 0 or self.query_pre_attn_scalar < 0:
            raise ConfigError("sliding_window and query_pre_attn_scalar must be >= 0")
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

    @property
    def traits(self) -> Family:
        """The family's block traits and tensor names (``models/families.py``)."""
        return FAMILIES[self.family]

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        """Per layer: True where it attends through the sliding window."""
        return tuple(t == "sliding" for t in self.layer_types) or (False,) * self.n_layers

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to the whole context (every layer for LLaMA)."""
        return tuple(i for i, s in enumerate(self.is_sliding) if not s)

    @property
    def n_global_layers(self) -> int:
        """Layers that keep the whole context, the ones whose K/V a PQ cache stores as codes."""
        return len(self.global_layers)

    @property
    def attn_scale(self) -> float:
        """Softmax scale of q . k: query_pre_attn_scalar ** -0.5 (head_dim ** -0.5 by default)."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **changes: Any) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "DecoderConfig":
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x layout).

        model_type "llama" or "gemma3_text". Raises ConfigError naming the field for
        unsupported architectures, activations or RoPE variants.
        """
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type in FAMILIES["gemma3"].hf_model_types:
            return _gemma3_from_hf_dict(cls, d)
        if model_type != "llama" and "LlamaForCausalLM" not in archs:
            raise ConfigError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs!r}; "
                "supported: 'llama' and 'gemma3_text'")
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
        """The equivalent HF ``LlamaConfig`` / ``Gemma3TextConfig`` keyword arguments."""
        if self.family == "gemma3":
            return _gemma3_to_hf_dict(self)
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


def gemma3_layer_types(n_layers: int, pattern: int = GEMMA3_DEFAULTS["sliding_pattern"]) -> tuple[str, ...]:
    """Gemma 3's layer pattern: (pattern - 1) sliding layers, then one global, repeated."""
    return tuple("global" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))


def _rope_from_hf(rope: Mapping[str, Any], theta: float) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one HF rope_parameters / rope_scaling dict."""
    theta = float(rope.get("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(rope["factor"]))
    raise ConfigError(f"unsupported rope_type {kind!r} for Gemma 3 (default and linear are)")


def _gemma3_from_hf_dict(cls: type, d: Mapping[str, Any]) -> "DecoderConfig":
    """A gemma3_text config.json (transformers 4.5x or 5.x) as a DecoderConfig."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in d:
            raise ConfigError(f"config.json is missing the field {key!r}")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported hidden_activation {act!r}; Gemma 3 uses 'gelu_pytorch_tanh'")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(cap) is not None:
            raise ConfigError(f"{cap}={d[cap]!r} is not supported (Gemma 3 has none)")
    n_layers = int(d["num_hidden_layers"])
    hf_types = d.get("layer_types")
    if hf_types:
        names = {"full_attention": "global", "sliding_attention": "sliding"}
        if any(t not in names for t in hf_types):
            raise ConfigError(f"layer_types holds {sorted(set(hf_types) - set(names))}")
        layer_types = tuple(names[t] for t in hf_types)
    else:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                      or GEMMA3_DEFAULTS["sliding_pattern"])
        layer_types = gemma3_layer_types(n_layers, pattern)
    rope = dict(d.get("rope_parameters") or {})
    if "full_attention" in rope:  # transformers 5: one dict per layer type
        theta, scaling = _rope_from_hf(rope["full_attention"], 1e6)
        local, _ = _rope_from_hf(rope.get("sliding_attention", {}), GEMMA3_DEFAULTS["rope_local_theta"])
    else:
        theta, scaling = _rope_from_hf({**dict(d.get("rope_scaling") or {}), **rope},
                                       float(d.get("rope_theta", 1e6)))
        local = float(d.get("rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_theta"]))
    eos = d.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return cls(
        vocab=int(d["vocab_size"]), hidden=int(d["hidden_size"]),
        intermediate=int(d["intermediate_size"]), n_layers=n_layers,
        n_heads=int(d["num_attention_heads"]),
        n_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        head_dim=int(d.get("head_dim") or 256), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        bos_id=d.get("bos_token_id", 2), eos_ids=eos_ids,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        family="gemma3", layer_types=layer_types,
        sliding_window=int(d.get("sliding_window") or GEMMA3_DEFAULTS["sliding_window"]),
        rope_local_theta=local,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 0.0),
    )


def _gemma3_to_hf_dict(c: "DecoderConfig") -> dict[str, Any]:
    """HF ``Gemma3TextConfig`` keyword arguments of a gemma3 DecoderConfig."""
    if c.rope_scaling is not None and c.rope_scaling.kind != "linear":
        raise ConfigError(f"rope_scaling kind {c.rope_scaling.kind!r} has no Gemma 3 HF equivalent")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        full = {"rope_type": "linear", "factor": c.rope_scaling.factor, "rope_theta": c.rope_theta}
    names = {"global": "full_attention", "sliding": "sliding_attention"}
    return dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        bos_token_id=c.bos_id, eos_token_id=list(c.eos_ids) if len(c.eos_ids) != 1 else c.eos_ids[0],
        pad_token_id=0, max_position_embeddings=c.max_position_embeddings,
        sliding_window=c.sliding_window, query_pre_attn_scalar=int(c.query_pre_attn_scalar or c.head_dim),
        layer_types=[names[t] for t in (c.layer_types or ("global",) * c.n_layers)],
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        final_logit_softcapping=None, attn_logit_softcapping=None,
    )


LlamaConfig = DecoderConfig  # the name the LLaMA-only code base used; one class


PRESETS: dict[str, DecoderConfig] = {
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
    "gemma3-270m": DecoderConfig(
        vocab=262144, hidden=640, intermediate=2048, n_layers=18, n_heads=4, n_kv_heads=1,
        head_dim=256, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_id=2, eos_ids=(1,), max_position_embeddings=32768, family="gemma3",
        layer_types=gemma3_layer_types(18), sliding_window=512, rope_local_theta=10000.0,
        query_pre_attn_scalar=256.0),
    # A few-KB model for unit tests of caches and kernels.
    "tiny": LlamaConfig(
        vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, bos_id=1, eos_ids=(2,),
        max_position_embeddings=512),
    # A few-KB Gemma 3 (2 sliding layers with window 8, then a global one) for unit tests.
    "tiny-gemma3": DecoderConfig(
        vocab=256, hidden=64, intermediate=128, n_layers=3, n_heads=4, n_kv_heads=1,
        head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_id=2, eos_ids=(1,), max_position_embeddings=512, family="gemma3",
        layer_types=gemma3_layer_types(3, 3), sliding_window=8, rope_local_theta=10000.0,
        query_pre_attn_scalar=24.0),
}


def preset(name: str) -> LlamaConfig:
    """A named config: one of ``PRESETS`` (llama2-7b, llama3.1-8b, smollm2-135m, gemma3-270m,
    tiny, tiny-gemma3)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None

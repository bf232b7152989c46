"""LlamaConfig: presets, HF config round trips, RoPE frequencies against transformers."""
from __future__ import annotations

import numpy as np
import pytest

from models.config import PRESETS, LlamaConfig, RopeScaling, preset
from models.errors import ConfigError
from models.decoder import param_shapes, rope_inv_freq


def test_presets_have_the_published_shapes():
    l2, l3, smol = preset("llama2-7b"), preset("llama3.1-8b"), preset("smollm2-135m")
    assert (l2.hidden, l2.n_layers, l2.n_heads, l2.n_kv_heads, l2.head_dim) == \
        (4096, 32, 32, 32, 128)
    assert (l3.n_kv_heads, l3.vocab, l3.rope_theta, l3.rope_scaling.factor) == \
        (8, 128256, 5e5, 8.0)
    assert (smol.n_heads, smol.n_kv_heads, smol.head_dim, smol.tie_word_embeddings) == \
        (9, 3, 64, True)
    assert "lm_head" not in param_shapes(smol) and "lm_head" in param_shapes(l2)
    n_params = sum(int(np.prod(s)) for s in _leaves(param_shapes(l2)))
    assert abs(n_params - 6.74e9) < 0.01e9                       # LLaMA-2-7B has 6.74B params
    assert set(PRESETS) >= {"llama2-7b", "llama3.1-8b", "smollm2-135m", "tiny"}
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("gpt5")


def _leaves(tree):
    for v in tree.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def test_config_is_hashable_and_validated():
    c = preset("tiny")
    assert hash(c) == hash(c.replace()) and c.q_per_kv == 2
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        LlamaConfig(vocab=8, hidden=16, intermediate=8, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="rope_scaling"):
        c.replace(rope_scaling=RopeScaling(kind="yarn"))


def test_from_hf_dict_both_transformers_layouts():
    v4 = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
          "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
          "max_position_embeddings": 131072, "hidden_act": "silu"}
    assert LlamaConfig.from_hf_dict(v4) == preset("llama3.1-8b")
    v5 = dict(v4)
    v5.pop("rope_scaling")
    v5.pop("rope_theta")
    v5["rope_parameters"] = {**v4["rope_scaling"], "rope_theta": 500000.0}
    assert LlamaConfig.from_hf_dict(v5) == preset("llama3.1-8b")
    for name, cfg in PRESETS.items():
        assert LlamaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg, name


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_from_hf_dict_rejects_unsupported(bad, match):
    d = {**preset("tiny").to_hf_dict(), **bad}
    if "model_type" in bad:
        d["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.from_hf_dict(d)


def test_from_hf_dict_names_missing_field():
    d = preset("tiny").to_hf_dict()
    del d["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        LlamaConfig.from_hf_dict(d)


@pytest.mark.parametrize("scaling", [
    None,
    RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    RopeScaling("llama3", 4.0, 2.0, 8.0, 64),
    RopeScaling("linear", factor=2.5),
])
def test_rope_inv_freq_matches_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = preset("llama3.1-8b").replace(rope_scaling=scaling)
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict())
    if scaling is None:
        d = cfg.head_dim
        ref = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    else:
        ref = ROPE_INIT_FUNCTIONS[scaling.kind](hf_cfg, "cpu")[0].numpy()
    ours = rope_inv_freq(cfg)
    np.testing.assert_allclose(ours, ref, rtol=2e-6)
    if scaling is not None:           # the scaling really changes something
        assert not np.allclose(ours, rope_inv_freq(cfg.replace(rope_scaling=None)))


def test_freq_factors_reproduce_llama3_scaling():
    cfg = preset("llama3.1-8b")
    base = rope_inv_freq(cfg.replace(rope_scaling=None)).astype(np.float64)
    factors = tuple(base / rope_inv_freq(cfg).astype(np.float64))
    as_factors = cfg.replace(rope_scaling=RopeScaling("freq_factors", freq_factors=factors))
    np.testing.assert_allclose(rope_inv_freq(as_factors), rope_inv_freq(cfg), rtol=1e-6)
    with pytest.raises(ConfigError, match="freq_factors"):
        cfg.replace(rope_scaling=RopeScaling("freq_factors", freq_factors=(1.0, 2.0)))

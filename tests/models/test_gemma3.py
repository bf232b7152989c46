"""Gemma 3 from configs (no real weights): against transformers' Gemma3ForCausalLM, through HF
safetensors and GGUF files, decode through the hybrid cache against the full forward, and the
loader's errors on bad gemma3 GGUFs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_writer import write_gguf
from hf_helpers import HF_GEMMA3_CONFIGS, hf_logits, make_hf_model, rel_err

from million_jax import CacheSpec, make_cache
from models import (CheckpointError, ContextLengthError, check_context, decode_step, forward, generate,
                    init_params, load_model, prefill, preset)
from models.config import gemma3_layer_types

# What a GGUF can describe: the default pattern (5 sliding, 1 global), head_dim scale.
GGUF_CONFIG = preset("tiny-gemma3").replace(
    n_layers=6, layer_types=gemma3_layer_types(6), sliding_window=6, query_pre_attn_scalar=32.0)


def _tokens(vocab: int, b: int = 2, t: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def hf_models():
    return {name: make_hf_model(cfg) for name, cfg in HF_GEMMA3_CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(HF_GEMMA3_CONFIGS))
def test_hf_safetensors_logits_match_transformers(hf_models, tmp_path, name):
    config, hf = HF_GEMMA3_CONFIGS[name], hf_models[name]
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path)
    assert model.config == config
    tokens = _tokens(config.vocab)  # 24 tokens: longer than the sliding window
    ref = hf_logits(hf, tokens)
    assert rel_err(model(tokens), ref) < 1e-4
    # Negative controls: every layer global, or the same RoPE base everywhere, disagree.
    every_global = config.replace(layer_types=("global",) * config.n_layers)
    assert rel_err(forward(every_global, model.params, tokens), ref) > 1e-3
    one_base = config.replace(rope_local_theta=config.rope_theta)
    assert rel_err(forward(one_base, model.params, tokens), ref) > 1e-3


def test_gguf_file_matches_transformers(tmp_path):
    hf = make_hf_model(GGUF_CONFIG, seed=3)
    path = tmp_path / "g.gguf"
    write_gguf(path, GGUF_CONFIG, hf)
    model = load_model(path, tokenizer=False)
    assert model.config.replace(eos_ids=(1,), bos_id=2) == GGUF_CONFIG.replace(max_position_embeddings=512)
    tokens = _tokens(GGUF_CONFIG.vocab, seed=4)
    assert rel_err(model(tokens), hf_logits(hf, tokens)) < 1e-4


@pytest.mark.parametrize("bad, message", [
    (dict(drop=["blk.2.attn_k_norm.weight"]), r"missing tensor 'blk\.2\.attn_k_norm\.weight'"),
    (dict(unreadable=["blk.1.ffn_up.weight"]), r"'blk\.1\.ffn_up\.weight' uses quant type Q8_1"),
    (dict(arch="gemma4"), r"general\.architecture='gemma4'"),
    ("truncate", r"truncated"),
], ids=["missing", "quant-type", "arch", "truncated"])
def test_bad_gemma3_gguf_gets_a_one_line_error(tmp_path, bad, message):
    hf = make_hf_model(GGUF_CONFIG, seed=3)
    path = tmp_path / "g.gguf"
    write_gguf(path, GGUF_CONFIG, hf, **(bad if isinstance(bad, dict) else {}))
    if bad == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path, tokenizer=False)
    assert "\n" not in str(err.value)


CONFIG = preset("tiny-gemma3")


@pytest.mark.parametrize("kind", ["dense", "pq"])
def test_decode_through_the_hybrid_cache_equals_the_full_forward(params, kind):
    """Chunked ragged prefill, then decode steps well past the window (8): every position's
    logits equal the cache-free forward's (dense), or stay close with PQ codes on the global layer
    while the sliding layers stay exact."""
    cfg = CONFIG
    t_all = 30
    tokens = _tokens(cfg.vocab, t=t_all, seed=5)
    ref = np.asarray(forward(cfg, params, tokens))
    spec = CacheSpec("dense", dtype=jnp.float32)
    if kind == "pq":
        from million_jax import fit_kv_codebooks
        cal = np.random.default_rng(0).standard_normal((1, 1, 2048, cfg.head_dim)).astype(np.float32)
        books = fit_kv_codebooks(cal, cal, M=cfg.head_dim // 2, nbits=8, key=jax.random.PRNGKey(0), iters=3)
        spec = CacheSpec("pq", codebooks=books, window=4, sinks=2, dtype=jnp.float32)
    cache, consts = make_cache(spec, cfg, batch=2, max_len=40)
    logits, cache = prefill(cfg, params, cache, tokens[:, :5], jnp.array([5, 3]), consts)
    got = {0: [logits[0, i] for i in range(5)], 1: [logits[1, i] for i in range(3)]}
    chunk = np.stack([tokens[0, 5:11], tokens[1, 3:9]])
    logits, cache = prefill(cfg, params, cache, chunk, jnp.array([6, 6]), consts)
    got[0] += [logits[0, i] for i in range(6)]
    got[1] += [logits[1, i] for i in range(6)]
    for step in range(12):
        tok = jnp.array([tokens[0, 11 + step], tokens[1, 9 + step]])
        logits, cache = decode_step(cfg, params, cache, tok, consts)
        got[0].append(logits[0])
        got[1].append(logits[1])
    for r in range(2):
        g = np.stack([np.asarray(x) for x in got[r]])
        err = rel_err(g, ref[r, : len(g)])
        assert err < (1e-5 if kind == "dense" else 5e-2), (r, err)
    assert np.asarray(cache.lengths).tolist() == [23, 21]


def test_generate_with_the_hybrid_cache_is_the_greedy_forward():
    cfg = CONFIG
    params = init_params(cfg, jax.random.key(1), jnp.float32, stddev=0.2)
    prompt = _tokens(cfg.vocab, b=1, t=6, seed=7)
    cache, _ = make_cache(CacheSpec("dense", dtype=jnp.float32), cfg, batch=1, max_len=32)
    res = generate(cfg, params, cache, prompt, [6], max_new_tokens=14, eos_id=())
    seq = list(prompt[0])
    for _ in range(14):
        seq.append(int(np.argmax(np.asarray(forward(cfg, params, np.array([seq])))[0, -1])))
    assert res.sequences()[0] == seq[6:]


def test_context_check_names_the_limit():
    check_context(preset("gemma3-270m"), 32768)
    with pytest.raises(ContextLengthError, match=r"32769 positions, more than the model's context \(max_position_embeddings 32768\)"):
        check_context(preset("gemma3-270m"), 32769, "the prompt")

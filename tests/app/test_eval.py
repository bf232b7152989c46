"""`million-jax calibrate` and `eval`: files written, JSON fields, the perplexity arithmetic."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from million_app.calibrate import model_fingerprint
from million_app.corpus import read_text, text_hash
from million_jax.quant.codebook_io import load_codebooks
from models import forward

EVAL = ("--text", "builtin:eval", "--quiet")


def hand_nll(model, ids: list[int], window: int, max_tokens: int) -> tuple[float, int]:
    """Mean -log p over every token but each window's first, computed with models.forward."""
    ids = np.asarray(ids[:max_tokens])
    n = len(ids) // window
    total, count = 0.0, 0
    for w in ids[: n * window].reshape(n, window):
        logits = np.asarray(forward(model.config, model.params, w[None]), np.float64)[0]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total += -sum(logp[t - 1, w[t]] for t in range(1, window))
        count += window - 1
    return total / count, count


def test_calibrate_writes_codebooks_with_metadata(codebooks, tiny):
    books, meta = load_codebooks(codebooks)
    assert set(books) == {"key", "value"}
    c = tiny.config
    assert books["key"].centroids.shape == (c.n_layers, c.n_kv_heads, 8, 64, 2)  # layer_head, M=8, 6 bit
    assert meta["model_fingerprint"] == model_fingerprint(tiny)
    assert (meta["M"], meta["nbits"], meta["granularity"]) == (8, 6, "layer_head")
    assert (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"]) == (2, 2, 16)
    assert meta["calib_tokens"] == 1024 and meta["calib_window"] == 256
    assert meta["calib_text"] == "builtin:calib"
    assert meta["calib_text_hash"] == text_hash(read_text("builtin:calib"))
    assert meta["bits_per_element"] == 3.0 and meta["iters"] == 3


def test_dense_nll_matches_hand_computation(cli, tiny_dir, tiny, tmp_path):
    """Windows of 64 from the first 200 tokens: 3 windows (the partial 8 dropped), 63 targets each."""
    out = tmp_path / "dense.json"
    res = cli("eval", "--model", tiny_dir, *EVAL, "--window", 64, "--max-tokens", 200,
              "--batch", 2, "--cache-dtype", "float32", "--json", out)
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    ids = tiny.tokenizer.encode(read_text("builtin:eval"), add_special_tokens=False).ids
    nll, count = hand_nll(tiny, ids, 64, 200)
    assert (r["tokens"], r["windows"], r["window"]) == (count, 3, 64) == (189, 3, 64)
    np.testing.assert_allclose(r["nll"], nll, rtol=2e-5)
    np.testing.assert_allclose(r["ppl"], np.exp(nll), rtol=2e-5)
    assert r["text_tokens"] == len(ids) and r["bos"] is False
    assert r["bits_per_element"] == 32 and r["cache"] == "dense"
    # DenseCache for one 64-token window: 2 (K, V) * L * Hkv * T * d * 4 bytes + lengths
    assert r["cache_bytes"] == 2 * 2 * 2 * 64 * 16 * 4 + 4
    assert "ppl" in res.out


def test_bos_is_prepended_once(cli, tiny_dir, tiny, tmp_path):
    out = tmp_path / "bos.json"
    assert cli("eval", "--model", tiny_dir, *EVAL, "--window", 32, "--max-tokens", 64, "--bos",
               "--cache-dtype", "float32", "--json", out).rc == 0
    r = json.loads(out.read_text())
    ids = [tiny.config.bos_id] + tiny.tokenizer.encode(read_text("builtin:eval"),
                                                       add_special_tokens=False).ids
    nll, _ = hand_nll(tiny, ids, 32, 64)
    np.testing.assert_allclose(r["nll"], nll, rtol=2e-5)
    assert r["bos"] is True


def test_pq_all_vs_realistic(cli, tiny_dir, codebooks, tmp_path):
    """All tokens from codes moves the nll; a recent window covering the whole eval window
    keeps every token exact, which must reproduce the dense nll."""
    common = ("--model", tiny_dir, *EVAL, "--window", 64, "--max-tokens", 128, "--cache-dtype", "float32")
    runs = {}
    for name, flags in {"dense": (), "all": ("--cache", "pq", "--codebooks", codebooks),
                        "exact": ("--cache", "pq", "--codebooks", codebooks, "--protocol",
                                  "realistic", "--recent", 64)}.items():
        out = tmp_path / f"{name}.json"
        res = cli("eval", *common, *flags, "--json", out)
        assert res.rc == 0, res.err
        runs[name] = json.loads(out.read_text())
    assert abs(runs["all"]["nll"] - runs["dense"]["nll"]) > 1e-4
    np.testing.assert_allclose(runs["exact"]["nll"], runs["dense"]["nll"], rtol=1e-5)
    r = runs["all"]
    assert (r["protocol"], r["M"], r["nbits"], r["granularity"]) == ("all", 8, 6, "layer_head")
    # 6-bit codes are packed: 8 codes in 6 bytes, so the stored bits are the real ones
    assert r["bits_per_element"] == 8 * 6 / 16 and r["storage_bits_per_element"] == 3.0
    # codes only: 2 (K, V) * L * Hkv * T * (8 * 6 / 8 bytes) + lengths; dense float32 for comparison
    assert r["cache_bytes"] == 2 * 2 * 2 * 64 * 6 + 4
    assert r["dense_cache_bytes"] == 2 * 2 * 2 * 64 * 16 * 4 + 4
    assert r["codebook_bytes"] == 2 * 2 * 2 * 8 * 64 * 2 * 4 + 8 * 4  # + the RoPE frequencies (pre-RoPE keys)
    assert runs["exact"]["recent"] == 64 and runs["exact"]["cache_bytes"] > r["cache_bytes"]
    assert r["model_fingerprint"] and r["environment"]["backend"] == jax.default_backend()


def test_uniform_bits_and_protocol(cli, tiny_dir, tmp_path):
    out = tmp_path / "u.json"
    res = cli("eval", "--model", tiny_dir, *EVAL, "--window", 64, "--max-tokens", 128,
              "--cache", "uniform", "--bits", 4, "--group-size", 16, "--json", out)
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    # int4 codes + a bf16 scale and zero per group of 16: 4 + 2 * 16 / 16 = 6 bits
    assert r["bits_per_element"] == 6.0 and r["uniform_mode"] == "kivi" and r["group_size"] == 16
    assert r["cache_dtype"] == "bfloat16" and r["dense_cache_dtype"] == "bfloat16"
    assert r["dense_cache_bytes"] == 2 * 2 * 2 * 64 * 16 * 2 + 4
    assert r["cache_bytes"] < r["dense_cache_bytes"]
    assert np.isfinite(r["ppl"]) and r["ppl"] > 1

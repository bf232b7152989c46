"""`sweep`, `generate`, `passkey` and `demo` end to end on the tiny model; the console entry."""
from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from million_app import progress
from million_app.caches import beyond_calibration
from million_jax import CacheSpec
from million_app.passkey import first_number, key_tokens, passkey_prompt, run_trials
from logp_reference import continuation_logp
from models import generate, init_cache, load_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_sweep_writes_table_json_and_plot(cli, tiny_dir, tmp_path):
    out = tmp_path / "sweep"
    res = cli("sweep", "--model", tiny_dir, "--calib", "builtin:calib", "--text", "builtin:eval",
              "--out", out, "--calib-tokens", 512, "--max-tokens", 256, "--window", 128,
              "--iters", 1, "--max-vectors", 512, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads((out / "results.json").read_text())
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["dense"]["cache"] == "dense" and list(rows)[0] == "dense"
    pq = [row for row in r["rows"] if row["cache"] == "pq"]
    assert {row["granularity"] for row in pq if row["bits_per_element"] == 4.0} == {
        "shared", "layer", "layer_head"}
    assert {2.0, 3.0, 4.0} <= {row["bits_per_element"] for row in pq}
    assert {"uniform-kivi-int2", "uniform-kivi-int4", "uniform-token-int4"} <= set(rows)
    for row in r["rows"]:
        assert np.isfinite(row["ppl"]) and row["tokens"] == 2 * 127
        assert row["cache"] == "dense" or "ppl_increase_pct" in row
    assert r["settings"]["max_tokens"] == 256 and r["calib_tokens_used"] == 512
    md = (out / "results.md").read_text()
    assert md.count("\n| ") == len(r["rows"]) + 1  # header + one line per row
    assert "pq M=8 nbits=8 shared" in md and "uniform kivi int2" in md
    assert (out / "ppl_vs_bits.png").read_bytes()[:8] == PNG_MAGIC
    assert "results.json" in res.out


def test_generate_streams_and_matches_jitted_generate(cli, tiny_dir, tmp_path):
    out = tmp_path / "gen.json"
    res = cli("generate", "--model", tiny_dir, "--prompt", "The sky is", "--max-new-tokens", 8,
              "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert res.out.startswith("The sky is")
    assert "tokens/s" in res.out and "cache" in res.out
    assert r["new_tokens"] == len(r["tokens"]) and 1 <= r["new_tokens"] <= 8
    assert r["cache_bytes"] > 0 and r["decode_tokens_per_s"] > 0
    model = load_model(tiny_dir)
    ids = model.encode("The sky is")
    ref = generate(model.config, model.params, init_cache(model.config, 1, len(ids) + 8, jnp.float32),
                   jnp.asarray([ids]), jnp.asarray([len(ids)]), max_new_tokens=8)
    assert r["tokens"] == ref.sequences()[0][: r["new_tokens"]]


def test_generate_prefill_chunk_gives_the_same_tokens(cli, tiny_dir, tmp_path):
    """--prefill-chunk 3 (an 11-token prompt in 4 forwards) streams the tokens one forward gives."""
    prompt = "The quick brown fox jumps over the lazy dog and"
    runs = {}
    for chunk in (0, 3):
        out = tmp_path / f"gen{chunk}.json"
        res = cli("generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", 6,
                  "--prefill-chunk", chunk, "--json", out, "--quiet")
        assert res.rc == 0, res.err
        runs[chunk] = json.loads(out.read_text())
        assert runs[chunk]["prefill_chunk"] == chunk
    assert runs[3]["prompt_tokens"] > 3 * 3
    assert runs[3]["tokens"] == runs[0]["tokens"] and runs[0]["new_tokens"] >= 1
    bad = cli("generate", "--model", tiny_dir, "--prompt", prompt, "--prefill-chunk", -5)
    assert bad.rc != 0 and "--prefill-chunk must be >= 0" in bad.err


def test_generate_with_pq_cache(cli, tiny_dir, codebooks, tmp_path):
    out = tmp_path / "gen.json"
    res = cli("generate", "--model", tiny_dir, "--prompt", "Hello", "--max-new-tokens", 4,
              "--cache", "pq", "--codebooks", codebooks, "--recent", 2, "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert (r["cache"], r["protocol"], r["recent"]) == ("pq", "realistic", 2)
    assert r["cache_bytes"] < r["dense_cache_bytes"] * 2


def test_passkey_prompt_and_answer_parsing(tiny_dir):
    model = load_model(tiny_dir)
    ids = passkey_prompt(model, 480, 48213, 0.5)
    text = model.decode(ids)
    assert len(ids) <= 480 and "The pass key is 48213." in text
    assert text.rstrip().endswith("The pass key is")
    assert first_number(" 48213. Remember") == 48213 and first_number("none") is None


def test_run_trials_scores_the_key_like_a_full_forward(tiny_dir):
    """key_logp / first_p of each trial equal log p(" K" | prompt) from one forward over prompt + key,
    keys of different token counts in one batch (padded at the end)."""
    model = load_model(tiny_dir)
    keys = [48213, 7, 99031]
    prompts = [passkey_prompt(model, n, k, d) for n, k, d in ((420, keys[0], 0.0), (380, keys[1], 0.5),
                                                            (420, keys[2], 1.0))]
    assert len(key_tokens(model, 7)) < len(key_tokens(model, 48213))
    rows = run_trials(model, prompts, keys, CacheSpec("dense", dtype=jnp.float32), batch=2)
    assert [r["key"] for r in rows] == keys
    for r, prompt, key in zip(rows, prompts, keys):
        ref = continuation_logp(model.config, model.params, prompt, key_tokens(model, key))
        assert len(r["key_token_logp"]) == len(ref)
        assert r["key_logp"] == pytest.approx(float(ref.sum()), abs=2e-3)
        assert r["first_p"] == pytest.approx(float(np.exp(ref[0])), rel=1e-3)


def test_scoring_leaves_the_answers_of_a_quantized_cache_alone(tiny_dir):
    """The forced copy of the cache does not touch the greedy answer (turboquant, ragged prompts)."""
    model = load_model(tiny_dir)
    keys = [48213, 10457, 99031]
    prompts = [passkey_prompt(model, n, k, 0.5) for n, k in zip((420, 380, 400), keys)]
    spec = CacheSpec("turboquant", bits=4, dtype=jnp.float32)
    scored = run_trials(model, prompts, keys, spec, batch=3)
    plain = run_trials(model, prompts, keys, spec, batch=3, score=False)
    assert [r["answer"] for r in scored] == [r["answer"] for r in plain]
    assert "key_logp" not in plain[0] and all(np.isfinite(r["key_logp"]) for r in scored)


def test_passkey_command(cli, tiny_dir, post_codebooks, tmp_path):
    out = tmp_path / "pk.json"
    res = cli("passkey", "--model", tiny_dir, "--lengths", "400", "--trials", 2, "--cache", "pq",
              "--codebooks", post_codebooks, "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["lengths"] == [400] and set(r["results"]) == {"dense bfloat16", "pq M=8 nbits=6 layer_head"} \
        or set(r["results"]) == {"dense float32", "pq M=8 nbits=6 layer_head"}
    for runs in r["results"].values():
        assert len(runs) == 1 and len(runs[0]["trials"]) == 2
        assert runs[0]["accuracy"] == sum(t["correct"] for t in runs[0]["trials"]) / 2
        assert runs[0]["key_logp"] == pytest.approx(np.mean([t["key_logp"] for t in runs[0]["trials"]]), abs=1e-3)
        assert all(t["key_logp"] < 0 and 0 < t["first_p"] <= 1 for t in runs[0]["trials"])
    assert "| 400 |" in res.out and "mean log p of the key" in res.out
    # post-RoPE codebooks calibrated on 256-token windows: a warning names it, even with --quiet
    assert "warning: the codebooks" in res.err and "windows of 256 tokens" in res.err and "--window 400" in res.err


def test_calibration_warning_only_past_the_window(cli, tiny_dir, codebooks, post_codebooks):
    """Post-RoPE codebooks warn past their calibration window; pre-RoPE ones serve every position."""
    base = ("eval", "--model", tiny_dir, "--text", "builtin:eval", "--max-tokens", 300, "--cache", "pq", "--quiet")
    within = cli(*base, "--codebooks", post_codebooks, "--window", 256)
    assert within.rc == 0, within.err
    assert "warning" not in within.err
    past = cli(*base, "--codebooks", post_codebooks, "--window", 300)
    assert past.rc == 0, past.err
    assert "warning: the codebooks" in past.err and "windows of 256 tokens" in past.err
    pre = cli(*base, "--codebooks", codebooks, "--window", 300)
    assert pre.rc == 0, pre.err
    assert "warning" not in pre.err


def test_calibration_advice_mixes_a_short_window():
    """Past the window the advice keeps 512-token windows next to the long one (one long
    window alone starves the sinks: benchmarks/results/position_error_smollm2)."""
    pq = CacheSpec("pq")
    assert beyond_calibration(pq, 512, calib_window=512) is None
    assert "calibrate --rope post --window 512,8192`" in beyond_calibration(pq, 8192, calib_window=512)
    assert "calibrate --rope post --window 400`" in beyond_calibration(pq, 400, calib_window=256)
    assert "--rope pre" in beyond_calibration(pq, 400, calib_window=256)
    assert beyond_calibration(CacheSpec("uniform", bits=4), 8192, calib_window=256) is None


def test_demo_on_tiny_model(cli, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "_INTERVAL", 0.0)  # a status line per step (not a terminal)
    out = tmp_path / "demo.json"
    res = cli("demo", "--model", tiny_dir, "--calib-tokens", 512, "--eval-tokens", 256,
              "--window", 128, "--nbits", 4, "--iters", 2, "--max-vectors", 512,
              "--new-tokens", 4, "--json", out)
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["dense"]["tokens"] == r["pq"]["tokens"] == 2 * 127
    assert r["pq"]["bits_per_element"] == 8 * 4 / 16
    assert r["memory_long_context"]["cache_bytes"] < r["memory_long_context"]["dense_cache_bytes"]
    assert r["memory_eval_window"]["cache_bytes"] == r["pq"]["cache_bytes"]
    for needle in ("perplexity over", "lower is better", "dense cache", "PQ cache",
                   "layer_head = one codebook per layer and KV head",
                   "memory of one 128-token window (the evaluated length)", "prompt:"):
        assert needle in res.out, needle
    # off a terminal: status lines with counts (and ETA) for every long phase
    for needle in ("calibration forward (4 windows of 128): 512/512 tokens", "k-means: ", " fits", "ETA",
                   "perplexity, dense cache: 2/2 windows", "generating, dense cache: ",
                   "generating, pq cache: 4/4 tokens"):
        assert needle in res.err, needle


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "million_app", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0
    for cmd in ("calibrate", "eval", "sweep", "generate", "passkey", "demo"):
        assert cmd in res.stdout
    bad = subprocess.run([sys.executable, "-m", "million_app", "eval"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "--model" in bad.stderr


def test_passkey_prefill_chunk_gives_the_same_answers(cli, tiny_dir, tmp_path):
    """--prefill-chunk 64 (a 400-token prompt in 7 forwards) answers as one forward does."""
    answers = {}
    for chunk in (0, 64):
        out = tmp_path / f"pk{chunk}.json"
        res = cli("passkey", "--model", tiny_dir, "--lengths", "400", "--trials", 2, "--cache", "turboquant",
                  "--bits", 4, "--prefill-chunk", chunk, "--json", out, "--quiet")
        assert res.rc == 0, res.err
        r = json.loads(out.read_text())
        assert r["prefill_chunk"] == chunk
        answers[chunk] = {lab: [t["answer"] for t in runs[0]["trials"]] for lab, runs in r["results"].items()}
    assert answers[64] == answers[0] and len(answers[0]) == 2
    bad = cli("passkey", "--model", tiny_dir, "--lengths", "400", "--prefill-chunk", -1)
    assert bad.rc != 0 and "--prefill-chunk must be >= 0" in bad.err

"""Messages that say what is wrong in words (issue 26 item 7): codebooks without model metadata,
a directory given as codebook file, a missing --bits, singular counts, the recipe line."""
from __future__ import annotations

import pytest

from million_app.recipes import BEST_FOR_BITS, RECIPES
from million_jax.quant import pq, uniform
from million_jax.quant.codebook_io import load_codebook_file, load_kv_codebooks, save_codebooks, save_kv_codebooks

EVAL = ("--text", "builtin:eval", "--max-tokens", 256, "--window", 128)


@pytest.mark.parametrize("how", ["save_kv_codebooks", "save_codebooks"])
def test_codebooks_without_model_metadata_say_what_is_missing(error_line, cli, tiny_dir, codebooks, tmp_path, how):
    path = tmp_path / f"{how}.safetensors"
    if how == "save_kv_codebooks":  # the Python API, no metadata given
        books, _ = load_kv_codebooks(codebooks)
        save_kv_codebooks(path, books)
        missing = ("n_kv_heads", "model_fingerprint")  # head_dim is recorded by save_kv_codebooks
    else:  # the generic codebook writer: not even the layer count
        tensors, extras, _ = load_codebook_file(codebooks)
        save_codebooks(path, tensors, {}, extras)
        missing = ("n_layers", "n_kv_heads", "head_dim", "model_fingerprint")
    line = error_line(cli("eval", "--model", tiny_dir, *EVAL, "--cache", "pq", "--codebooks", path))
    assert "?" not in line and "None" not in line, line
    assert str(path) in line and "without the model metadata" in line and "million-jax calibrate" in line
    assert all(m in line for m in missing), line


def test_other_models_codebooks_name_that_model(error_line, cli, other_tiny_dir, codebooks):
    line = error_line(cli("eval", "--model", other_tiny_dir, *EVAL, "--cache", "pq", "--codebooks", codebooks))
    assert "?" not in line and "calibrated for model" in line and "fingerprint" in line, line


def test_codebook_directory_is_called_a_directory(error_line, cli, tiny_dir, tmp_path):
    line = error_line(cli("eval", "--model", tiny_dir, *EVAL, "--cache", "pq", "--codebooks", tmp_path))
    assert "is a directory" in line and "not found" not in line, line


def test_missing_bits_is_named(error_line, cli, tiny_dir):
    line = error_line(cli("eval", "--model", tiny_dir, *EVAL, "--cache", "uniform"))
    assert "--bits" in line and "None" not in line, line
    for check, args in ((uniform.check_mode, ("kivi", None, 32)), (pq.check_nbits, (None,))):
        with pytest.raises(ValueError) as e:
            check(*args)
        assert "None" not in str(e.value) and "not given" in str(e.value)


def test_one_passkey_prompt_is_singular(cli, tiny_dir):
    res = cli("passkey", "--model", tiny_dir, "--lengths", 400, "--trials", 1, "--batch", 1)
    assert res.rc == 0, res.err
    assert "(1 prompt)" in res.err and "prompts)" not in res.err


def test_calibrate_bits_describes_its_recipe_in_words(cli, tiny_dir, tmp_path):
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", 512, "--window", 256,
              "--bits", 2, "--rope", "pre", "--iters", 2, "--out", tmp_path / "b.safetensors")
    assert res.rc == 0, res.err
    (line,) = [ln for ln in res.err.splitlines() if ln.startswith("recipe ")]
    assert "Recipe(" not in line and "=" not in line, line
    assert line.endswith(RECIPES[BEST_FOR_BITS["pre"][2]].describe())
    for r in RECIPES.values():
        d = r.describe()
        assert f"keys {r.key_dsub}-dim sub-vectors x {r.key_nbits} bits" in d
        assert f"values {r.value_dsub}-dim sub-vectors x {r.value_nbits} bits" in d
        assert d.endswith(f"({r.bits_per_element:.2f} bits/elem{' of codes' if r.norms else ''})")
        assert ("norm scale" in d) == r.norms
        assert ("query-aware" in d) == r.query_aware and ("output-aware" in d) == r.output_aware
        assert ("residual" in d) == (r.stages > 1) and ("fine-tuned" in d) == bool(r.finetune_steps)

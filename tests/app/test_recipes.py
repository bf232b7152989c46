"""`million-jax calibrate --bits B`: the recipe is fitted and recorded in the file."""
from __future__ import annotations

import numpy as np
import pytest

from million_app.calibrate import load_model_codebooks
from million_app.recipes import BEST_FOR_BITS, RECIPES
from million_jax.codebook_io import load_codebooks
from models import load_model
from conftest import one_error_line


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def test_calibrate_bits_writes_the_recipe(cli, tiny_dir, tiny, tmp_path):
    path = tmp_path / "b2.safetensors"
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
              "--bits", "2", "--iters", "2", "--out", path, "--quiet")
    assert res.rc == 0, res.err
    recipe = RECIPES[BEST_FOR_BITS[2]]
    _, meta = load_codebooks(path)
    d = tiny.config.head_dim
    assert meta["recipe"] == recipe.name and meta["bits_per_elem"] == recipe.bits_per_elem == 2.0
    assert (meta["key_M"], meta["key_nbits"], meta["value_M"], meta["value_nbits"]) == (
        d // recipe.key_dsub, recipe.key_nbits, d // recipe.value_dsub, recipe.value_nbits)
    assert meta["query_aware_keys"] == recipe.query_aware
    books, _ = load_model_codebooks(str(path), tiny)
    if recipe.query_aware:
        a, qt = np.asarray(books.key_transform), np.asarray(books.query_transform)
        np.testing.assert_allclose(np.swapaxes(qt, -1, -2) @ a, np.broadcast_to(np.eye(d), a.shape), atol=1e-3)


def test_bits_excludes_m_and_nbits(cli, tiny_dir, tmp_path):
    err = one_error_line(cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--bits", "4",
                             "--nbits", "6", "--out", tmp_path / "x.safetensors", "--quiet"))
    assert "--bits" in err


def test_default_calibration_window_is_the_context_or_the_tokens(cli, tiny_dir, tiny, tmp_path):
    """Without --window the codebooks are calibrated on windows as long as the model's context
    (capped) or the calibration tokens, and the file records it."""
    ctx = tiny.config.max_position_embeddings
    for tokens, want in ((ctx // 2, ctx // 2), (2 * ctx, ctx)):
        path = tmp_path / f"w{tokens}.safetensors"
        res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", tokens, "--nbits", "4",
                  "--iters", "1", "--out", path)
        assert res.rc == 0, res.err
        _, meta = load_codebooks(path)
        assert meta["calib_window"] == want and meta["calib_tokens"] == tokens // want * want
        assert f"calibration window {want} tokens" in res.err

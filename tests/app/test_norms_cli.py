"""`calibrate --norms`: norm-explicit codebooks recorded in the file, read back by `eval`, their
float16 scales counted in the stored bits."""
from __future__ import annotations

import json

import numpy as np

from million_app.calibrate import load_model_codebooks
from million_jax.quant.codebook_io import load_codebooks

EVAL = ("--text", "builtin:eval", "--quiet", "--window", 64, "--max-tokens", 128, "--cache-dtype", "float32")
CALIB = ("--text", "builtin:calib", "--tokens", "1024", "--window", "256", "--nbits", "6", "--iters", "3", "--quiet")


def _eval(cli, tiny_dir, tmp_path, name, books):
    out = tmp_path / f"{name}.json"
    res = cli("eval", "--model", tiny_dir, *EVAL, "--cache", "pq", "--codebooks", books, "--json", out)
    assert res.rc == 0, res.err
    return json.loads(out.read_text())


def test_norms_on_records_reads_back_and_counts(cli, tiny_dir, tiny, codebooks, tmp_path):
    path = tmp_path / "norms.safetensors"
    res = cli("calibrate", "--model", tiny_dir, *CALIB, "--norms", "on", "--out", path)
    assert res.rc == 0, res.err
    books, _ = load_model_codebooks(str(path), tiny)
    plain, _ = load_model_codebooks(codebooks, tiny)  # the conftest fixture: the same settings, no norms
    assert (books.key_norms, books.value_norms) == (True, True) and (plain.key_norms, plain.value_norms) == (False,
                                                                                                          False)
    # the same k-means: the norms are stored beside the same codes
    np.testing.assert_array_equal(np.asarray(books.key.centroids), np.asarray(plain.key.centroids))
    d = tiny.config.head_dim
    meta = load_codebooks(str(path))[1]
    assert meta["bits_per_element"] == 3.0 + 16 / d
    normed, base = _eval(cli, tiny_dir, tmp_path, "normed", path), _eval(cli, tiny_dir, tmp_path, "plain", codebooks)
    assert normed["storage_bits_per_element"] == normed["bits_per_element"] == 3.0 + 16 / d
    assert base["storage_bits_per_element"] == 3.0
    assert normed["bytes_per_token"] - base["bytes_per_token"] == 2 * 2 * 2 * 2  # K + V float16, 2 layers x 2 heads
    assert " nkv " in normed["cache_label"]
    assert abs(normed["nll"] - base["nll"]) > 1e-5


def test_norms_off_and_bad_value(cli, tiny_dir, tiny, tmp_path):
    path = tmp_path / "off.safetensors"
    res = cli("calibrate", "--model", tiny_dir, *CALIB, "--norms", "off", "--out", path)
    assert res.rc == 0, res.err
    books, _ = load_model_codebooks(str(path), tiny)
    assert (books.key_norms, books.value_norms) == (False, False)
    res = cli("calibrate", "--model", tiny_dir, *CALIB, "--norms", "maybe", "--out", tmp_path / "x.safetensors")
    assert res.rc != 0 and "--norms" in res.err


def test_norms_flag_picks_the_named_recipe_with_bits(cli, tiny_dir, tiny, tmp_path):
    """With --bits the flag swaps the recipe for its named norm variant (name and measured precise
    sinks follow it); 'unit' fits the codebooks on unit vectors (NEQ)."""
    from million_app.recipes import BEST_FOR_BITS, PRECISE_SINKS, RECIPES, with_norms

    best = RECIPES[BEST_FOR_BITS["pre"][2]]  # --bits 2 keeps keys before RoPE
    for norms in ("off", "unit"):
        path = tmp_path / f"b2_{norms}.safetensors"
        res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
                  "--bits", "2", "--norms", norms, "--iters", "2", "--max-vectors", "512", "--out", path, "--quiet")
        assert res.rc == 0, res.err
        want = with_norms(best, norms != "off", norms == "unit")
        assert want.name in RECIPES  # a named, measured recipe, not a made-up copy
        meta = load_codebooks(str(path))[1]
        assert meta["recipe"] == want.name and meta["precise_sinks"] == PRECISE_SINKS.get(want.name, 0)
        books, _ = load_model_codebooks(str(path), tiny)
        assert (books.key_norms, books.unit_codes) == (norms != "off", norms == "unit")


def test_unit_recipe_fits_directions_only(tiny):
    """A unit recipe's codebooks do not depend on the vectors' lengths (fitted on x / |x|); the
    plain recipe's do."""
    import jax

    from million_app.recipes import RECIPES, fit_recipe

    c = tiny.config
    rng = np.random.default_rng(0)
    k, v = (rng.normal(size=(c.n_global_layers, c.n_kv_heads, 600, c.head_dim)).astype(np.float32) for _ in "kv")
    lengths = rng.uniform(0.1, 10.0, size=k.shape[:-1] + (1,)).astype(np.float32)
    gram = np.broadcast_to(np.eye(c.head_dim, dtype=np.float32), k.shape[:2] + (c.head_dim,) * 2).copy()
    count = np.ones(k.shape[:2], np.float32)
    fit = lambda name, kk, vv: fit_recipe(RECIPES[name], tiny, kk, vv, gram, count, iters=2,  # noqa: E731
                                          max_vectors=512)
    with jax.default_matmul_precision("highest"):
        u1, u2 = fit("pq2-r2-qa-nu", k, v), fit("pq2-r2-qa-nu", k * lengths, v * lengths)
        p1, p2 = fit("pq2-r2-qa-n", k, v), fit("pq2-r2-qa-n", k * lengths, v * lengths)
    assert u1.unit_codes and not p1.unit_codes
    np.testing.assert_allclose(np.asarray(u1.value.centroids), np.asarray(u2.value.centroids), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(p1.value.centroids) - np.asarray(p2.value.centroids)).max() > 0.1

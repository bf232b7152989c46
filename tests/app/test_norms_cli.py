"""`calibrate --norms`: norm-explicit codebooks recorded in the file, read back by `eval`, their
bf16 scales counted in the stored bits."""
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
    assert normed["bytes_per_token"] - base["bytes_per_token"] == 2 * 2 * 2 * 2  # K + V bf16, 2 layers x 2 heads
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

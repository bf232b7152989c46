"""`--precise-sinks`: the first N tokens kept in the cache dtype under --protocol all too; recorded by
`calibrate`, read back by `eval` from the codebook file; their bytes reported apart."""
from __future__ import annotations

import json

import numpy as np
import pytest

from million_app.cli import main
from million_jax.quant.codebook_io import load_codebooks

EVAL = ("--text", "builtin:eval", "--quiet", "--window", 64, "--max-tokens", 128, "--cache-dtype", "float32")


@pytest.fixture(scope="module")
def sink_codebooks(tiny_dir, tmp_path_factory) -> str:
    """The ``codebooks`` fixture's settings, recorded with 4 precise sinks."""
    path = str(tmp_path_factory.mktemp("books") / "tiny_sinks.safetensors")
    assert main(["calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
                 "--nbits", "6", "--iters", "3", "--precise-sinks", "4", "--out", path, "--quiet"]) == 0
    return path


def _eval(cli, tiny_dir, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    res = cli("eval", "--model", tiny_dir, *EVAL, "--cache", "pq", *flags, "--json", out)
    assert res.rc == 0, res.err
    return json.loads(out.read_text())


def test_precise_sinks_from_the_file_or_the_flag(cli, tiny_dir, codebooks, sink_codebooks, tmp_path):
    assert load_codebooks(sink_codebooks)[1]["precise_sinks"] == 4
    assert load_codebooks(codebooks)[1].get("precise_sinks", 0) == 0  # --M/--nbits: nothing recorded
    plain = _eval(cli, tiny_dir, tmp_path, "plain", "--codebooks", codebooks)
    flag = _eval(cli, tiny_dir, tmp_path, "flag", "--codebooks", codebooks, "--precise-sinks", 4)
    # same seed and settings: the same centroids, so the file's metadata must give the flag's result
    from_file = _eval(cli, tiny_dir, tmp_path, "file", "--codebooks", sink_codebooks)
    off = _eval(cli, tiny_dir, tmp_path, "off", "--codebooks", sink_codebooks, "--precise-sinks", 0)
    sinks_only = _eval(cli, tiny_dir, tmp_path, "realistic", "--codebooks", codebooks, "--protocol", "realistic",
                       "--sinks", 4, "--recent", 0)
    assert from_file["protocol"] == flag["protocol"] == "all"
    assert (from_file["precise_sinks"], off["precise_sinks"], plain["precise_sinks"]) == (4, 0, 0)
    np.testing.assert_allclose(from_file["nll"], flag["nll"], rtol=1e-6)
    np.testing.assert_allclose(off["nll"], plain["nll"], rtol=1e-6)
    # every token from codes but the first 4 == realistic with 4 exact sinks and no recent window
    np.testing.assert_allclose(flag["nll"], sinks_only["nll"], rtol=1e-6)
    assert abs(flag["nll"] - plain["nll"]) > 1e-5
    # bytes: the sinks are fixed per sequence (K and V, 2 layers, 2 KV heads, 4 rows, d 16, float32),
    # reported apart and added to the cache, never to the per-token bits
    assert flag["sink_bytes"] == 2 * 2 * 2 * 4 * 16 * 4 and plain["sink_bytes"] == 0
    assert flag["cache_bytes"] == plain["cache_bytes"] + flag["sink_bytes"]
    assert flag["storage_bits_per_element"] == plain["storage_bits_per_element"] == 3.0
    assert flag["bytes_per_token"] == plain["bytes_per_token"]
    assert "+4 float32 sinks" in flag["cache_label"]


def test_precise_sinks_refused_off_pq(cli, tiny_dir, tmp_path):
    res = cli("eval", "--model", tiny_dir, *EVAL, "--cache", "uniform", "--bits", 4, "--precise-sinks", 4)
    assert res.rc != 0 and "--precise-sinks is a setting of --cache pq" in res.err
    res = cli("eval", "--model", tiny_dir, *EVAL, "--cache", "pq", "--codebooks", "x.safetensors",
              "--precise-sinks", -1)
    assert res.rc != 0 and "--precise-sinks must be >= 0" in res.err


def test_calibrate_bits_records_the_adopted_sinks(cli, tiny_dir, tmp_path, monkeypatch):
    """--bits 2 records the precise sinks measured for its recipe (PRECISE_SINKS: 4 for pq2-r2-qa,
    none for today's pq2-r2-qa-n); --precise-sinks overrides it."""
    from million_app import recipes

    for best in ("pq2-r2-qa", recipes.BEST_FOR_BITS["post"][2]):
        monkeypatch.setitem(recipes.BEST_FOR_BITS["post"], 2, best)
        for flags, want in (((), recipes.PRECISE_SINKS.get(best, 0)), (("--precise-sinks", 3), 3)):
            path = tmp_path / f"b2_{best}_{want}.safetensors"
            res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--window",
                      "256", "--bits", "2", "--rope", "post", *flags, "--iters", "1", "--max-vectors", "512", "--out",
                      path, "--quiet")
            assert res.rc == 0, res.err
            meta = load_codebooks(str(path))[1]
            assert meta["recipe"] == best and meta["precise_sinks"] == want
    assert recipes.PRECISE_SINKS["pq2-r2-qa"] == 4


def test_calibrate_bits_records_four_sinks_on_gemma3(cli, tmp_path):
    """A Gemma 3 model records 4 precise sinks at every --bits (measured: its first token is what its
    codebooks reproduce worst), and so does an --M / --nbits fit there; --precise-sinks still overrides; a LLaMA
    at 4 b records none."""
    from million_app.recipes import FAMILY_PRECISE_SINKS, PRECISE_SINKS, adopted_precise_sinks, recipe_for_bits
    from million_app.tiny import write_tiny_checkpoint
    from models import preset

    gemma = write_tiny_checkpoint(str(tmp_path / "gemma"), config=preset("tiny-gemma3"))
    for flags, want in (((), FAMILY_PRECISE_SINKS["gemma3"]), (("--precise-sinks", 1), 1)):
        path = tmp_path / f"g4_{want}.safetensors"
        res = cli("calibrate", "--model", gemma, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
                  "--bits", "4", *flags, "--iters", "1", "--max-vectors", "512", "--out", path, "--quiet")
        assert res.rc == 0, res.err
        meta = load_codebooks(str(path))[1]
        assert meta["precise_sinks"] == want
        assert meta["recipe"] == recipe_for_bits(4, "pre", "gemma3").name == "pq4-pre-n"  # Gemma's 4 b recipe
    four = recipe_for_bits(4, "pre")
    assert four.name not in PRECISE_SINKS and adopted_precise_sinks(four, "llama") == 0
    assert adopted_precise_sinks(None, "gemma3") == FAMILY_PRECISE_SINKS["gemma3"] == 4  # --M / --nbits fits too
    assert adopted_precise_sinks(None, "llama") == 0
    path = tmp_path / "g_m.safetensors"  # an --M / --nbits fit on Gemma 3 records the family's sinks
    res = cli("calibrate", "--model", gemma, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
              "--M", "8", "--nbits", "4", "--iters", "1", "--max-vectors", "512", "--out", path, "--quiet")
    assert res.rc == 0, res.err
    assert load_codebooks(str(path))[1]["precise_sinks"] == 4

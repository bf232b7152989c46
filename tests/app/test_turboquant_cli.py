"""The turboquant and kivi caches and the niah grid through the command line, on the tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.slow
def test_eval_turboquant_and_kivi(cli, tiny_dir, tmp_path):
    out = tmp_path / "tq.json"
    res = cli("eval", "--model", tiny_dir, "--text", "builtin:eval", "--max-tokens", 256, "--window", 128,
              "--cache", "turboquant", "--bits", "2.5", "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["cache"] == "turboquant" and r["bits"] == 2.5 and r["protocol"] == "all"
    d = r["cache_shape"]["head_dim"]
    assert r["storage_bits_per_element"] == pytest.approx(2.5 + 16 / d)  # codes + a bf16 norm per vector
    out = tmp_path / "kivi.json"
    res = cli("eval", "--model", tiny_dir, "--text", "builtin:eval", "--max-tokens", 256, "--window", 128,
              "--cache", "kivi", "--bits", 2, "--group-size", 16, "--protocol", "realistic", "--recent", 32,
              "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["cache_label"] == "kivi int2 g16 r32" and r["residual"] == 32


@pytest.mark.parametrize("argv,needle", [
    (("--cache", "turboquant"), "--cache turboquant needs --bits"),
    (("--cache", "turboquant", "--bits", "2.7"), "must be one of"),
    (("--cache", "turboquant", "--bits", "3.5", "--qjl"), "integer bits"),
    (("--cache", "uniform", "--bits", 4, "--qjl"), "--qjl/--rotation-seed are settings of --cache turboquant"),
    (("--cache", "kivi", "--bits", 2, "--protocol", "realistic", "--recent", 48), "multiple of the group size"),
    (("--cache", "kivi", "--bits", 2, "--protocol", "realistic", "--sinks", 4), "keeps no exact first tokens"),
    (("--cache", "dense", "--bits", 4), "--bits is a setting"),
])
def test_bad_cache_flags_are_named(cli, tiny_dir, argv, needle):
    res = cli("eval", "--model", tiny_dir, "--text", "builtin:eval", "--max-tokens", 256, "--window", 128, *argv)
    assert res.rc == 2 and needle in res.err, res.err


def test_niah_grid_command(cli, tiny_dir, tmp_path):
    out, png = tmp_path / "niah.json", tmp_path / "niah.png"
    res = cli("niah", "--model", tiny_dir, "--lengths", "400", "--depths", "0,1", "--cache", "turboquant",
              "--bits", 4, "--json", out, "--png", png)
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["lengths"] == [400] and r["depths"] == [0.0, 1.0] and len(r["results"]) == 2
    for grid in r["results"].values():
        assert len(grid["accuracy"]) == 1 and len(grid["accuracy"][0]) == 2
        for j, cell in enumerate(grid["cells"]):  # a cell's key_logp is the mean of its trials'
            assert grid["key_logp"][0][j] == pytest.approx(np.mean([t["key_logp"] for t in cell["trials"]]), abs=1e-3)
            assert all(np.isfinite(t["key_logp"]) and t["key_logp"] < 0 for t in cell["trials"])
    assert "mean log p(key)" in res.out and "loss vs dense" in res.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "niah" in res.err  # progress on stderr
    assert cli("niah", "--model", tiny_dir, "--depths", "0,1.5").rc == 2

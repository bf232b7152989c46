"""Pre-RoPE key codebooks: collected, fitted, saved and loaded; what does not commute is refused."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import rope
from million_jax.cache.dense import DenseCache
from million_jax.calibration.fit import collect_kv, fit_kv_codebooks
from million_jax.quant.codebook_io import CodebookFileError, load_kv_codebooks, save_codebooks, save_kv_codebooks

L, B, HKV, T, D = 2, 2, 2, 40, 16


def _filled_cache(rng, lengths):
    """A DenseCache holding RoPE(pre) keys at positions 0..len-1; returns (cache, pre keys)."""
    pre = rng.standard_normal((L, B, HKV, T, D)).astype(np.float32)
    cos, sin = rope.rope_cos_sin(np.arange(T), rope.rope_inv_freq(D, 10000.0))
    post = np.asarray(rope.rotate(pre, cos, sin))
    cache = DenseCache.create(L, B, HKV, T, D, jnp.float32)
    cache = dataclasses.replace(cache, layers=dataclasses.replace(cache.layers, k=jnp.asarray(post),
                                                                   v=jnp.asarray(pre)),
                                lengths=jnp.asarray(lengths, jnp.int32))
    return cache, pre


def test_collect_kv_unrotates_keys_at_their_positions():
    rng = np.random.default_rng(0)
    lengths = [T, 23]
    cache, pre = _filled_cache(rng, lengths)
    k_pre, _ = collect_kv(cache, rope_inv_freq=rope.rope_inv_freq(D, 10000.0))
    k_post, v = collect_kv(cache)
    want = np.concatenate([pre[:, b, :, :n] for b, n in enumerate(lengths)], axis=2)
    np.testing.assert_allclose(k_pre, want, atol=1e-4)
    assert not np.allclose(k_post, want, atol=1e-2)  # the post-RoPE keys really were rotated
    np.testing.assert_array_equal(v, want)


def _fit(rng, **kw):
    k = rng.standard_normal((L, HKV, 300, D)).astype(np.float32)
    v = rng.standard_normal((L, HKV, 300, D)).astype(np.float32)
    kw.setdefault("M", D // 2)
    return fit_kv_codebooks(k, v, nbits=4, key=jax.random.key(0), iters=3, **kw)


def test_pre_rope_codebooks_round_trip_through_a_file(tmp_path):
    inv = rope.rope_inv_freq(D, 500000.0)
    books = _fit(np.random.default_rng(1), rope_inv_freq=inv)
    assert books.key_rope == "pre" and books.key.dsub == 2 and books.recipe.endswith(" pre")
    path = tmp_path / "pre.safetensors"
    save_kv_codebooks(path, books)
    loaded, meta = load_kv_codebooks(path)
    assert meta["key_rope"] == "pre" and loaded.key_rope == "pre"
    np.testing.assert_array_equal(np.asarray(loaded.rope_inv_freq), inv)
    np.testing.assert_array_equal(np.asarray(loaded.key.centroids), np.asarray(books.key.centroids))
    post = _fit(np.random.default_rng(1))
    save_kv_codebooks(tmp_path / "post.safetensors", post)
    assert load_kv_codebooks(tmp_path / "post.safetensors")[0].key_rope == "post"


def test_pre_rope_file_without_frequencies_is_refused(tmp_path):
    books = _fit(np.random.default_rng(2))
    key, value = books.compact()
    meta = dict(granularity=books.granularity, n_layers=L, stages=1, key_rope="pre")
    save_codebooks(tmp_path / "bad.safetensors", {"key": key, "value": value}, meta)
    with pytest.raises(CodebookFileError, match="lacks the rope_inv_freq tensor"):
        load_kv_codebooks(tmp_path / "bad.safetensors")
    meta["key_rope"] = "sideways"
    save_codebooks(tmp_path / "bad2.safetensors", {"key": key, "value": value}, meta)
    with pytest.raises(CodebookFileError, match="key_rope='sideways'"):
        load_kv_codebooks(tmp_path / "bad2.safetensors")


def test_what_does_not_commute_with_rope_is_refused():
    rng = np.random.default_rng(3)
    inv = rope.rope_inv_freq(D, 10000.0)
    with pytest.raises(ValueError, match="key M must divide head_dim / 2 = 8 per stage.*got 16"):
        _fit(rng, M=16, rope_inv_freq=inv)
    eye = np.broadcast_to(np.eye(D, dtype=np.float32), (L, 1, D, D))
    with pytest.raises(ValueError, match="does not commute with RoPE"):
        _fit(rng, rope_inv_freq=inv, key_transform=eye)
    with pytest.raises(ValueError, match="does not commute with RoPE"):
        _fit(rng, rope_inv_freq=inv).with_transforms(key_transform=eye)
    with pytest.raises(ValueError, match=r"rope_inv_freq must be finite positive float\[8\]"):
        _fit(rng).with_pre_rope_keys(inv[:4])


def test_two_rope_pairs_per_subspace_group_pair_m_with_pair_m_plus_d_over_4(tmp_path):
    """M = d/4: sub-space m is pairs m and m + d/4 (a fast pair with a slow one); keys that live
    only on pairs 1 and 1 + d/4 fill sub-space 1 and leave every other sub-space at zero."""
    rng = np.random.default_rng(6)
    m = D // 4
    k = np.zeros((L, HKV, 300, D), np.float32)
    for pair in (1, 1 + m):  # rotate-half layout: pair i is dims i and i + d/2
        k[..., pair] = rng.standard_normal(k.shape[:-1])
        k[..., pair + D // 2] = rng.standard_normal(k.shape[:-1])
    v = rng.standard_normal(k.shape).astype(np.float32)
    inv = rope.rope_inv_freq(D, 10000.0)
    books = fit_kv_codebooks(k, v, M=m, nbits=4, key=jax.random.key(0), iters=3, rope_inv_freq=inv)
    assert books.key_rope_pairs == 2 and books.key.dsub == 4 and books.recipe.endswith(" pre g2")
    c = np.asarray(books.key.centroids)  # [L, G, M, K, 4]
    assert np.abs(c[:, :, [0, 2, 3]]).max() < 1e-6
    assert (c[:, :, 1].std(axis=-2) > 0.3).all()  # all four dims of sub-space 1 spread
    np.testing.assert_array_equal(np.asarray(books.key_subspace_freqs()),
                                  np.stack([inv[:m], inv[m:]], axis=1))
    save_kv_codebooks(tmp_path / "g2.safetensors", books)
    loaded, _ = load_kv_codebooks(tmp_path / "g2.safetensors")
    assert loaded.key_rope_pairs == 2 and loaded.recipe == books.recipe


def test_residual_stages_commute_and_tile_the_frequencies():
    inv = rope.rope_inv_freq(D, 10000.0)
    books = _fit(np.random.default_rng(4), rope_inv_freq=inv, stages=2)
    assert books.key_M == D and books.key.dsub == 2
    np.testing.assert_array_equal(np.asarray(books.key_subspace_freqs()), np.tile(inv, 2)[:, None])


def test_finetuning_pre_rope_codebooks_is_refused():
    from million_jax.calibration.finetune import finetune_codebooks

    books = _fit(np.random.default_rng(5), rope_inv_freq=rope.rope_inv_freq(D, 10000.0))
    z = np.zeros((L, HKV, 1, 4, D), np.float32)
    with pytest.raises(ValueError, match="not implemented for keys quantized before RoPE"):
        finetune_codebooks(books, z, z[:, :, 0], z[:, :, 0], np.arange(4), window=4, key=jax.random.key(0))


def test_flax_layers_refuse_pre_rope_codebooks():
    """The Flax attention layers apply no RoPE: pre-RoPE codebooks would rotate their keys."""
    from million_jax.flax.pq_layer import select_layer

    books = _fit(np.random.default_rng(6), rope_inv_freq=rope.rope_inv_freq(D, 10000.0))
    with pytest.raises(ValueError, match="keys quantized before RoPE"):
        select_layer(books, 0)
    assert select_layer(_fit(np.random.default_rng(6)), 0)[0].shape == (HKV, D // 2, 16, 2)

"""Codebook fine-tuning on the attention-output error (million_jax.calibration.finetune)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from million_jax.calibration.finetune import (FinetuneSettings, LayerTransforms, attention_output_error,
                                           finetune_codebooks, finetune_layer, layer_errors)
from million_jax.quant.kv_transforms import inverse, inverse_transpose
from million_jax.quant.pq import Codebooks, decode, encode, fit_codebooks
from million_jax.quant.kv_codebooks import PQCodebooks

HKV, G, D, T, W, S = 2, 2, 8, 32, 6, 8
M, NBITS = 4, 4
FAST = FinetuneSettings(steps=60, learning_rate=1e-2, windows_per_step=3)


def make_data(seed: int = 0, layers: int | None = None):
    """Random q, k, v with uneven channel scales (so that attention is not uniform)."""
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    scale = np.array([3, 1, 1, .5, 2, 1, 1, 1], np.float32)
    k = (rng.normal(size=lead + (HKV, W * T, D)) * scale).astype(np.float32)
    v = rng.normal(size=lead + (HKV, W * T, D)).astype(np.float32)
    q = (1.5 * rng.normal(size=lead + (HKV, G, W * S, D))).astype(np.float32)
    pos = np.concatenate([w * T + np.sort(rng.choice(T, S, replace=False)) for w in range(W)]).astype(np.int32)
    return q, k, v, pos


def kmeans_books(k, v, seed: int = 0):
    kb = fit_codebooks(k, M, NBITS, key=jax.random.PRNGKey(seed), iters=8).centroids
    vb = fit_codebooks(v, M, NBITS, key=jax.random.PRNGKey(seed + 1), iters=8).centroids
    return np.asarray(kb), np.asarray(vb)


@pytest.fixture(scope="module")
def layer():
    q, k, v, pos = make_data()
    kb, vb = kmeans_books(k, v)
    return kb, vb, q, k, v, pos


@pytest.fixture(scope="module")
def tuned(layer):
    kb, vb, q, k, v, pos = layer
    return finetune_layer(kb, vb, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(0))


def reference_error(kb, vb, q, k, v, pos, a=None, b=None):
    """Per-head relative attention-output error written with numpy, pq.encode / decode."""
    errs = []
    for h in range(HKV):
        kt = k[h] if a is None else k[h] @ a[h].T
        vt = v[h] if b is None else v[h] @ b[h].T
        k_hat = np.asarray(decode(_books(kb[h]), encode(_books(kb[h]), kt)))
        v_hat = np.asarray(decode(_books(vb[h]), encode(_books(vb[h]), vt)))
        if a is not None:
            k_hat = k_hat @ np.linalg.inv(a[h]).T
        if b is not None:
            v_hat = v_hat @ np.linalg.inv(b[h]).T
        num = den = 0.0
        for g in range(G):
            for i, p in enumerate(pos):
                lo = (p // T) * T
                ks, vs, kh, vh = k[h, lo:p + 1], v[h, lo:p + 1], k_hat[lo:p + 1], v_hat[lo:p + 1]
                qq = q[h, g, i].astype(np.float64)

                def att(kk, vv):
                    s = kk @ qq / np.sqrt(D)
                    e = np.exp(s - s.max())
                    return (e / e.sum()) @ vv

                o = att(ks, vs)
                num += np.sum((att(kh, vh) - o) ** 2)
                den += np.sum(o ** 2)
        errs.append(num / den)
    return np.array(errs)


def _books(c):
    return Codebooks(np.asarray(c))


def test_error_matches_a_reference_written_with_encode_decode(layer):
    kb, vb, q, k, v, pos = layer
    got = attention_output_error(kb, vb, q, k, v, pos, window=T)
    np.testing.assert_allclose(got, reference_error(kb, vb, q, k, v, pos), rtol=2e-3)


def test_finetuning_lowers_the_error_of_the_kmeans_codebooks(layer, tuned):
    kb, vb, q, k, v, pos = layer
    before = attention_output_error(kb, vb, q, k, v, pos, window=T)
    np.testing.assert_allclose(tuned.error_before, before, rtol=1e-5)
    after = attention_output_error(tuned.key_centroids, tuned.value_centroids, q, k, v, pos, window=T)
    np.testing.assert_allclose(tuned.error_after, after, rtol=1e-4)
    assert tuned.kept.all()
    assert (after < 0.85 * before).all(), (before, after)
    assert tuned.loss_history[-10:].mean() < tuned.loss_history[:5].mean()


def test_reassigning_codes_also_lowers_the_error(layer):
    kb, vb, q, k, v, pos = layer
    s = FinetuneSettings(steps=60, learning_rate=1e-2, windows_per_step=3, reassign_every=10)
    r = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=s, key=jax.random.PRNGKey(0))
    assert (r.error_after < 0.85 * r.error_before).all(), (r.error_before, r.error_after)


def test_result_keeps_shapes_and_dtypes(layer, tuned):
    kb, vb = layer[:2]
    assert tuned.key_centroids.shape == kb.shape and tuned.value_centroids.shape == vb.shape
    assert tuned.key_centroids.dtype == np.float32 and tuned.value_centroids.dtype == np.float32
    assert tuned.error_before.shape == tuned.error_after.shape == (HKV,)
    assert tuned.loss_history.shape == (FAST.steps,)
    assert np.isfinite(tuned.key_centroids).all() and np.isfinite(tuned.value_centroids).all()
    assert not np.allclose(tuned.key_centroids, kb) and not np.allclose(tuned.value_centroids, vb)


def test_deterministic_per_key(layer, tuned):
    kb, vb, q, k, v, pos = layer
    again = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(again.key_centroids, tuned.key_centroids)
    np.testing.assert_array_equal(again.value_centroids, tuned.value_centroids)
    other = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(1))
    assert not np.array_equal(other.value_centroids, tuned.value_centroids)


def test_keep_best_returns_kmeans_where_tuning_made_it_worse(layer):
    kb, vb, q, k, v, pos = layer
    wild = FinetuneSettings(steps=5, learning_rate=5.0, windows_per_step=1)
    r = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=wild, key=jax.random.PRNGKey(0))
    assert not r.kept.any() and (r.tuned_error > r.error_before).all()
    np.testing.assert_array_equal(r.key_centroids, kb)
    np.testing.assert_array_equal(r.value_centroids, vb)
    np.testing.assert_array_equal(r.error_after, r.error_before)


def test_query_aware_and_output_transforms_are_respected(layer):
    """Codebooks fitted on A k / B v: the error reads scores with A^-T q and maps outputs by B^-1."""
    _, _, q, k, v, pos = layer
    rng = np.random.default_rng(3)
    a = (np.eye(D) + 0.3 * rng.normal(size=(HKV, D, D))).astype(np.float32)
    b = (np.eye(D) + 0.3 * rng.normal(size=(HKV, D, D))).astype(np.float32)
    kt = np.einsum("hij,hnj->hni", a, k)
    vt = np.einsum("hij,hnj->hni", b, v)
    kb, vb = kmeans_books(kt, vt)
    tr = LayerTransforms(a, inverse_transpose(a), b, inverse(b))
    got = attention_output_error(kb, vb, q, k, v, pos, window=T, transforms=tr)
    np.testing.assert_allclose(got, reference_error(kb, vb, q, k, v, pos, a, b), rtol=2e-3)
    plain = attention_output_error(kb, vb, q, k, v, pos, window=T)
    assert not np.allclose(plain, got)  # the transforms change what is measured
    r = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(0), transforms=tr)
    assert (r.error_after < 0.9 * got).all(), (got, r.error_after)


def test_one_codebook_shared_by_the_heads(layer):
    _, _, q, k, v, pos = layer
    kb, vb = kmeans_books(k.reshape(1, -1, D), v.reshape(1, -1, D))  # [1, M, K, dsub]
    r = finetune_layer(kb, vb, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(0))
    assert r.key_centroids.shape == kb.shape and r.kept.shape == (1,)
    assert r.error_after.sum() < 0.9 * r.error_before.sum()


def test_model_codebooks_per_layer_keep_granularity_and_transforms():
    q, k, v, pos = make_data(1, layers=2)
    kb = np.stack([kmeans_books(k[i], v[i])[0] for i in range(2)])
    vb = np.stack([kmeans_books(k[i], v[i])[1] for i in range(2)])
    books = PQCodebooks.from_centroids(kb, vb, "layer_head")
    tuned, reports = finetune_codebooks(books, q, k, v, pos, window=T, settings=FAST, key=jax.random.PRNGKey(0))
    assert len(reports) == 2 and tuned.granularity == "layer_head"
    assert tuned.key.centroids.shape == books.key.centroids.shape
    before, after = layer_errors(books, q, k, v, pos, window=T), layer_errors(tuned, q, k, v, pos, window=T)
    np.testing.assert_allclose(after, np.stack([r.error_after for r in reports]), rtol=1e-4)
    assert (after.sum(1) < before.sum(1)).all()
    shared = PQCodebooks.from_centroids(kb[0, 0], vb[0, 0], "shared", num_layers=2)
    with pytest.raises(ValueError, match="shared codebooks"):
        finetune_codebooks(shared, q, k, v, pos, window=T, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "k": np.where(np.arange(D) == 3, np.nan, a["k"]).astype(np.float32)}, "k contains .* NaN"),
    (lambda a: {**a, "q": a["q"][..., :4]}, "disagree on Hkv or d"),
    (lambda a: {**a, "k": a["k"][:, :0], "v": a["v"][:, :0]}, "empty calibration data"),
    (lambda a: {**a, "window": 30}, "whole number of windows"),
    (lambda a: {**a, "q_pos": a["q_pos"][::-1].copy()}, "then of window 1"),
    (lambda a: {**a, "q_pos": a["q_pos"].astype(np.float32)}, "q_pos must be int"),
    (lambda a: {**a, "key_centroids": a["key_centroids"][:, :2]}, "head_dim"),
    (lambda a: {**a, "v": a["v"].astype(np.int32)}, "floating-point"),
    (lambda a: {**a, "transforms": LayerTransforms(key=np.eye(D, dtype=np.float32)[None])}, "give both"),
])
def test_bad_inputs_raise_clear_errors(layer, change, match):
    kb, vb, q, k, v, pos = layer
    args = dict(key_centroids=kb, value_centroids=vb, q=q, k=k, v=v, q_pos=pos, window=T, transforms=None)
    a = change(args)
    with pytest.raises(ValueError, match=match):
        finetune_layer(a["key_centroids"], a["value_centroids"], a["q"], a["k"], a["v"], a["q_pos"],
                       window=a["window"], settings=FAST, key=jax.random.PRNGKey(0), transforms=a["transforms"])


@pytest.mark.parametrize("settings, match", [
    (dict(steps=-1), "steps"),
    (dict(learning_rate=float("nan")), "learning_rate"),
    (dict(windows_per_step=0), "windows_per_step"),
    (dict(tune_keys=False, tune_values=False), "nothing to tune"),
])
def test_bad_settings_raise_when_made(settings, match):
    """Refused at construction, before any fine-tuning work."""
    with pytest.raises(ValueError, match=match):
        FinetuneSettings(**settings)

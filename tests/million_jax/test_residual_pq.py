"""Residual (multi-stage) PQ: encoding, fitting, the cache's attention, files and clear errors.

Every check compares against an independent numpy reference on fresh random inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax.cache.pq_cache import PQCache
from million_jax.calibration.fit import fit_kv_codebooks
from million_jax.quant.codebook_io import CodebookFileError, load_kv_codebooks, save_kv_codebooks
from million_jax.flax.pq_layer import select_layer
from million_jax.quant.pq import Codebooks, fit_codebooks
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.residual_pq import decode_stages, encode_stages, fit_stages

B, T, H, HKV, D = 2, 7, 4, 2, 8


def _np_stages(c: np.ndarray, x: np.ndarray, stages: int) -> tuple[np.ndarray, np.ndarray]:
    """c [S*M, K, dsub], x [N, d] -> (codes [N, S*M], reconstruction [N, d]), stage by stage."""
    m = c.shape[0] // stages
    ds = c.shape[-1]
    residual = x.astype(np.float64)
    recon = np.zeros_like(residual)
    codes = []
    for s in range(stages):
        cs = c[s * m:(s + 1) * m].astype(np.float64)
        idx = ((residual.reshape(len(x), m, 1, ds) - cs[None]) ** 2).sum(-1).argmin(-1)  # [N, M]
        part = cs[np.arange(m)[None], idx].reshape(len(x), -1)
        residual, recon = residual - part, recon + part
        codes.append(idx)
    return np.concatenate(codes, -1), recon


def _books(rng, m, nbits, stages, transforms, granularity="layer_head"):
    kc = rng.normal(size=(1, HKV, stages * m, 2**nbits, D // m)).astype(np.float32)
    vc = rng.normal(size=(1, HKV, stages * m, 2**nbits, D // m)).astype(np.float32)
    for c in (kc, vc):  # later stages describe residuals: smaller centroids
        for s in range(1, stages):
            c[:, :, s * m:(s + 1) * m] *= 0.4**s
    books = PQCodebooks.from_centroids(kc, vc, granularity, stages=stages)
    if not transforms:
        return books
    a = np.eye(D) + 0.3 * rng.normal(size=(1, HKV, D, D))
    b = np.eye(D) + 0.3 * rng.normal(size=(1, HKV, D, D))
    return books.with_transforms(a.astype(np.float32), b.astype(np.float32))


def _np_reference(books: PQCodebooks, q, k, v):
    """Causal attention with every key / value reconstructed from residual PQ (numpy, float64)."""
    grp, s = H // HKV, books.stages
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for hk in range(HKV):
            a = np.eye(D) if books.key_transform is None else np.asarray(books.key_transform[0, hk], np.float64)
            bm = np.eye(D) if books.value_transform is None else np.asarray(books.value_transform[0, hk], np.float64)
            _, khat = _np_stages(np.asarray(books.key.centroids[0, hk]), k[b, :, hk] @ a.T, s)
            _, vhat = _np_stages(np.asarray(books.value.centroids[0, hk]), v[b, :, hk] @ bm.T, s)
            vhat = vhat @ np.linalg.inv(bm).T
            for g in range(grp):
                h = hk * grp + g
                sc = (q[b, :, h] @ np.linalg.inv(a)) @ khat.T / np.sqrt(D)
                sc = np.where(np.tril(np.ones((T, T), bool)), sc, -np.inf)
                p = np.exp(sc - sc.max(-1, keepdims=True))
                out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ vhat
    return out


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_encode_decode_stages_match_numpy(stages):
    rng = np.random.default_rng(stages)
    m, k = 4, 16
    c = rng.normal(size=(HKV, stages * m, k, D // m)).astype(np.float32)
    x = rng.normal(size=(HKV, 50, D)).astype(np.float32)
    codes = np.asarray(encode_stages(Codebooks(jnp.asarray(c)), jnp.asarray(x), stages))
    recon = np.asarray(decode_stages(Codebooks(jnp.asarray(c)), jnp.asarray(codes), stages))
    assert codes.shape == (HKV, 50, stages * m)
    for g in range(HKV):
        want_codes, want_recon = _np_stages(c[g], x[g], stages)
        np.testing.assert_array_equal(codes[g], want_codes)
        np.testing.assert_allclose(recon[g], want_recon, rtol=1e-5, atol=1e-5)


def test_fit_stages_first_stage_is_plain_pq_and_second_reduces_error():
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(D, D)).astype(np.float32)
    x = (rng.normal(size=(2, 2048, D)) @ mix).astype(np.float32)  # correlated dims
    key = jax.random.PRNGKey(3)
    books = fit_stages(x, 2, 6, 2, key=key, iters=6)
    assert books.centroids.shape == (2, 4, 64, 4)
    plain = fit_codebooks(x, 2, 6, key=key, iters=6)
    np.testing.assert_allclose(np.asarray(books.centroids[:, :2]), np.asarray(plain.centroids), rtol=1e-6)

    def err(cb, s):
        recon = decode_stages(cb, encode_stages(cb, jnp.asarray(x), s), s)
        return float(jnp.sum((jnp.asarray(x) - recon) ** 2) / jnp.sum(jnp.asarray(x) ** 2))

    one, two = err(plain, 1), err(books, 2)
    assert two < 0.6 * one, (one, two)


@pytest.mark.parametrize("stages,transforms,pack", [(2, False, True), (2, True, False), (3, True, True)])
def test_residual_cache_matches_numpy_reference(stages, transforms, pack):
    rng = np.random.default_rng(10 * stages + transforms)
    books = _books(rng, 2, 4, stages, transforms)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, HKV, HKV))
    ref = _np_reference(books, q, k, v)
    cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl="xla", pack=pack)
    assert cache.layers.budgets == (2 * stages, 4, 2 * stages, 4, stages, None)  # no key parts
    layer = jax.tree.map(lambda x: x[0], cache.layers)
    per_layer = jax.tree.map(lambda x: x[0], books)
    out, _ = layer.append(per_layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                          jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_residual_decode_step_matches_reference(impl):
    """Prefill T-1 tokens, then one decode step read from stored codes (the kernel for 'pallas')."""
    rng = np.random.default_rng(5)
    books = _books(rng, 2, 4, 2, True)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, HKV, HKV))
    ref = _np_reference(books, q, k, v)
    cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl=impl, pack=False)
    layer = jax.tree.map(lambda x: x[0], cache.layers)
    per_layer = jax.tree.map(lambda x: x[0], books)
    one = jnp.full((B,), 1, jnp.int32)
    _, layer = layer.append(per_layer, jnp.asarray(q[:, :-1]), jnp.asarray(k[:, :-1]), jnp.asarray(v[:, :-1]),
                            jnp.zeros((B,), jnp.int32), one * (T - 1))
    out, _ = layer.append(per_layer, jnp.asarray(q[:, -1:]), jnp.asarray(k[:, -1:]), jnp.asarray(v[:, -1:]),
                          one * (T - 1), one)
    tol = 2e-4 if impl == "xla" else 2e-2  # the kernel's dots take bf16 operands (impl='pallas' raises
    np.testing.assert_allclose(np.asarray(out[:, 0]), ref[:, -1], rtol=tol, atol=tol)  # if it cannot run)


def test_fit_kv_codebooks_stages_and_file_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    k = rng.normal(size=(2, HKV, 600, D)).astype(np.float32)
    v = rng.normal(size=(2, HKV, 600, D)).astype(np.float32)
    books = fit_kv_codebooks(k, v, M=2, nbits=4, key=jax.random.PRNGKey(0), iters=3, stages=2, max_vectors=256)
    assert (books.stages, books.key_M, books.head_dim, books.bits_per_element) == (2, 4, D, 2.0)
    assert books.recipe == "K4x4 V4x4 r2"
    path = tmp_path / "r2.safetensors"
    save_kv_codebooks(path, books)
    back, meta = load_kv_codebooks(path)
    assert back.stages == 2 and meta["stages"] == 2
    np.testing.assert_array_equal(np.asarray(back.key.centroids), np.asarray(books.key.centroids))
    # a cache made for plain codebooks of the same code count refuses residual ones (and back)
    plain = PQCache.create(2, 1, HKV, 8, D, M=4, nbits=4)
    with pytest.raises(ValueError, match="stages"):
        plain.layer_consts(books)
    with pytest.raises(ValueError, match="stages"):
        fit_kv_codebooks(k, v, M=2, nbits=4, key=jax.random.PRNGKey(0), iters=1, stages=0)


def test_bad_stages_are_clear_errors(tmp_path):
    rng = np.random.default_rng(2)
    kc = rng.normal(size=(1, HKV, 3, 16, 2)).astype(np.float32)  # 3 sub-spaces: not 2 equal stages
    with pytest.raises(ValueError, match="key codebooks: a codebook of 3 sub-spaces cannot hold 2"):
        PQCodebooks.from_centroids(kc, kc, "layer_head", stages=2)
    books = _books(rng, 2, 4, 2, False)
    path = tmp_path / "r2.safetensors"
    save_kv_codebooks(path, books, {"note": "x"})
    # a file whose metadata names a stage count its codebooks cannot hold
    from safetensors import safe_open
    from safetensors.numpy import save_file
    import json
    with safe_open(str(path), "np") as f:
        header = json.loads(f.metadata()["million_jax"])
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    header["user"]["stages"] = 3
    save_file(tensors, str(path), metadata={"million_jax": json.dumps(header)})
    with pytest.raises(CodebookFileError, match="stages"):
        load_kv_codebooks(path)


def test_flax_layers_refuse_codebooks_they_would_misread():
    rng = np.random.default_rng(3)
    for books, what in ((_books(rng, 2, 4, 2, False), "2 residual stages"), (_books(rng, 2, 4, 1, True), "key_transform")):
        with pytest.raises(ValueError, match=what):
            select_layer(books, 0)
    plain = _books(rng, 2, 4, 1, False)
    assert select_layer(plain, 0)[0].shape == (HKV, 2, 16, 4)

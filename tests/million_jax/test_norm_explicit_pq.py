"""Norm-explicit PQ: a float16 scale |x| / |x_hat| per token beside the codes, read by every path.

The cache's stored scales are checked against a numpy reference (within one float16 step), and its
attention against exact numpy attention over the reconstructions rescaled by those stored scales,
on fresh random inputs: residual stages, key / value transforms, pre-RoPE keys, packed and
unpacked codes, the xla path and the Pallas kernel (interpret mode), prefill and decode steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import rope
from million_jax.cache.pq_cache import PQCache, norm_scale
from million_jax.flax.pq_layer import select_layer
from million_jax.quant.codebook_io import CodebookFileError, load_kv_codebooks, save_kv_codebooks
from million_jax.quant.kv_codebooks import PQCodebooks
from test_residual_pq import _np_stages

B, T, H, HKV, D = 2, 9, 4, 2, 8


def _books(rng, stages=1, transforms=False, pre_rope=False, keys=True, values=True, d=D, unit=False):
    m = d // 2
    kc = rng.normal(size=(1, HKV, stages * m, 16, 2)).astype(np.float32)
    vc = rng.normal(size=(1, HKV, stages * m, 16, 2)).astype(np.float32)
    for c in (kc, vc):
        for s in range(1, stages):
            c[:, :, s * m:(s + 1) * m] *= 0.4**s
    books = PQCodebooks.from_centroids(kc, vc, "layer_head", stages=stages)
    if transforms:
        a = np.eye(d) + 0.3 * rng.normal(size=(1, HKV, d, d))
        b = np.eye(d) + 0.3 * rng.normal(size=(1, HKV, d, d))
        books = books.with_transforms(None if pre_rope else a.astype(np.float32), b.astype(np.float32))
    if pre_rope:
        books = books.with_pre_rope_keys(rope.rope_inv_freq(d, 50.0))
    return books.with_explicit_norms(keys, values, unit)


def _reconstruct(books: PQCodebooks, k, v):
    """(k_hat, v_hat) float64[B, T, Hkv, d] in the model's space (post-RoPE keys), and the
    reference scales |x| / |x_hat| float64[B, T, Hkv]. Unit codes: the sides with norms are
    encoded as x / |x|."""
    unit_k = books.unit_codes and books.key_norms
    unit_v = books.unit_codes and books.value_norms
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    s, d = books.stages, books.head_dim
    pos = np.arange(T)
    k_hat, v_hat = np.zeros(k.shape), np.zeros(v.shape)
    for b in range(B):
        for hk in range(HKV):
            kk = k[b, :, hk].astype(np.float64)
            if books.key_rope == "pre":
                cos, sin = rope.rope_cos_sin(pos, np.asarray(books.rope_inv_freq))
                kk = np.asarray(rope.to_pair_layout(rope.unrotate(jnp.asarray(k[b, :, hk][None]),
                                                                  cos[None], sin[None])))[0].astype(np.float64)
            order = None if books.key_pair_order is None else np.asarray(books.key_pair_order[0, hk])
            if order is not None:  # sub-space s codes pair order[s]
                kk = kk.reshape(T, -1, 2)[:, order].reshape(T, -1)
            a = np.eye(d) if books.key_transform is None else np.asarray(books.key_transform[0, hk], np.float64)
            bm = np.eye(d) if books.value_transform is None else np.asarray(books.value_transform[0, hk], np.float64)
            _, kh = _np_stages(np.asarray(books.key.centroids[0, hk]), (norm(kk) if unit_k else kk) @ a.T, s)
            kh = kh @ np.linalg.inv(a).T
            if order is not None:  # back to the natural pair order
                nat = np.empty((T, d // 2, 2))
                nat[:, order] = kh.reshape(T, -1, 2)
                kh = nat.reshape(T, d)
            if books.key_rope == "pre":
                kh = np.asarray(rope.rotate(jnp.asarray(rope.from_pair_layout(jnp.asarray(kh[None], jnp.float32))),
                                            cos[None], sin[None]))[0]
            vv = v[b, :, hk].astype(np.float64)
            _, vh = _np_stages(np.asarray(books.value.centroids[0, hk]), (norm(vv) if unit_v else vv) @ bm.T, s)
            k_hat[b, :, hk], v_hat[b, :, hk] = kh, vh @ np.linalg.inv(bm).T
    ratio = lambda x, xh: np.linalg.norm(x, axis=-1) / np.linalg.norm(xh, axis=-1)  # noqa: E731
    return k_hat, v_hat, ratio(k, k_hat), ratio(v, v_hat)


def _attention(q, k_hat, v_hat):
    """Causal attention float64[B, T, H, d] of q over every (rescaled) reconstruction."""
    grp = H // HKV
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(H):
            sc = q[b, :, h] @ k_hat[b, :, h // grp].T / np.sqrt(q.shape[-1])
            sc = np.where(np.tril(np.ones((T, T), bool)), sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v_hat[b, :, h // grp]
    return out


def _inputs(rng, d=D):
    return (rng.normal(size=(B, T, n, d)).astype(np.float32) for n in (H, HKV, HKV))


def _check(books, cache, q, k, v, outs, tol):
    """The stored scales against the reference ratios; each output against exact attention over
    the reconstructions rescaled by the stored scales."""
    k_hat, v_hat, k_ratio, v_ratio = _reconstruct(books, k, v)
    lay = cache.layers
    for on, stored, ratio, x_hat in ((books.key_norms, lay.k_scales, k_ratio, k_hat),
                                     (books.value_norms, lay.v_scales, v_ratio, v_hat)):
        if not on:
            assert stored is None
            continue
        assert stored.dtype == jnp.float16 and stored.shape == (1, B, HKV, T, 1)
        got = np.asarray(stored[0, ..., 0], np.float64)  # [B, Hkv, T]
        np.testing.assert_allclose(got, np.swapaxes(ratio, 1, 2), rtol=2**-10)  # one float16 step (bf16 would be 2**-7)
        x_hat *= np.swapaxes(got, 1, 2)[..., None]
    for t0, out in outs:
        np.testing.assert_allclose(np.asarray(out), _attention(q, k_hat, v_hat)[:, t0:t0 + out.shape[1]],
                                   rtol=tol, atol=tol)


def _run(books, cache, q, k, v, prefill):
    """Prefill ``prefill`` tokens, then decode the rest one by one: [(first token, out)], cache."""
    layer = jax.tree.map(lambda x: x[0], cache.layers)
    per_layer = jax.tree.map(lambda x: x[0], books)
    step = jax.jit(lambda lay, q, k, v, n0, n: lay.append(per_layer, q, k, v, n0, n))
    outs, t0 = [], 0
    for t1 in [prefill] + list(range(prefill + 1, T + 1)):
        n0, n = jnp.full((B,), t0, jnp.int32), jnp.full((B,), t1 - t0, jnp.int32)
        out, layer = step(layer, *(jnp.asarray(x[:, t0:t1]) for x in (q, k, v)), n0, n)
        outs.append((t0, out))
        t0 = t1
    return outs, cache.__class__(layers=jax.tree.map(lambda x: x[None], layer), lengths=cache.lengths + T)


@pytest.mark.parametrize("stages,transforms,pre_rope,pack,impl,d,unit", [
    (1, False, False, True, "xla", D, False),
    (2, True, False, False, "xla", D, False),
    (1, True, True, True, "xla", D, False),
    (2, True, False, True, "xla", D, True),
    (1, False, True, True, "xla", D, True),
    (1, False, False, True, "pallas", D, False),
    (2, False, False, False, "pallas", D, True),  # transforms sit outside the kernel (the xla rows cover them)
    (1, False, True, True, "pallas", 32, False),  # the kernel's pre-RoPE path wants M = d / 2 >= 16
])
def test_norm_explicit_cache_matches_reference(stages, transforms, pre_rope, pack, impl, d, unit):
    rng = np.random.default_rng(100 * stages + 10 * transforms + pre_rope + 7 * unit)
    books = _books(rng, stages, transforms, pre_rope, d=d, unit=unit)
    q, k, v = _inputs(rng, d)
    cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl=impl, pack=pack)
    outs, cache = _run(books, cache, q, k, v, prefill=4)
    _check(books, cache, q, k, v, outs, 2e-4 if impl == "xla" else 2e-2)  # the kernel's dots are bf16


@pytest.mark.parametrize("keys,values", [(True, False), (False, True)])
def test_keys_or_values_alone(keys, values):
    rng = np.random.default_rng(3 + keys)
    books = _books(rng, keys=keys, values=values)
    q, k, v = _inputs(rng)
    cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl="xla")
    bits = cache.bits_per_element
    assert (bits.key, bits.value) == (2 + 16 * keys / D, 2 + 16 * values / D)  # 4 x 4-bit codes per 8 dims
    assert books.bits_per_element == pytest.approx((bits.key + bits.value) / 2)
    outs, cache = _run(books, cache, q, k, v, prefill=T - 1)
    _check(books, cache, q, k, v, outs, 2e-4)


def test_norms_change_the_answer():
    """The scales are not a no-op: the same codes read without them give another output."""
    rng = np.random.default_rng(11)
    books = _books(rng)
    q, k, v = _inputs(rng)
    outs = {}
    for name, b in (("norms", books), ("plain", books.with_explicit_norms(False, False))):
        cache = PQCache.for_codebooks(b, B, HKV, T, quantize_all=True, impl="xla")
        outs[name] = np.asarray(_run(b, cache, q, k, v, prefill=T)[0][0][1])
    assert np.abs(outs["norms"] - outs["plain"]).max() > 1e-2


def test_norm_scale_rounding_zero_and_overflow():
    """The stored scale is |x| / |x_hat| to within one float16 rounding (8x finer than bf16's, on
    fresh random vectors of norms 1e-3..1e3), 1 for a zero reconstruction, and a norm beyond
    float16's range is clipped to its largest finite value, never inf."""
    rng = np.random.default_rng(12)
    x = rng.normal(size=(4096, 16)) * 10.0 ** rng.uniform(-3, 3, size=(4096, 1))
    x_hat = x + 0.3 * rng.normal(size=x.shape) * np.linalg.norm(x, axis=-1, keepdims=True) / 4
    want = np.linalg.norm(x, axis=-1) / np.linalg.norm(x_hat, axis=-1)
    got = np.asarray(norm_scale(jnp.asarray(x, jnp.float32), jnp.asarray(x_hat, jnp.float32)), np.float64)[:, 0]
    rel = np.abs(got / want - 1)
    assert rel.max() <= 2.0**-11 * 1.01 and rel.max() > 0  # round to nearest: half a step of 2**-10
    bf16 = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
    assert np.abs(bf16 / want - 1).mean() > 4 * rel.mean()
    special = norm_scale(jnp.asarray([[3.0, 4.0], [1e6, 0.0]], jnp.float32),
                         jnp.asarray([[0.0, 0.0], [1.0, 0.0]], jnp.float32))
    assert special.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(special, np.float64)[:, 0], [1.0, float(np.finfo(np.float16).max)])


def test_file_roundtrip_and_mismatches(tmp_path):
    rng = np.random.default_rng(5)
    books = _books(rng, stages=2, transforms=True, keys=True, values=False)
    path = tmp_path / "ne.safetensors"
    for b in (books, books.with_explicit_norms(False, True, True)):
        save_kv_codebooks(path, b)
        loaded, meta = load_kv_codebooks(path)
        assert (loaded.key_norms, loaded.value_norms, loaded.unit_codes) == (b.key_norms, b.value_norms,
                                                                             b.unit_codes)
        assert loaded.recipe == b.recipe
    assert books.recipe.endswith(" nk") and books.with_explicit_norms(True, True, True).recipe.endswith(" nkvu")
    with pytest.raises(ValueError, match="unit codes need the norms stored"):
        books.with_explicit_norms(False, False, True)
    # the cache made for other codebooks is refused, both ways, with the field named
    plain = PQCache.for_codebooks(books.with_explicit_norms(False, False), B, HKV, T)
    with pytest.raises(ValueError, match="explicit key norms.*k_scales"):
        plain.layer_consts(books)
    normed = PQCache.for_codebooks(books, B, HKV, T)
    with pytest.raises(ValueError, match="no explicit key norms.*holds k_scales"):
        normed.layer_consts(books.with_explicit_norms(False, False))
    with pytest.raises(ValueError, match="must be a bool"):
        books.with_explicit_norms("yes", False)
    with pytest.raises(ValueError, match="Flax PQ layers take plain codebooks.*explicit per-token norms"):
        select_layer(books.with_explicit_norms(True, True), 0)


def test_corrupt_norm_metadata_is_a_clear_error(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    rng = np.random.default_rng(6)
    path = tmp_path / "ne.safetensors"
    save_kv_codebooks(path, _books(rng))
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    inner = json.loads(meta["million_jax"])
    inner["user"]["value_norms"] = "maybe"
    save_file(load_file(str(path)), str(path), {**meta, "million_jax": json.dumps(inner)})
    with pytest.raises(CodebookFileError, match="value_norms='maybe'"):
        load_kv_codebooks(path)

"""Key codes of several widths (``PQCodebooks.key_parts``): stored at each part's width, read by
every path.

Fresh random codebooks whose narrower key sub-spaces are padded with copies of their centroid 0;
the stored codes are checked against a numpy argmin over each sub-space's own first 2**bits
centroids, and the cache's attention against exact numpy attention over those reconstructions
(xla path, the Pallas kernel in interpret mode, pre- and post-RoPE keys, norms, prefill and decode).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import rope
from million_jax.cache.pq_cache import PQCache
from million_jax.quant.codebook_io import CodebookFileError, load_kv_codebooks, save_kv_codebooks
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.pq import Codebooks
from pallas_kernels.code_packing import parts_width, unpack_layout
from test_norm_explicit_pq import B, HKV, T, _attention, _inputs, _reconstruct, _run

PARTS = ((3, 3), (2, 5), (3, 4))  # d = 16: 8 key sub-spaces of 2 dims


def _books(rng, parts=PARTS, pre_rope=False, norms=False, d=16, order=False):
    m = d // 2
    widest = max(b for _, b in parts)
    kc = rng.normal(size=(1, HKV, m, 2 ** widest, 2)).astype(np.float32)
    m0 = 0
    for n, b in parts:  # rows past 2**b repeat centroid 0
        kc[:, :, m0:m0 + n, 2 ** b:] = kc[:, :, m0:m0 + n, :1]
        m0 += n
    vc = rng.normal(size=(1, HKV, m, 16, 2)).astype(np.float32)
    books = PQCodebooks.from_centroids(kc, vc, "layer_head")
    if pre_rope:
        books = books.with_pre_rope_keys(rope.rope_inv_freq(d, 50.0))
    if norms:
        books = books.with_explicit_norms(True, True, False)
    if order:  # each KV head codes the RoPE pairs in its own order
        books = books.with_key_pair_order(np.stack([[rng.permutation(m) for _ in range(HKV)]]))
    return books.with_key_parts(parts)


def _truncated_codes(books: PQCodebooks, x: np.ndarray, head: int) -> np.ndarray:
    """codes int[N, M] of x float[N, d] (the encoder's layout) by KV head ``head``'s codebooks, over
    each sub-space's first 2**bits rows."""
    c = np.asarray(books.key.centroids[0], np.float64)  # [G, M, K, 2]
    out, m0 = [], 0
    for n, b in books.key_parts:
        for m in range(m0, m0 + n):
            cm = c[head, m, :2 ** b]
            out.append(((x[:, None, 2 * m:2 * m + 2] - cm[None]) ** 2).sum(-1).argmin(-1))
        m0 += n
    return np.stack(out, -1)


def test_bits_recipe_and_cache_width():
    books = _books(np.random.default_rng(0))
    assert books.key_code_bits == 3 * 3 + 2 * 5 + 3 * 4
    assert books.bits_per_element == pytest.approx((31 + 8 * 4) / 32)
    assert books.recipe.startswith("K3x3+2x5+3x4 V8x4")
    cache = PQCache.for_codebooks(books, B, HKV, T)
    assert cache.layers.k_codes.shape[-1] == parts_width(PARTS) == 4  # 31 bits in one bit stream
    assert cache.bits_per_element.key == pytest.approx(8 * 4 / 16)


@pytest.mark.parametrize("pre_rope,norms,impl,d,order", [
    (False, False, "xla", 16, False),
    (True, True, "xla", 16, False),
    (False, True, "pallas", 16, False),
    (True, False, "pallas", 32, False),  # the kernel's pre-RoPE path wants M = d / 2 >= 16
    (True, True, "xla", 16, True),  # each KV head's pairs in its own order
    (True, True, "pallas", 32, True),
])
def test_cache_matches_reference(pre_rope, norms, impl, d, order):
    rng = np.random.default_rng(10 * pre_rope + norms + d + 100 * order)
    parts = PARTS if d == 16 else ((6, 3), (4, 5), (6, 4))
    books = _books(rng, parts, pre_rope, norms, d, order)
    q, k, v = _inputs(rng, d)
    cache = PQCache.for_codebooks(books, B, HKV, T, quantize_all=True, impl=impl)
    outs, cache = _run(books, cache, q, k, v, prefill=4)
    # stored codes: each within its part's width, and the argmin over its own centroids
    got = np.asarray(unpack_layout(cache.layers.k_codes[0], books.key_parts))  # [B, Hkv, T, M]
    for b in range(B):
        for h in range(HKV):
            kk = k[b, :, h].astype(np.float64)
            if pre_rope:
                cos, sin = rope.rope_cos_sin(np.arange(T), np.asarray(books.rope_inv_freq))
                kk = np.asarray(rope.to_pair_layout(rope.unrotate(jnp.asarray(k[b, :, h][None]), cos[None],
                                                                  sin[None])))[0].astype(np.float64)
            if order:
                kk = kk.reshape(T, -1, 2)[:, np.asarray(books.key_pair_order[0, h])].reshape(T, -1)
            np.testing.assert_array_equal(got[b, h], _truncated_codes(books, kk, h))
    k_hat, v_hat, k_ratio, v_ratio = _reconstruct(books, k, v)
    if norms:
        lay = cache.layers
        k_hat *= np.swapaxes(np.asarray(lay.k_scales[0, ..., 0], np.float64), 1, 2)[..., None]
        v_hat *= np.swapaxes(np.asarray(lay.v_scales[0, ..., 0], np.float64), 1, 2)[..., None]
    tol = 2e-4 if impl == "xla" else 2e-2  # the kernel's dots are bf16
    for t0, out in outs:
        np.testing.assert_allclose(np.asarray(out), _attention(q, k_hat, v_hat)[:, t0:t0 + out.shape[1]],
                                   rtol=tol, atol=tol)


def test_io_roundtrip_and_bad_metadata(tmp_path):
    books = _books(np.random.default_rng(1), pre_rope=True, norms=True)
    path = tmp_path / "parts.safetensors"
    save_kv_codebooks(path, books)
    back, meta = load_kv_codebooks(path)
    assert back.key_parts == PARTS and meta["key_parts"] == [list(p) for p in PARTS]
    np.testing.assert_array_equal(np.asarray(back.key.centroids), np.asarray(books.key.centroids))
    bad = dataclasses.replace(books, key_parts=((3, 3), (2, 5), (2, 4), (1, 4)))
    save_kv_codebooks(path, bad)  # the same widths, cut otherwise: still valid
    assert load_kv_codebooks(path)[0].key_parts == ((3, 3), (2, 5), (2, 4), (1, 4))
    save_kv_codebooks(path, dataclasses.replace(books, key_parts=((4, 3), (1, 5), (3, 4))))
    with pytest.raises(CodebookFileError, match="not copies of centroid 0"):
        load_kv_codebooks(path)


def test_pair_order_roundtrip_and_bad_orders(tmp_path):
    books = _books(np.random.default_rng(6), pre_rope=True, norms=True, order=True)
    assert books.recipe.endswith(" po")
    path = tmp_path / "order.safetensors"
    save_kv_codebooks(path, books)
    back, _ = load_kv_codebooks(path)
    np.testing.assert_array_equal(np.asarray(back.key_pair_order), np.asarray(books.key_pair_order))
    assert back.key_pair_order.dtype == jnp.int32 and back.recipe == books.recipe
    bad = np.asarray(books.key_pair_order).copy()
    bad[0, 1, 0] = bad[0, 1, 1]
    with pytest.raises(ValueError, match=r"key_pair_order\[0, 1\] is not a permutation"):
        books.with_key_pair_order(bad)
    with pytest.raises(ValueError, match="must be int"):
        books.with_key_pair_order(bad[:, :1])
    with pytest.raises(ValueError, match="pre-RoPE keys"):
        _books(np.random.default_rng(7)).with_key_pair_order(np.asarray(books.key_pair_order))
    save_kv_codebooks(path, dataclasses.replace(books, key_pair_order=jnp.asarray(bad)))
    with pytest.raises(CodebookFileError, match="not a permutation"):
        load_kv_codebooks(path)
    # an order put in place without with_key_pair_order is checked where codebooks meet a model
    L, G = books.key.centroids.shape[:2]
    for wrong, match in ((jnp.asarray(bad), "not a permutation"),
                         (jnp.asarray(books.key_pair_order, jnp.float32), "must be int")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(books, key_pair_order=wrong).check(L, G, books.head_dim)
    # 'shared' codebooks keep one layer's centroids in their file: one order for every layer
    shared = dataclasses.replace(books, granularity="shared", key_pair_order=None)
    one = np.broadcast_to(np.asarray(books.key_pair_order)[:1], (L,) + np.shape(books.key_pair_order)[1:])
    assert np.array_equal(np.asarray(shared.with_key_pair_order(one).key_pair_order), one)
    if L > 1 and not (np.asarray(books.key_pair_order) == one).all():
        with pytest.raises(ValueError, match="differs between layers"):
            shared.with_key_pair_order(np.asarray(books.key_pair_order))


def test_bad_layouts_are_named():
    books = _books(np.random.default_rng(2))
    with pytest.raises(ValueError, match="hold 7 codes"):
        books.with_key_parts(((3, 3), (2, 5), (2, 4)))
    with pytest.raises(ValueError, match="widest part has 4 bits"):
        books.with_key_parts(((8, 4),))
    with pytest.raises(ValueError, match="not copies of centroid 0"):
        dataclasses.replace(books, key=Codebooks(books.key.centroids + 1e-3 * jnp.arange(32.0)[:, None])
                            ).with_key_parts(PARTS)
    plain = dataclasses.replace(books, key_parts=None)
    cache = PQCache.for_codebooks(plain, B, HKV, T)
    with pytest.raises(ValueError, match="do not match the cache"):
        cache.layer_consts(books)
    with pytest.raises(ValueError, match="must hold M=8 codes"):
        PQCache.create(1, B, HKV, T, 16, M=8, nbits=5, key_parts=((3, 3), (2, 5)))


def test_encode_parts_equals_encode_on_the_padded_codebooks():
    from million_jax.quant.pq import encode, encode_parts

    books = _books(np.random.default_rng(4))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(HKV, 40, 16)).astype(np.float32))
    cb = Codebooks(books.key.centroids[0])
    got = encode_parts(cb, x, PARTS)
    assert got.dtype == jnp.uint8 and got.shape == (HKV, 40, 8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(encode(cb, x)))
    with pytest.raises(ValueError, match="do not fit M=8"):
        encode_parts(cb, x, ((8, 6),))
    residual = PQCodebooks.from_centroids(np.tile(np.asarray(books.key.centroids), (1, 1, 2, 1, 1)),
                                          np.tile(np.asarray(books.value.centroids), (1, 1, 2, 1, 1)), stages=2)
    with pytest.raises(ValueError, match="for one stage"):
        residual.with_key_parts(((16, 5),))

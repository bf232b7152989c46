"""million_jax.calibration.pair_bits: the greedy allocation is the optimum of a convex separable
cost at the same total width (checked by brute force); padded codebooks encode and decode exactly
as each pair's own codebook of its width (a padded entry is never chosen); the per-pair errors
against a plain numpy reference; ``allocate_key_bits`` keeps the mean width and stores the layout."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import rope
from million_jax.calibration.pair_bits import (allocate_key_bits, greedy_allocation, pad_centroids, pair_key_error,
                                               pair_query_energy, runs, shared_width_allocation, subspace_error,
                                               value_output_energy)
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.pq import Codebooks, decode, encode


@pytest.mark.parametrize("seed", range(4))
def test_greedy_allocation_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    P, n, start = 4, 5, 2
    # error halving (or better) with every width step: convex in the width, as k-means errors are
    scale = rng.lognormal(0.0, 2.0, size=P)
    rate = rng.uniform(1.5, 4.0, size=P)
    err = scale[:, None] * rate[:, None] ** -np.arange(n)[None, :]
    a = greedy_allocation(err, start)
    assert a.sum() == start * P and a.min() >= 0 and a.max() < n
    best = min(sum(err[m, j] for m, j in enumerate(c))
               for c in itertools.product(range(n), repeat=P) if sum(c) == start * P)
    assert np.isclose(err[np.arange(P), a].sum(), best)
    assert err[np.arange(P), a].sum() <= err[:, start].sum()


def test_greedy_allocation_keeps_equal_pairs_uniform():
    err = np.tile(2.0 ** -np.arange(5), (6, 1))
    assert (greedy_allocation(err, 2) == 2).all()


def _convex_errors(rng, shape, n):
    scale = rng.lognormal(0.0, 2.0, size=shape)
    rate = rng.uniform(1.5, 4.0, size=shape)
    return scale[..., None] * rate[..., None] ** -np.arange(n)


def _spent(err, width, perm):
    return err[np.arange(err.shape[0])[:, None], perm, np.asarray(width)[None, :]].sum()


@pytest.mark.parametrize("seed", range(3))
def test_shared_widths_use_each_groups_freedom_to_order_its_pairs(seed):
    rng = np.random.default_rng(seed)
    G, P, n, start = 5, 6, 5, 2
    err = _convex_errors(rng, (G, P), n)
    width, perm = shared_width_allocation(err, start)
    assert (np.sort(perm, axis=1) == np.arange(P)).all()
    assert width.sum() == start * P and (np.diff(width) >= 0).all()
    glob = greedy_allocation(err.sum(0), start)  # one width per pair for every group
    assert _spent(err, width, perm) <= err[:, np.arange(P), glob].sum() * (1 + 1e-12)
    # groups whose errors are one table in different pair orders: each reaches its own optimum
    base = err[0]
    orders = np.stack([rng.permutation(P) for _ in range(G)])
    same = base[orders]  # group g's pair j is base's pair orders[g, j]
    width, perm = shared_width_allocation(same, start)
    alone = base[np.arange(P), greedy_allocation(base, start)].sum()
    assert np.isclose(_spent(same, width, perm), G * alone)
    assert _spent(same, width, perm) < same[:, np.arange(P), greedy_allocation(same.sum(0), start)].sum()


def test_padded_books_encode_as_each_width():
    rng = np.random.default_rng(0)
    L, H, P = 2, 3, 4
    widths = [2, 3, 4]
    centroids = {w: rng.normal(size=(L, H, P, 2 ** w, 2)).astype(np.float32) for w in widths}
    index = rng.integers(0, len(widths), size=(L, H, P))
    padded_all = pad_centroids(centroids, np.asarray(widths)[index])
    assert padded_all.shape == (L, H, P, 16, 2)
    x = jnp.asarray(rng.normal(size=(H, 64, 2 * P)).astype(np.float32))
    for layer in range(L):
        padded = Codebooks(jnp.asarray(padded_all[layer]))
        codes = np.asarray(encode(padded, x))  # [H, 64, P]
        got = np.asarray(decode(padded, jnp.asarray(codes)))
        for h in range(H):
            for m in range(P):
                w = widths[index[layer, h, m]]
                assert codes[h, :, m].max() < 2 ** w  # never a padded entry
                own = Codebooks(jnp.asarray(centroids[w][layer, h, m][None, None]))  # [1, 1, 2^w, 2]
                want = np.asarray(decode(own, encode(own, x[h, :, 2 * m: 2 * m + 2][None])))[0]
                np.testing.assert_array_equal(got[h, :, 2 * m: 2 * m + 2], want)


def test_runs_and_missing_width():
    assert runs([6, 6, 7, 8, 8, 8, 7]) == ((2, 6), (1, 7), (3, 8), (1, 7))
    with pytest.raises(ValueError, match="no centroids of width"):
        pad_centroids({2: np.zeros((1, 1, 3, 4, 2))}, [2, 3, 2])


def _np_pair_error(c, k, norms, unit, pairs=True):
    """numpy reference of pair_key_error (``pairs``: rotate-half dims) / subspace_error for values
    (dims 2m, 2m + 1): c [L, G, P, K, 2], k [L, H, N, d]."""
    L, H, N, d = k.shape
    P = d // 2
    out = np.zeros((L, H, P))
    for layer in range(L):
        for h in range(H):
            x = (np.stack([k[layer, h, :, :P], k[layer, h, :, P:]], -1) if pairs
                 else k[layer, h].reshape(N, P, 2)).astype(np.float64)  # [N, P, 2]
            n = np.linalg.norm(x.reshape(N, -1), axis=-1)
            xin = x / n[:, None, None] if unit else x
            cb = c[layer, h if c.shape[1] > 1 else 0].astype(np.float64)  # [P, K, 2]
            idx = ((xin[:, :, None] - cb[None]) ** 2).sum(-1).argmin(-1)  # [N, P]
            rec = cb[np.arange(P)[None], idx]  # [N, P, 2]
            if norms:
                rec = rec * (n / np.linalg.norm(rec.reshape(N, -1), axis=-1))[:, None, None]
            out[layer, h] = ((x - rec) ** 2).sum(-1).mean(0)
    return out


@pytest.mark.parametrize("norms,unit,groups", [(False, False, 3), (True, False, 1), (True, True, 3)])
def test_pair_key_error_and_query_energy_match_numpy(norms, unit, groups):
    rng = np.random.default_rng(7)
    L, H, N, d = 2, 3, 50, 8
    k = rng.normal(size=(L, H, N, d)).astype(np.float32) * np.linspace(0.5, 3, d)
    c = rng.normal(size=(L, groups, d // 2, 8, 2)).astype(np.float32) * (0.3 if unit else 1.5)
    np.testing.assert_allclose(pair_key_error(c, k, norms=norms, unit=unit), _np_pair_error(c, k, norms, unit),
                               rtol=1e-4)
    np.testing.assert_allclose(subspace_error(c, k, norms=norms, unit=unit, pair_layout=False),
                               _np_pair_error(c, k, norms, unit, pairs=False), rtol=1e-4)
    q = rng.normal(size=(L, H, 40, d))
    gram, count = np.einsum("lhni,lhnj->lhij", q, q), np.full((L, H), 40)
    np.testing.assert_allclose(pair_query_energy(gram, count), (q[..., :d // 2] ** 2 + q[..., d // 2:] ** 2).mean(2))
    with pytest.raises(ValueError, match="no queries"):
        pair_query_energy(gram, np.zeros((L, H)))


def test_allocate_key_bits_keeps_the_mean_and_stores_the_layout():
    rng = np.random.default_rng(3)
    L, H, N, d = 2, 2, 400, 8
    # the slow pairs (high m) carry large keys and strong queries: they should get the bits
    k = (rng.normal(size=(L, H, N, d)) * np.tile(np.linspace(0.2, 2.0, d // 2), 2)).astype(np.float32)
    q = rng.normal(size=(L, H, N, d)) * np.tile(np.linspace(0.2, 2.0, d // 2), 2)
    by_width = {}
    for w in (2, 3, 4):  # crude "codebooks": the first 2**w keys of each pair
        x = np.asarray(rope.to_pair_layout(k, 1)).reshape(L, H, N, d // 2, 2)
        by_width[w] = np.moveaxis(x[:, :, :2 ** w], 2, 3).copy()  # [L, H, P, 2**w, 2]
    values = Codebooks(jnp.asarray(rng.normal(size=(L, H, d // 2, 4, 2)).astype(np.float32)))
    base = PQCodebooks(Codebooks(jnp.asarray(by_width[3])), values).with_pre_rope_keys(rope.rope_inv_freq(d, 100.0))
    books, report = allocate_key_bits(base, {2: by_width[2], 4: by_width[4]}, k,
                                      np.einsum("lhni,lhnj->lhij", q, q), np.full((L, H), N))
    bits = report["key_bits_per_pair"]
    assert sum(bits) == 3 * (d // 2) and bits != [3] * (d // 2)
    assert books.key_parts == runs(bits) and books.key_code_bits == sum(bits)
    assert books.bits_per_element == pytest.approx(base.bits_per_element)
    assert report["score_error_vs_uniform"]["allocation"] < 1.0
    assert books.key.centroids.shape == (L, H, d // 2, 16, 2)
    with pytest.raises(ValueError, match="consecutive"):
        allocate_key_bits(base, {5: by_width[4]}, k, np.einsum("lhni,lhnj->lhij", q, q), np.full((L, H), N))


def test_allocate_key_bits_with_a_pair_order_per_head():
    rng = np.random.default_rng(5)
    L, H, N, d = 2, 3, 300, 8
    P = d // 2
    # each (layer, head) has its own strong pairs
    amp = np.stack([rng.permutation(np.linspace(0.2, 2.0, P)) for _ in range(L * H)]).reshape(L, H, 1, P)
    k = (rng.normal(size=(L, H, N, d)) * np.tile(amp, 2)).astype(np.float32)
    q = rng.normal(size=(L, H, N, d)) * np.tile(amp, 2)
    x = np.asarray(rope.to_pair_layout(k, 1)).reshape(L, H, N, P, 2)
    by_width = {w: np.moveaxis(x[:, :, :2 ** w], 2, 3).copy() for w in (2, 3, 4)}  # [L, H, P, 2**w, 2]
    values = Codebooks(jnp.asarray(rng.normal(size=(L, H, P, 4, 2)).astype(np.float32)))
    base = PQCodebooks(Codebooks(jnp.asarray(by_width[3])), values).with_pre_rope_keys(rope.rope_inv_freq(d, 100.0))
    args = ({2: by_width[2], 4: by_width[4]}, k, np.einsum("lhni,lhnj->lhij", q, q), np.full((L, H), N))
    books, report = allocate_key_bits(base, *args, per_head_order=True)
    _, glob = allocate_key_bits(base, *args)
    bits = report["key_bits_per_subspace"]
    assert sum(bits) == 3 * P and bits == sorted(bits) and books.key_parts == runs(bits)
    assert report["score_error_vs_uniform"]["allocation"] < glob["score_error_vs_uniform"]["allocation"]
    order = np.asarray(books.key_pair_order)
    assert order.shape == (L, H, P) and (np.sort(order, -1) == np.arange(P)).all()
    c = np.asarray(books.key.centroids)
    for layer in range(L):
        for h in range(H):
            for s_, w in enumerate(bits):  # sub-space s holds pair order[s]'s own centroids of its width
                own = by_width[w][layer, h, order[layer, h, s_]]
                np.testing.assert_array_equal(c[layer, h, s_, :2 ** w], own)
                assert (c[layer, h, s_, 2 ** w:] == own[0]).all()
    shared = PQCodebooks(Codebooks(jnp.asarray(by_width[3][:, :1])), Codebooks(values.centroids[:, :1]), "layer"
                         ).with_pre_rope_keys(rope.rope_inv_freq(d, 100.0))
    with pytest.raises(ValueError, match="codebooks per KV head"):
        allocate_key_bits(shared, *args, per_head_order=True)
    everywhere = dataclasses.replace(shared, granularity="shared")
    with pytest.raises(ValueError, match="these are 'shared'"):
        allocate_key_bits(everywhere, *args, per_head_order=True)
    glob_books = allocate_key_bits(base, *args)[0]
    ordered_only = base.with_key_pair_order(np.asarray(books.key_pair_order))  # an order, one width
    for done in (books, glob_books, ordered_only):  # already allocated: its errors are not per natural pair
        with pytest.raises(ValueError, match="one width in the natural pair order"):
            allocate_key_bits(done, *args)


def test_value_output_energy_is_the_output_error_of_isotropic_subspace_errors():
    rng = np.random.default_rng(11)
    L, H, Hkv, d, D = 2, 4, 2, 6, 10
    wo = rng.normal(size=(L, H * d, D))
    w = value_output_energy(wo, H, Hkv)  # [L, Hkv, d/2]
    assert w.shape == (L, Hkv, d // 2)
    for layer in range(L):
        for kv in range(Hkv):
            for m in range(d // 2):  # unit-variance error in sub-space m only, summed over the group's heads
                e = np.zeros((4000, d))
                e[:, 2 * m:2 * m + 2] = rng.normal(size=(4000, 2)) / np.sqrt(2)  # E|e_m|^2 = 1
                heads = range(kv * (H // Hkv), (kv + 1) * (H // Hkv))
                out = sum(((e @ wo[layer, h * d:(h + 1) * d]) ** 2).sum(-1).mean() for h in heads)
                np.testing.assert_allclose(w[layer, kv, m], out, rtol=0.1)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        value_output_energy(wo, 3, 2)

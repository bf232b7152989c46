"""benchmarks/pair_bit_allocation.py: the greedy allocation is the optimum of a convex separable
cost at the same total width (checked by brute force), and padded codebooks encode and decode
exactly as each pair's own codebook of its width (a padded entry is never chosen)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.pair_bit_allocation import greedy_allocation, padded_books
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


def test_padded_books_encode_as_each_width():
    rng = np.random.default_rng(0)
    L, H, P = 2, 3, 4
    widths = [2, 3, 4]
    centroids = {w: rng.normal(size=(L, H, P, 2 ** w, 2)).astype(np.float32) for w in widths}
    index = rng.integers(0, len(widths), size=(L, H, P))
    base = PQCodebooks(key=Codebooks(jnp.asarray(centroids[3])), value=Codebooks(jnp.asarray(centroids[3])))
    books = padded_books(base, centroids, index)
    assert books.key.centroids.shape == (L, H, P, 16, 2)
    x = jnp.asarray(rng.normal(size=(H, 64, 2 * P)).astype(np.float32))
    for layer in range(L):
        padded = Codebooks(books.key.centroids[layer])
        codes = np.asarray(encode(padded, x))  # [H, 64, P]
        got = np.asarray(decode(padded, jnp.asarray(codes)))
        for h in range(H):
            for m in range(P):
                w = widths[index[layer, h, m]]
                assert codes[h, :, m].max() < 2 ** w  # never a padded entry
                own = Codebooks(jnp.asarray(centroids[w][layer, h, m][None, None]))  # [1, 1, 2^w, 2]
                want = np.asarray(decode(own, encode(own, x[h, :, 2 * m: 2 * m + 2][None])))[0]
                np.testing.assert_array_equal(got[h, :, 2 * m: 2 * m + 2], want)

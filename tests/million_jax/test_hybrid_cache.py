"""HybridCache: exact sliding-window rings + a global cache of any kind, against references.

Random q / k / v per layer are fed through the cache protocol (attend inside a layer scan,
write after it) in ragged chunks and single steps; the sliding layers must equal exact
attention with a sliding mask over the whole history, the global layers exactly what their
cache kind gives on its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import CacheShape, CacheSpec, fit_kv_codebooks, make_cache
from million_jax.attention.exact import attention
from million_jax.cache.hybrid import HybridCache, check_layer_kinds

H, HKV, D = 4, 1, 16
PATTERN = (True, False, True, True, False)  # sliding, global, sliding, sliding, global
WINDOW = 5


class Shape(CacheShape):
    """A CacheShape with a sliding pattern (what a Gemma 3 config carries)."""

    @property
    def is_sliding(self):
        return PATTERN

    @property
    def sliding_window(self):
        return WINDOW


SHAPE = Shape(len(PATTERN), HKV, D)


@jax.jit
def _step(cache, consts, q, k, v, n_new):
    def layer(_, xs):
        i, const, q, k, v = xs
        return None, cache.attend(i, const, q, k, v, n_new)

    _, (out, writes) = jax.lax.scan(layer, None, (jnp.arange(cache.num_layers), cache.layer_consts(consts), q, k, v))
    return out, cache.write(writes, n_new)


def _calls(rng, b=2):
    """Ragged chunks then decode steps: (T, n_new[B]) per call."""
    return [(7, np.array([7, 4])), (3, np.array([2, 3])), *[(1, np.array([1, 1]))] * 6]


def _reference(hist_q, hist_k, hist_v, pos_q, pos_kv, sliding):
    """Exact attention of each new query over every stored key of its sequence (per layer)."""
    p, s = pos_q[:, :, None], pos_kv[:, None, :]
    mask = (s >= 0) & (s <= p)
    if sliding:
        mask &= s > p - WINDOW
    return attention(hist_q, hist_k, hist_v, mask)


def test_sliding_layers_equal_masked_attention_and_global_layers_their_own_cache():
    rng = np.random.default_rng(0)
    cache, consts = make_cache(CacheSpec("dense", dtype=jnp.float32), SHAPE, batch=2, max_len=32)
    assert isinstance(cache, HybridCache) and cache.window == WINDOW and cache.num_layers == 5
    L, b = len(PATTERN), 2
    ks = [[[] for _ in range(b)] for _ in range(L)]
    vs = [[[] for _ in range(b)] for _ in range(L)]
    lengths = np.zeros(b, np.int64)
    worst = 0.0
    for t, n_new in _calls(rng):
        q = rng.standard_normal((L, b, t, H, D)).astype(np.float32)
        k = rng.standard_normal((L, b, t, HKV, D)).astype(np.float32)
        v = rng.standard_normal((L, b, t, HKV, D)).astype(np.float32)
        out, cache = _step(cache, consts, q, k, v, jnp.asarray(n_new, jnp.int32))
        for i in range(L):
            for r in range(b):
                ks[i][r].extend(k[i, r, : n_new[r]])
                vs[i][r].extend(v[i, r, : n_new[r]])
        for i in range(L):
            n_max = max(len(ks[i][r]) for r in range(b))
            kk = np.zeros((b, HKV, n_max, D), np.float32)
            vv = np.zeros_like(kk)
            pos_kv = np.full((b, n_max), -1)
            for r in range(b):
                n = len(ks[i][r])
                kk[r, :, :n] = np.stack(ks[i][r], 1)
                vv[r, :, :n] = np.stack(vs[i][r], 1)
                pos_kv[r, :n] = np.arange(n)
            pos_q = lengths[:, None] + np.arange(t)[None, :]
            ref = np.asarray(_reference(q[i], kk, vv, pos_q, pos_kv, PATTERN[i]))
            for r in range(b):
                got = np.asarray(out[i, r, : n_new[r]])
                worst = max(worst, float(np.max(np.abs(got - ref[r, : n_new[r]]))))
        lengths += n_new
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    assert worst < 2e-5, worst


def _books():
    cal = np.random.default_rng(1).standard_normal((2, HKV, 512, D)).astype(np.float32)
    return fit_kv_codebooks(cal, cal, M=8, nbits=4, key=jax.random.PRNGKey(0), iters=2)


@pytest.mark.parametrize("spec", [dict(kind="pq", window=2, sinks=1), dict(kind="uniform", bits=4, group_size=8)],
                         ids=["pq", "uniform"])
def test_global_layers_read_exactly_what_their_cache_kind_gives_alone(spec):
    """The hybrid's global layers give the same outputs and states as a standalone cache of
    the same kind fed the same inputs (the wrapping changes nothing)."""
    if spec["kind"] == "pq":
        spec = dict(spec, codebooks=_books())
    spec = CacheSpec(dtype=jnp.float32, **spec)
    hybrid, consts = make_cache(spec, SHAPE, batch=2, max_len=24)
    alone, consts_alone = make_cache(spec, CacheShape(2, HKV, D), batch=2, max_len=24)
    rng = np.random.default_rng(2)
    glob = np.array([i for i, s in enumerate(PATTERN) if not s])
    for t, n_new in _calls(rng):
        q = rng.standard_normal((5, 2, t, H, D)).astype(np.float32)
        k = rng.standard_normal((5, 2, t, HKV, D)).astype(np.float32)
        n = jnp.asarray(n_new, jnp.int32)
        out_h, hybrid = _step(hybrid, consts, q, k, k * 0.5, n)
        out_a, alone = _step(alone, consts_alone, q[glob], k[glob], k[glob] * 0.5, n)
        for r in range(2):
            np.testing.assert_allclose(np.asarray(out_h[glob][:, r, : n_new[r]]),
                                       np.asarray(out_a[:, r, : n_new[r]]), atol=1e-5)
    for x, y in zip(jax.tree.leaves(hybrid.global_part.layers), jax.tree.leaves(alone.layers)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rings_do_not_grow_with_the_context_and_codebooks_cover_global_layers_only():
    short, _ = make_cache(CacheSpec("dense"), SHAPE, batch=1, max_len=64)
    long, _ = make_cache(CacheSpec("dense"), SHAPE, batch=1, max_len=256)
    a, b = short.nbytes_by_kind(), long.nbytes_by_kind()
    assert a["sliding"] == b["sliding"] == 3 * 2 * WINDOW * D * 2  # 3 rings of k and v, bf16
    assert b["global"] == 4 * a["global"] - 3 * 0 and a["total"] == a["global"] + a["sliding"] + 4  # + lengths
    assert long.bytes_per_token() == 2 * HKV * D * 2 * 2  # 2 global layers, k + v, bf16
    books = _books()
    _, consts = make_cache(CacheSpec("pq", codebooks=books), SHAPE, batch=1, max_len=16)
    assert consts.num_layers == 2
    with pytest.raises(ValueError, match="codebooks cover 5 layers, but the model has 2"):
        five = np.random.default_rng(0).standard_normal((5, HKV, 512, D)).astype(np.float32)
        make_cache(CacheSpec("pq", codebooks=fit_kv_codebooks(five, five, M=8, nbits=4, key=jax.random.PRNGKey(0),
                                                              iters=1)), SHAPE, batch=1, max_len=16)


def test_a_cache_of_the_wrong_layer_kinds_is_refused():
    hybrid, _ = make_cache(CacheSpec("dense"), SHAPE, batch=1, max_len=16)
    plain, _ = make_cache(CacheSpec("dense"), CacheShape(5, HKV, D), batch=1, max_len=16)
    check_layer_kinds(hybrid, PATTERN, WINDOW)
    check_layer_kinds(plain, (False,) * 5, 0)
    with pytest.raises(ValueError, match="3 sliding-window layers: its cache must be a HybridCache"):
        check_layer_kinds(plain, PATTERN, WINDOW)
    with pytest.raises(ValueError, match="does not match the model's"):
        check_layer_kinds(hybrid, PATTERN, WINDOW + 1)
    with pytest.raises(ValueError, match="no sliding-window layer"):
        check_layer_kinds(hybrid, (False,) * 5, 0)
    with pytest.raises(ValueError, match="the global cache has 5 layers, but the model has 2"):
        HybridCache.create(plain, PATTERN, WINDOW)


@pytest.mark.parametrize("sinks", [0, 2])
def test_long_calls_attend_in_query_blocks_with_the_same_result(monkeypatch, sinks):
    """exact_window_attention over T > BLOCK_ABOVE new tokens (query blocks that read only the
    sinks, the ring and their window of new tokens) equals the one-block computation; rows start
    empty (new tokens are the sinks) and part-filled, with padding."""
    import million_jax.cache.window as window

    rng = np.random.default_rng(3)
    b, t, w = 2, 50, 6
    q = jnp.asarray(rng.standard_normal((b, t, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, HKV, D)), jnp.float32)
    sk = jnp.asarray(rng.standard_normal((b, HKV, sinks, D)), jnp.float32)
    rk = jnp.asarray(rng.standard_normal((b, HKV, w, D)), jnp.float32)
    lengths, n_new = jnp.array([0, 13]), jnp.array([50, 41])
    args = (q, sk, sk * 2, rk, rk * 2, k, k * 0.5, lengths, n_new)
    whole = window.exact_window_attention(*args)
    monkeypatch.setattr(window, "BLOCK_ABOVE", 16)
    monkeypatch.setattr(window, "QUERY_BLOCK", 8)
    blocked = window.exact_window_attention(*args)
    for r, n in enumerate([50, 41]):
        for x, y in zip(whole, blocked):
            np.testing.assert_allclose(np.asarray(y[r, :n]), np.asarray(x[r, :n]), atol=1e-5)

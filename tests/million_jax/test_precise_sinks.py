"""CacheSpec(precise_sinks=S): the first S tokens kept in the cache dtype under every protocol."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax import CacheShape, CacheSpec, make_cache
from million_jax.quant.pq import Codebooks, decode, encode
from test_pq_cache import _books, _reference
from test_pq_cache_pre_rope import B, D, G, HKV, T_MAX, _chunk, _setup


def _feed(cache, books, q, k, v, steps):
    """Chunks of (start, T, n_new[B]) through layer 0; returns the outputs, one per chunk."""
    outs = []
    for start, t, n in steps:
        n = np.asarray(n, np.int32)
        out, cache = attend_layer0(cache, books, jnp.asarray(_chunk(q, start, n, t, 1)),
                                   jnp.asarray(_chunk(k, start, n, t, 2)),
                                   jnp.asarray(_chunk(v, start, n, t, 2)), jnp.asarray(n))
        outs.append((np.asarray(out), start, n))
    return cache, outs


# ragged prefill (3 and 7 tokens: one sequence shorter than the sinks), then two decode steps
STEPS = [((0, 0), 7, (3, 7)), ((3, 7), 1, (1, 1)), ((4, 8), 1, (1, 1))]


@pytest.mark.parametrize("nbits, S", [(4, 4), (6, 2)])
def test_quantize_all_with_precise_sinks_matches_exact_attention_over_its_rows(nbits, S):
    """protocol all + S precise sinks == exact attention over: the first S rows as stored (fp32
    here), every later row (the current token's included) from its decoded codes."""
    rng = np.random.default_rng(nbits)
    d, M = 64, 16
    books = _books(rng, 1, HKV, d, M, nbits, "layer_head")
    k = rng.standard_normal((B, HKV, T_MAX, d)).astype(np.float32)
    v = rng.standard_normal((B, HKV, T_MAX, d)).astype(np.float32)
    q = rng.standard_normal((B, T_MAX, HKV * G, d)).astype(np.float32)
    spec = CacheSpec("pq", codebooks=books, quantize_all=True, precise_sinks=S, dtype=jnp.float32, impl="xla")
    cache, consts = make_cache(spec, CacheShape(1, HKV, d), batch=B, max_len=T_MAX)
    assert cache.sinks == S and cache.window == 0
    cache, outs = _feed(cache, consts, q, k, v, STEPS)
    kcb, vcb = (Codebooks(np.asarray(c.centroids[0])) for c in (books.key, books.value))
    kq, vq = np.asarray(decode(kcb, encode(kcb, k))), np.asarray(decode(vcb, encode(vcb, v)))
    for out, start, n in outs:
        t = out.shape[1]
        qc = np.stack([_chunk(q, start, n, t, 1)[b] for b in range(B)])
        # exact for s < S, codes for everything else: the realistic reference with W = 0
        ref = _reference(qc, k, v, kq, vq, np.asarray(start), n, S, 0, quantize_all=False)
        for b in range(B):
            np.testing.assert_allclose(out[b, :n[b]], ref[b, :n[b]], rtol=2e-4, atol=2e-4)
    # and it differs from every token from codes (the sinks matter to the test)
    plain, _ = make_cache(dataclasses.replace(spec, precise_sinks=0), CacheShape(1, HKV, d), batch=B, max_len=T_MAX)
    _, plain_outs = _feed(plain, consts, q, k, v, STEPS)
    assert not np.allclose(plain_outs[0][0][1, :7], outs[0][0][1, :7], atol=1e-3)


def test_pre_rope_codebooks_read_the_same_as_realistic_with_sinks_only():
    """Keys quantized before RoPE: protocol all + precise sinks reads what realistic with the same
    exact sinks and no window reads (bit for bit: the same layer state and path)."""
    books, q, k_post, v, _, _ = _setup(np.random.default_rng(3))
    shape = CacheShape(1, HKV, D)
    a, consts = make_cache(CacheSpec("pq", codebooks=books, quantize_all=True, precise_sinks=4, dtype=jnp.float32,
                                     impl="xla"), shape, batch=B, max_len=T_MAX)
    r, _ = make_cache(CacheSpec("pq", codebooks=books, sinks=4, window=0, dtype=jnp.float32, impl="xla"), shape,
                      batch=B, max_len=T_MAX)
    _, out_a = _feed(a, consts, q, k_post, v, STEPS)
    _, out_r = _feed(r, consts, q, k_post, v, STEPS)
    for (x, _, n), (y, _, _) in zip(out_a, out_r):
        for b in range(B):
            np.testing.assert_array_equal(x[b, :n[b]], y[b, :n[b]])


def test_bytes_fixed_per_sequence_and_bits_per_token_unchanged():
    rng = np.random.default_rng(0)
    L, d = 3, 64
    books = _books(rng, L, HKV, d, 32, 8, "layer_head")
    shape = CacheShape(L, HKV, d)
    base = CacheSpec("pq", codebooks=books, quantize_all=True)
    plain, _ = make_cache(base, shape, batch=2, max_len=64)
    sinks, _ = make_cache(dataclasses.replace(base, precise_sinks=4), shape, batch=2, max_len=64)
    assert sinks.bits_per_element == plain.bits_per_element
    assert sinks.bytes_per_token() == plain.bytes_per_token()
    # K and V, 4 rows, every layer / sequence / KV head, bf16
    assert sinks.nbytes() - plain.nbytes() == 2 * 4 * L * 2 * HKV * d * 2
    assert not plain.layers.has_exact and plain.sinks == 0


def test_realistic_keeps_the_larger_sink_count():
    rng = np.random.default_rng(0)
    books = _books(rng, 1, HKV, 64, 32, 8, "layer_head")
    shape = CacheShape(1, HKV, 64)
    for sinks, precise, want in ((2, 4, 4), (6, 4, 6), (0, 0, 0)):
        c, _ = make_cache(CacheSpec("pq", codebooks=books, window=8, sinks=sinks, precise_sinks=precise), shape, 1, 32)
        assert (c.sinks, c.window, c.layers.quantize_all) == (want, 8, False)


@pytest.mark.parametrize("kw, match", [
    (dict(kind="uniform", bits=4, precise_sinks=4), "setting of a pq cache"),
    (dict(kind="pq", precise_sinks=-1), "precise_sinks must be an int >= 0"),
    (dict(kind="pq", precise_sinks=True), "precise_sinks must be an int >= 0"),
])
def test_bad_precise_sinks_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheSpec(**kw)

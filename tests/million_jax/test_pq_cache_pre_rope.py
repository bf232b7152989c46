"""PQCache with keys quantized before RoPE equals exact attention over RoPE(decode(codes))."""
import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax import rope
from million_jax.cache.pq_cache import PQCache
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.pq import Codebooks, decode, encode
from test_pq_cache import _reference

B, HKV, G, D, T_MAX = 2, 2, 2, 32, 24


def _setup(rng, nbits=4, stages=1, value_dsub=2, pairs=1, d=D):
    """Codebooks with ``pairs`` RoPE pairs per key sub-space, and what the cache should read."""
    inv = rope.rope_inv_freq(d, 50.0)  # fast pairs: the rotation matters within T_MAX tokens
    m = stages * d // (2 * pairs)
    kc = rng.standard_normal((1, HKV, m, 2**nbits, 2 * pairs)).astype(np.float32)
    vc = rng.standard_normal((1, HKV, d // value_dsub * stages, 2**nbits, value_dsub)).astype(np.float32)
    books = PQCodebooks.from_centroids(kc, vc, "layer_head", num_layers=1, stages=stages).with_pre_rope_keys(inv)
    assert books.key_rope_pairs == pairs
    k_pre = rng.standard_normal((B, HKV, T_MAX, d)).astype(np.float32)
    cos, sin = rope.rope_cos_sin(np.arange(T_MAX), inv)
    k_post = np.asarray(rope.rotate(k_pre, cos, sin))
    v = rng.standard_normal((B, HKV, T_MAX, d)).astype(np.float32)
    q = rng.standard_normal((B, T_MAX, HKV * G, d)).astype(np.float32)
    # what the cache should read: pre-RoPE keys through PQ (pair layout), rotated to their position
    kcb = Codebooks(np.asarray(books.key.centroids[0]))
    pre_pairs = rope.to_pair_layout(k_pre, pairs)
    if stages == 1:
        kq_pre = np.asarray(rope.from_pair_layout(decode(kcb, encode(kcb, pre_pairs)), pairs))
    else:
        from million_jax.quant.residual_pq import decode_stages, encode_stages
        kq_pre = np.asarray(rope.from_pair_layout(decode_stages(kcb, encode_stages(kcb, pre_pairs, stages), stages),
                                                  pairs))
    kq = np.asarray(rope.rotate(kq_pre, cos, sin))
    vcb = Codebooks(np.asarray(books.value.centroids[0]))
    if stages == 1:
        vq = np.asarray(decode(vcb, encode(vcb, v)))
    else:
        vq = np.asarray(decode_stages(vcb, encode_stages(vcb, v, stages), stages))
    return books, q, k_post, v, kq, vq


def _chunk(x, start, n, T, axis_tokens):
    """Rows start[b] .. start[b] + n[b] of x (token axis ``axis_tokens``) as float[B, T, ...], zero padded."""
    out = []
    for b in range(B):
        xb = np.take(x[b], np.arange(start[b], start[b] + T) % T_MAX, axis=axis_tokens - 1)
        xb = np.moveaxis(xb, axis_tokens - 1, 0).copy()
        xb[n[b]:] = 0
        out.append(xb)
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize("sinks, window, quantize_all, stages, value_dsub, impl, pairs, d", [
    (0, 0, True, 1, 4, "xla", 1, D),
    (2, 4, False, 1, 2, "xla", 1, D),
    (0, 0, True, 2, 2, "xla", 1, D),
    (2, 4, False, 1, 2, "pallas", 1, D),  # the kernel takes one M for keys and values
    # two RoPE pairs per key sub-space (pq2-pre-g2): xla, residual stages, and the kernel (M >= 16)
    (0, 0, True, 1, 4, "xla", 2, D),
    (2, 4, False, 2, 2, "xla", 2, D),
    (2, 4, False, 1, 4, "pallas", 2, 64),
])
def test_pre_rope_cache_matches_exact_attention_over_rotated_reconstructions(sinks, window, quantize_all, stages,
                                                                            value_dsub, impl, pairs, d):
    rng = np.random.default_rng(7 + stages + 10 * pairs)
    books, q, k_post, v, kq, vq = _setup(rng, stages=stages, value_dsub=value_dsub, pairs=pairs, d=d)
    cache = PQCache.for_codebooks(books, B, HKV, T_MAX, window=window, sinks=sinks, dtype=jnp.float32,
                                  quantize_all=quantize_all, impl=impl)
    prompt = np.array([5, 11], np.int32)
    steps = [(np.zeros(B, np.int32), prompt, 11)]  # ragged prefill, then 3 decode steps
    for i in range(3):
        steps.append((prompt + i, np.ones(B, np.int32), 1))
    for start, n, T in steps:
        qc = _chunk(q, start, n, T, 1)
        kc, vc = _chunk(k_post, start, n, T, 2), _chunk(v, start, n, T, 2)
        out, cache = attend_layer0(cache, books, jnp.asarray(qc), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(n))
        ref = _reference(qc, k_post, v, kq, vq, start, n, sinks, window, quantize_all)
        tol = 3e-2 if impl == "pallas" else 2e-4  # the kernel's dots are bf16
        for b in range(B):
            np.testing.assert_allclose(np.asarray(out)[b, :n[b]], ref[b, :n[b]], rtol=tol, atol=tol)
    # the rotation is what makes it right: reading the codes as post-RoPE keys is far off
    wrong = _reference(qc, k_post, v, np.asarray(rope.rotate(kq, *rope.rope_cos_sin(-np.arange(T_MAX), np.asarray(
        books.rope_inv_freq)))), vq, start, n, sinks, window, quantize_all)
    assert np.abs(np.asarray(out) - wrong).max() > 10 * tol


def test_bf16_keys_are_turned_back_in_float32_before_encoding():
    """A bf16 model's post-RoPE key is turned back to position 0 in float32 and encoded from there:
    the stored codes are those of the exactly unrotated key, not of a second bf16 rounding of it
    (which moves some keys to another centroid with 256 fine centroids per pair)."""
    rng = np.random.default_rng(3)
    d, t = 16, 256
    inv = rope.rope_inv_freq(d, 50.0)
    kc = (0.3 * rng.standard_normal((1, 1, d // 2, 256, 2))).astype(np.float32)
    vc = rng.standard_normal((1, 1, d // 2, 16, 2)).astype(np.float32)
    books = PQCodebooks.from_centroids(kc, vc, "layer_head", num_layers=1).with_pre_rope_keys(inv)
    k = jnp.asarray(rng.standard_normal((1, t, 1, d)), jnp.bfloat16)  # post-RoPE, as the model gives it
    v = jnp.asarray(rng.standard_normal((1, t, 1, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, t, 1, d)), jnp.bfloat16)
    cache = PQCache.for_codebooks(books, 1, 1, t, dtype=jnp.bfloat16, quantize_all=True, impl="xla")
    _, cache = attend_layer0(cache, books, q, k, v, jnp.asarray([t], jnp.int32))
    got = np.asarray(cache.layers.k_codes[0, 0, 0])  # [T, M]
    cos, sin = rope.rope_cos_sin(np.arange(t), inv)
    kcb = Codebooks(np.asarray(books.key.centroids[0, 0]))
    exact = rope.unrotate(np.asarray(k[0, :, 0], np.float32), cos, sin)  # [T, d]
    want = np.asarray(encode(kcb, rope.to_pair_layout(exact, 1)[None]))[0]
    twice = np.asarray(encode(kcb, rope.to_pair_layout(jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32), 1)[None]))[0]
    assert (want != twice).any()  # the case can tell the two apart
    np.testing.assert_array_equal(got, want)

"""KiviCache (KIVI as published) against a per-query numpy reference written from the method.

The reference: a query at position p reads key s exactly iff s >= floor(p / R) * R (KIVI's
full-precision block of the current R tokens), else from codes quantized per channel over its
complete group of G tokens; value s exactly iff s >= p - R (the sliding window of R recent
values plus the new one), else from codes quantized per token in groups of min(G, d) channels.
Scale / zero: (max - min) * f32(1 / qmax) and min, rounded to the cache dtype first.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax.cache.kivi_cache import KiviCache, check_kivi
from million_jax.cache.spec import CacheShape, CacheSpec, make_cache
from million_jax.cache.uniform_cache import UniformCache


def _rd(x, dtype):
    x = np.asarray(x, np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == jnp.bfloat16 else x


def _deq(x, mn, mx, bits, dtype):
    qmax = 2**bits - 1
    scale = _rd((mx - mn) * (np.float32(1) / np.float32(qmax)), dtype)
    zero = _rd(mn, dtype)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    return np.clip(np.round((x - zero) * inv), 0, qmax) * scale + zero


def _reference(q, k, v, p_list, G, R, bits, dtype):
    """q [T, H, d] for positions p_list; k, v exact [Hkv, N, d] (already in the cache dtype)."""
    h, d = q.shape[1:]
    hkv = k.shape[0]
    vg = min(G, d)
    out = np.zeros((len(p_list), h, d))
    for i, p in enumerate(p_list):
        for kv in range(hkv):
            keys, vals = [], []
            for s in range(p + 1):
                if s >= (p // R) * R:
                    keys.append(k[kv, s])
                else:
                    grp = k[kv, (s // G) * G:(s // G + 1) * G]
                    keys.append(_deq(k[kv, s], grp.min(0), grp.max(0), bits, dtype))
                if s >= p - R:
                    vals.append(v[kv, s])
                else:
                    x = v[kv, s].reshape(-1, vg)
                    vals.append(_deq(x, x.min(1, keepdims=True), x.max(1, keepdims=True), bits, dtype).reshape(-1))
            keys, vals = np.array(keys, np.float64), np.array(vals, np.float64)
            for hh in range(kv * (h // hkv), (kv + 1) * (h // hkv)):
                sc = keys @ q[i, hh] / math.sqrt(d)
                pr = np.exp(sc - sc.max())
                out[i, hh] = pr / pr.sum() @ vals
    return out


@pytest.mark.parametrize("G,R,bits,bf16,plan", [
    (4, 8, 2, False, [[7, 3], [1, 6], [5, 1], [1, 1], [6, 6]]),
    (8, 8, 4, True, [[12, 2], [1, 11], [1, 1], [6, 3]]),
    (32, 32, 4, False, [[20, 40], [30, 1], [1, 9]]),   # G > d: values per token over all d channels
])
def test_matches_reference_chunked_ragged(G, R, bits, bf16, plan):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    b, hkv, h, d = 2, 2, 4, 16
    total = [sum(c[i] for c in plan) for i in range(b)]
    t_max = max(total)
    rng = np.random.default_rng(G + R + bits)
    q_all = _rd(rng.standard_normal((b, t_max, h, d)), dtype)
    k_all = _rd(rng.standard_normal((b, hkv, t_max, d)) * (1 + 4 * (rng.random(d) < 0.2)), dtype)
    v_all = _rd(rng.standard_normal((b, hkv, t_max, d)), dtype)
    cache = KiviCache.create(1, b, hkv, t_max, d, bits=bits, group_size=G, residual=R, dtype=dtype, tile=8)
    width = max(max(c) for c in plan)
    start = np.zeros(b, np.int32)
    for n in plan:
        n = np.asarray(n, np.int32)
        q = np.zeros((b, width, h, d), np.float32)
        k = np.zeros((b, width, hkv, d), np.float32)
        v = np.zeros_like(k)
        for bi in range(b):
            src = slice(start[bi], start[bi] + n[bi])
            q[bi, :n[bi]] = q_all[bi, src]
            k[bi, :n[bi]] = np.swapaxes(k_all[bi, :, src], 0, 1)
            v[bi, :n[bi]] = np.swapaxes(v_all[bi, :, src], 0, 1)
        out, cache = attend_layer0(cache, None, q, k, v, n)
        out = np.asarray(out, np.float32)
        for bi in range(b):
            ps = list(range(start[bi], start[bi] + n[bi]))
            if ps:
                ref = _reference(q[bi, :n[bi]], k_all[bi], v_all[bi], ps, G, R, bits, dtype)
                np.testing.assert_allclose(out[bi, :n[bi]], ref, atol=2e-4, rtol=2e-4)
        start = start + n
    np.testing.assert_array_equal(np.asarray(cache.lengths), total)


def test_full_precision_tail_is_exact():
    """Within the current R-block keys are exact and the last R + 1 values exact: a query whose whole
    context is that tail sees exactly dense attention (bit-for-bit in float32 up to summation order)."""
    b, hkv, h, d, R = 1, 1, 2, 16, 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, R, h, d)).astype(np.float32)
    k = rng.standard_normal((b, R, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, R, hkv, d)).astype(np.float32)
    cache = KiviCache.create(1, b, hkv, 2 * R, d, bits=2, group_size=8, residual=R, dtype=jnp.float32)
    out, _ = attend_layer0(cache, None, q, k, v, np.array([R], np.int32))
    dense, _ = attend_layer0(make_cache(CacheSpec("dense", dtype=jnp.float32), CacheShape(1, hkv, d), b, 2 * R)[0],
                             None, q, k, v, np.array([R], np.int32))
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-6)


def test_all_from_codes_is_uniform_kivi():
    """R = 0 (quantize_all) is the UniformCache kivi mode."""
    b, hkv, h, d, G = 1, 1, 2, 16, 4
    rng = np.random.default_rng(1)
    q = rng.standard_normal((b, 10, h, d)).astype(np.float32)
    k = rng.standard_normal((b, 10, hkv, d)).astype(np.float32)
    n = np.array([10], np.int32)
    kc = KiviCache.create(1, b, hkv, 12, d, bits=4, group_size=G, dtype=jnp.float32, quantize_all=True)
    uc = UniformCache.create(1, b, hkv, 12, d, bits=4, group_size=G, dtype=jnp.float32, quantize_all=True)
    np.testing.assert_array_equal(np.asarray(attend_layer0(kc, None, q, k, k, n)[0]),
                                  np.asarray(attend_layer0(uc, None, q, k, k, n)[0]))


def test_bits_and_bad_settings():
    c = KiviCache.create(2, 1, 3, 256, 64, bits=4, group_size=128, residual=128)
    assert c.bits_per_element.key == pytest.approx(4 + 32 / 128) and c.bits_per_element.value == pytest.approx(4.5)
    assert KiviCache.create(1, 1, 1, 64, 64, bits=2, group_size=32, residual=32).bits_per_element.mean == 3.0
    with pytest.raises(ValueError, match="multiple of the group size"):
        check_kivi(2, 32, 48)
    with pytest.raises(ValueError, match="bits must be one of"):
        check_kivi(3, 32, 32)
    with pytest.raises(ValueError, match="R must be an int"):
        check_kivi(2, 32, -1)

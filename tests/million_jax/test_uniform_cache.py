"""UniformCache attention equals a per-query numpy reference written from the quantization spec.

The reference quantizer below is written from the spec, not from the code:
a group x is stored as zero = min(x), scale = (max(x) - min(x)) * f32(1/qmax),
both rounded to the cache dtype, code = clip(round((x - zero) / scale)), and
read back as code * scale + zero. kivi keys: per channel over the G tokens of
a group, where a query at position p sees its own group as of p (tokens g*G..p);
values: per token in groups of G channels; token mode: per token over all d.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cache_layer_step import attend_layer0
from million_jax.attention import uniform_xla
from million_jax.cache.uniform_cache import UniformCache
from million_jax.quant.uniform import (
    bits_per_element,
    dequantize_token_groups,
    pack,
    quantize_token_groups,
    unpack,
)


# ------------------------------------------------------------------ reference quantizer
def _to_dtype(x, dtype):
    """float32 values rounded through the cache dtype (bf16 or f32)."""
    x = np.asarray(x, np.float32)
    if dtype == jnp.bfloat16:
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x


def _ref_dequant(x, mn, mx, bits, dtype):
    """Spec quantize-then-dequantize of x with group minima / maxima (broadcast)."""
    qmax = 2**bits - 1
    scale = _to_dtype((mx - mn) * (np.float32(1) / np.float32(qmax)), dtype)
    zero = _to_dtype(mn, dtype)
    safe = np.where(scale > 0, scale, np.float32(1))
    inv = np.where(scale > 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    code = np.clip(np.round((x - zero) * inv), 0, qmax)
    return code.astype(np.float32) * scale + zero


def _ref_key(kx, s, p, mode, G, bits, dtype):
    """Key of token s as read by a query at p >= s. kx: float32[P, d] exact keys of one head."""
    if mode == "kivi":
        g0 = (s // G) * G
        rows = kx[g0 : min(g0 + G, p + 1)]
        return _ref_dequant(kx[s], rows.min(0), rows.max(0), bits, dtype)
    return _ref_dequant(kx[s], kx[s].min(), kx[s].max(), bits, dtype)


def _ref_value(vs, mode, G, bits, dtype):
    """Value of one token (float32[d]) after per-token quantization."""
    grp = G if mode == "kivi" else vs.shape[-1]
    x = vs.reshape(-1, grp)
    return _ref_dequant(x, x.min(1, keepdims=True), x.max(1, keepdims=True), bits, dtype).reshape(-1)


def _ref_attention(q, k_all, v_all, start, n_new, cfg):
    """Per-query loop. q: [B, T, H, d]; k_all, v_all: exact [B, Hkv, T_max, d]; start: lengths before."""
    mode, G, bits, dtype, S, W, qa = (cfg[x] for x in ("mode", "G", "bits", "dtype", "S", "W", "qa"))
    b, t, h, d = q.shape
    hkv = k_all.shape[1]
    g = h // hkv
    out = np.zeros((b, t, h, d), np.float64)
    for bi in range(b):
        for ti in range(int(n_new[bi])):
            p = int(start[bi]) + ti
            for kv in range(hkv):
                keys, vals = [], []
                for s in range(p + 1):
                    if not qa and (s < S or s > p - W):
                        keys.append(k_all[bi, kv, s])
                        vals.append(v_all[bi, kv, s])
                    else:
                        keys.append(_ref_key(k_all[bi, kv], s, p, mode, G, bits, dtype))
                        vals.append(_ref_value(v_all[bi, kv, s], mode, G, bits, dtype))
                keys, vals = np.array(keys, np.float64), np.array(vals, np.float64)
                for hi in range(kv * g, kv * g + g):
                    sc = keys @ q[bi, ti, hi].astype(np.float64) / math.sqrt(d)
                    pr = np.exp(sc - sc.max())
                    out[bi, ti, hi] = (pr / pr.sum()) @ vals
    return out


def _ref_stored(k_all, v_all, lengths, cfg):
    """What cache.dequantize() must return: every stored token with its group's final stats."""
    kh, vh = np.zeros_like(k_all), np.zeros_like(v_all)
    for bi in range(k_all.shape[0]):
        n = int(lengths[bi])
        for kv in range(k_all.shape[1]):
            for s in range(n):
                kh[bi, kv, s] = _ref_key(k_all[bi, kv], s, n - 1, cfg["mode"], cfg["G"], cfg["bits"], cfg["dtype"])
                vh[bi, kv, s] = _ref_value(v_all[bi, kv, s], cfg["mode"], cfg["G"], cfg["bits"], cfg["dtype"])
    return kh, vh


# ------------------------------------------------------------------ driving the cache
def _step_impl(cache, q, k, v, n):
    """One attend + advance on a 1-layer cache."""
    return attend_layer0(cache, None, q, k, v, n)


# One compile per shape/config. Most tests skip LLVM's optimisation passes, which halves
# compile time on CPU and leaves the HLO (what is computed) unchanged; the chunked-prefill
# test uses the default pipeline so that is covered too.
_step = jax.jit(_step_impl)
_step_fast = jax.jit(_step_impl, compiler_options={"xla_backend_optimization_level": 0})


def _feed(cache, q_all, k_all, v_all, plan, width, step=_step_fast):
    """Run chunks: plan is a list of int[B] n_new; every call has T = width (padded).

    q_all: [B, T_total, H, d]; k_all, v_all: [B, Hkv, T_total, d] (token order per sequence).
    Returns (cache, [(q_chunk, start, n_new, out)]).
    """
    b = q_all.shape[0]
    hkv, d = k_all.shape[1], k_all.shape[-1]
    start = np.zeros(b, np.int32)
    calls = []
    for n in plan:
        n = np.asarray(n, np.int32)
        q = np.zeros((b, width) + q_all.shape[2:], np.float32)
        k = np.zeros((b, width, hkv, d), np.float32)
        v = np.zeros_like(k)
        for bi in range(b):
            src = slice(start[bi], start[bi] + n[bi])
            q[bi, : n[bi]] = q_all[bi, src]
            k[bi, : n[bi]] = np.swapaxes(k_all[bi, :, src], 0, 1)
            v[bi, : n[bi]] = np.swapaxes(v_all[bi, :, src], 0, 1)
        out, cache = step(cache, q, k, v, n)
        calls.append((q, start.copy(), n, np.asarray(out)))
        start = start + n
    return cache, calls


def _data(rng, b, t, hkv, g, d, dtype):
    q = rng.standard_normal((b, t, hkv * g, d)).astype(np.float32)
    # keys with a few outlier channels (what per-channel key quantization is for)
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float32) * (1 + 4 * (rng.random(d) < 0.1))
    v = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    return _to_dtype(q, dtype), _to_dtype(k, dtype), _to_dtype(v, dtype)


def _plan(draw, target, width):
    """Chunk sizes (1..width each) summing to target."""
    sizes = []
    while target > 0:
        n = draw(st.integers(1, min(width, target)))
        sizes.append(n)
        target -= n
    return sizes


@settings(max_examples=6)  # each example compiles new shapes (~5 s on 2 cores)
@given(
    seed=st.integers(0, 10_000),
    d=st.sampled_from([64, 128]),
    mode_bits=st.sampled_from([("kivi", 2), ("kivi", 4), ("kivi", 8), ("token", 2), ("token", 4), ("int8_token", 8)]),
    G=st.sampled_from([4, 8, 16]),
    hkv_g=st.sampled_from([(1, 1), (2, 2), (1, 4), (2, 3)]),
    S=st.sampled_from([0, 2]),
    W=st.sampled_from([0, 3, 8]),
    qa=st.booleans(),
    bf16=st.booleans(),
    tile=st.sampled_from([1, 16, 512]),
    data=st.data(),
)
@pytest.mark.slow
def test_attention_matches_reference(seed, d, mode_bits, G, hkv_g, S, W, qa, bf16, tile, data):
    mode, bits = mode_bits
    hkv, g = hkv_g
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    t_max = data.draw(st.integers(4, 18), label="t_max")
    width = data.draw(st.integers(1, 6), label="width")
    # sequence 0 fills the cache exactly (length == T_max), sequence 1 stops anywhere >= 1
    targets = [t_max, data.draw(st.integers(1, t_max), label="len1")]
    plans = [_plan(data.draw, n, width) for n in targets]
    steps = max(map(len, plans))
    plan = [[p[i] if i < len(p) else 0 for p in plans] for i in range(steps)]
    rng = np.random.default_rng(seed)
    q_all, k_all, v_all = _data(rng, 2, t_max, hkv, g, d, dtype)
    cache = UniformCache.create(1, 2, hkv, t_max, d, bits=bits, group_size=G, mode=mode, window=W,
                                sinks=S, dtype=dtype, quantize_all=qa, tile=tile)
    cache, calls = _feed(cache, q_all, k_all, v_all, plan, width)
    np.testing.assert_array_equal(np.asarray(cache.lengths), targets)

    cfg = dict(mode=mode, G=G, bits=bits, dtype=dtype, S=S, W=W, qa=qa)
    for q, start, n, out in calls:
        ref = _ref_attention(q, k_all, v_all, start, n, cfg)
        for bi in range(2):
            np.testing.assert_allclose(out[bi, : n[bi]], ref[bi, : n[bi]], rtol=1e-4, atol=1e-4)
    kh, vh = (np.asarray(x[0]) for x in cache.dequantize())
    rk, rv = _ref_stored(k_all, v_all, targets, cfg)
    np.testing.assert_allclose(kh, rk, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vh, rv, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "mode,bits,qa,W,S",
    [("kivi", 4, False, 3, 2), ("kivi", 2, True, 0, 0)],
)
def test_chunked_prefill_equals_one_shot(mode, bits, qa, W, S, monkeypatch):
    """One call of 11 tokens == 4 ragged chunks == 11 single-token steps: outputs and state.

    Every call is 11 wide (padded), so one compile serves all three schedules. The
    current-group attention runs its chunked lax.map path here (4 queries per step,
    remainder 3); the reference test covers the single-vmap path.
    """
    monkeypatch.setattr(uniform_xla, "CURRENT_CHUNK", 4)
    rng = np.random.default_rng(0)
    hkv, g, d, T, G = 2, 2, 64, 11, 4
    q, k, v = _data(rng, 1, T, hkv, g, d, jnp.bfloat16)
    mk = lambda: UniformCache.create(1, 1, hkv, 16, d, bits=bits, group_size=G, mode=mode, window=W,  # noqa: E731
                                     sinks=S, quantize_all=qa, tile=4)
    c1, (call,) = _feed(mk(), q, k, v, [[T]], T, step=_step)
    one = call[3][:, :T]
    cfg = dict(mode=mode, G=G, bits=bits, dtype=jnp.bfloat16, S=S, W=W, qa=qa)
    np.testing.assert_allclose(one, _ref_attention(q, k, v, [0], [T], cfg), rtol=1e-4, atol=1e-4)
    for plan in ([[3], [1], [5], [2]], [[1]] * T):
        c2, calls = _feed(mk(), q, k, v, plan, T, step=_step)
        outs = np.concatenate([c[3][:, : c[2][0]] for c in calls], axis=1)
        np.testing.assert_allclose(outs, one, rtol=1e-5, atol=1e-5)
        for name, a, b in zip(UniformCache.__dataclass_fields__, jax.tree.leaves(c1), jax.tree.leaves(c2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 10_000))
def test_packing_roundtrip(bits, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, (3, 5, 64)).astype(np.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits)), codes)


def test_packing_layout():
    """Little end first along channels: the byte layout is part of the stored format."""
    np.testing.assert_array_equal(pack(np.array([1, 2, 15, 0], np.uint8), 4), [0x21, 0x0F])
    np.testing.assert_array_equal(pack(np.array([1, 2, 3, 0, 3, 3, 3, 3], np.uint8), 2), [0b00111001, 0xFF])
    np.testing.assert_array_equal(pack(np.array([7, 200], np.uint8), 8), [7, 200])


def _rel_err(a, b):
    return float(np.sqrt(np.mean((np.asarray(a) - b) ** 2) / np.mean(b**2)))


def test_quantization_error_falls_with_bits():
    """Relative RMS error of stored K / V falls with bits; per-channel keys beat per-token keys."""
    rng = np.random.default_rng(3)
    _, k, v = _data(rng, 1, 16, 1, 1, 64, jnp.float32)  # keys have outlier channels
    q = np.zeros((1, 16, 1, 64), np.float32)
    kivi_k, kivi_v, tok_k = {}, {}, {}
    for bits in (2, 4, 8):
        cache = UniformCache.create(1, 1, 1, 16, 64, bits=bits, group_size=8, dtype=jnp.float32)
        cache, _ = _feed(cache, q, k, v, [[16]], 16)
        kh, vh = (np.asarray(x[0]) for x in cache.dequantize())
        kivi_k[bits], kivi_v[bits] = _rel_err(kh, k), _rel_err(vh, v)
        # token mode is quantize_token_groups over all d channels (the cache path is
        # covered by the reference test); measured here without a compile per bit width
        tok_k[bits] = _rel_err(dequantize_token_groups(*quantize_token_groups(k, bits, 64, jnp.float32)), k)
    for err in (kivi_k, kivi_v, tok_k):
        assert err[2] > 2 * err[4] > 4 * err[8], err
        assert err[8] < 0.02, err
    for bits in (2, 4, 8):
        assert kivi_k[bits] < 0.7 * tok_k[bits], (kivi_k, tok_k)


def test_bits_per_element_and_nbytes():
    bf, f32 = jnp.bfloat16, jnp.float32
    assert bits_per_element("kivi", 4, 32, 128, bf) == (5.0, 5.0)
    assert bits_per_element("kivi", 2, 32, 128, bf) == (3.0, 3.0)
    assert bits_per_element("kivi", 8, 32, 128, bf) == (9.0, 9.0)
    assert bits_per_element("kivi", 4, 32, 128, f32) == (6.0, 6.0)
    assert bits_per_element("token", 4, 64, 64, bf) == (4.5, 4.5)
    assert bits_per_element("int8_token", 8, 128, 128, bf) == (8.25, 8.25)

    L, B, H, T, d, G, S, W = 2, 3, 2, 100, 128, 32, 4, 16
    c = UniformCache.create(L, B, H, T, d, bits=4, group_size=G, window=W, sinks=S)
    assert c.bits_per_element == (5.0, 5.0)
    assert c.layers.k_codes.shape == (L, B, H, T, d * 4 // 8) and c.layers.k_codes.dtype == jnp.uint8
    n_groups = -(-T // G)
    per_head = (2 * T * d * 4 // 8          # packed codes, K and V
                + 2 * n_groups * d * 2      # key scale + zero (bf16) per (token group, channel)
                + 2 * T * (d // G) * 2      # value scale + zero per (token, channel group)
                + G * d * 2                 # key staging buffer
                + 2 * (S + W) * d * 2)      # exact sinks and ring, K and V
    assert c.nbytes() == L * B * H * per_head + 4 * B
    assert c.bytes_per_token() == L * H * d * (5.0 + 5.0) / 8
    t8 = UniformCache.create(1, 1, 1, 64, 64, bits=8, mode="int8_token")
    assert t8.bits_per_element == (8.5, 8.5)
    assert t8.nbytes() == 2 * 64 * 64 + 2 * 2 * 64 * 2 + 4
    # a long cache: bits_per_element per K/V element plus only the fixed staging buffer
    big = UniformCache.create(1, 1, 1, 4096, 128, bits=2, group_size=32)
    assert big.nbytes() * 8 == 3.0 * 2 * 4096 * 128 + 32 * 128 * 16 + 32


def test_writes_past_max_len_are_dropped():
    rng = np.random.default_rng(1)
    q, k, v = _data(rng, 1, 9, 1, 1, 64, jnp.float32)
    mk = lambda: UniformCache.create(1, 1, 1, 6, 64, bits=4, group_size=4, window=2, dtype=jnp.float32)  # noqa: E731
    full, calls = _feed(mk(), q, k, v, [[9]], 9)
    assert int(full.lengths[0]) == 6
    assert np.isfinite(calls[0][3]).all()
    exact, _ = _feed(mk(), q[:, :6], k[:, :, :6], v[:, :, :6], [[6]], 9)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(exact)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a full cache ignores further appends
    again, _ = _feed(full, q, k, v, [[2]], 9)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pytree_roundtrip_and_no_consts():
    c = UniformCache.create(2, 1, 1, 8, 16, bits=4, group_size=4, window=2, sinks=1)
    leaves, tree = jax.tree.flatten(c)
    assert len(leaves) == 12
    c2 = jax.tree.unflatten(tree, leaves)
    lay = c2.layers
    assert (lay.bits, lay.group_size, lay.mode, c2.window, c2.sinks) == (4, 4, "kivi", 2, 1)
    assert c.layer_consts(None) is None and all(x.shape[0] == 2 for x in jax.tree.leaves(c.layers))
    with pytest.raises(ValueError, match="cache_consts"):
        c.layer_consts(object())


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(bits=3), "bits must be one of"),
        (dict(bits=16), "bits must be one of"),
        (dict(bits=4, mode="kmeans"), "mode must be one of"),
        (dict(bits=4, mode="int8_token"), "int8_token"),
        (dict(bits=4, group_size=24), "not divisible by group_size 24"),
        (dict(bits=4, group_size=0), "group_size"),
        (dict(bits=4, window=-1), "window and sinks"),
        (dict(bits=4, sinks=-2), "window and sinks"),
        (dict(bits=4, dtype=jnp.int8), "floating"),
        (dict(bits=4, tile=0), "tile"),
    ],
)
def test_bad_settings_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        UniformCache.create(1, 1, 1, 8, 64, **kw)


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="max_len"):
        UniformCache.create(1, 1, 1, 0, 64, bits=4)
    with pytest.raises(ValueError, match="whole number of bytes"):
        UniformCache.create(1, 1, 1, 8, 6, bits=2, mode="token")


@pytest.mark.slow
def test_model_runs_with_uniform_cache():
    """The LLaMA model takes a UniformCache unchanged: ragged prefill + decode, close to dense at 8 bits."""
    from models import decode_step, init_cache, init_params, prefill, preset

    cfg = preset("tiny")
    params = init_params(cfg, jax.random.key(0), jnp.float32, stddev=0.2)
    toks = np.random.default_rng(4).integers(0, cfg.vocab, (2, 9)).astype(np.int32)
    lengths = np.array([7, 4], np.int32)
    # dense reference: each sequence's prompt plus its two next tokens in one prefill
    full = np.stack([np.concatenate([toks[b, : lengths[b]], toks[b, 7:9], np.zeros(7 - lengths[b], np.int32)])
                     for b in range(2)])
    ref, _ = prefill(cfg, params, init_cache(cfg, 2, 12, jnp.float32), full, lengths + 2)
    ref = np.asarray(ref)
    cache = UniformCache.create(cfg.n_layers, 2, cfg.n_kv_heads, 12, cfg.head_dim, bits=8, group_size=4,
                                window=2, sinks=1, dtype=jnp.float32)
    logits, cache = prefill(cfg, params, cache, toks[:, :7], lengths)
    got = [np.asarray(logits)]
    for i in (7, 8):
        step, cache = decode_step(cfg, params, cache, toks[:, i])
        got.append(np.asarray(step))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 2)
    diffs = []
    for b in range(2):
        n = lengths[b]
        diffs.append(np.abs(got[0][b, :n] - ref[b, :n]).max())
        for j in range(2):
            diffs.append(np.abs(got[1 + j][b] - ref[b, n + j]).max())
    scale = np.abs(ref).max()
    assert 0 < max(diffs) < 0.02 * scale, (max(diffs), scale)

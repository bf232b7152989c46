"""Attention from pre-RoPE key codes (issue 24) in the xla tile walk and through the dispatch.

Keys quantized before RoPE: key sub-space m (dsub = 2) is RoPE pair m, code row s is the key of
position s, rotated by s * inv_freq[m] (rotate-half); q comes rotated. With P pairs per
sub-space (dsub = 2P) the frequencies are [M, P] and pair p of sub-space m turns by
s * inv_freq[m, p]. Compared with attention
over RoPE(decode(codes)) in NumPy float64 on fresh random inputs.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax.attention.pq_dispatch import kernel_plan, pq_code_attention
from million_jax.attention.pq_xla import pq_attention_xla
from pallas_kernels.code_packing import pack_codes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make(rng, b, t, h, hkv, d, n, k_bits=8, v_m=None, packed=False, pairs=1):
    m = d // (2 * pairs)
    v_m = v_m or m
    f = (1.0 / 10000 ** (np.arange(m * pairs) / (m * pairs)) * rng.uniform(0.7, 1.0, m * pairs)).astype(np.float32)
    kc = rng.integers(0, 2**k_bits, (b, hkv, n, m)).astype(np.uint8)
    vc = rng.integers(0, 256, (b, hkv, n, v_m)).astype(np.uint8)
    return dict(
        q=rng.standard_normal((b, t, h, d)).astype(np.float32),
        k_codes=kc, v_codes=vc,
        k_books=rng.standard_normal((hkv, m, 2**k_bits, 2 * pairs)).astype(np.float32),
        v_books=rng.standard_normal((1, v_m, 256, d // v_m)).astype(np.float32),
        stored_k=np.asarray(pack_codes(jnp.asarray(kc), k_bits)) if packed else kc,
        freqs=f if pairs == 1 else f.reshape(pairs, m).T.copy(),  # [M] or [M, P]
    )


def oracle(x, lo, hi):
    """float64 attention of q [B, T, H, d] over RoPE(decode(codes)), tokens lo <= s < hi."""
    q, kc, vc, kb, vb = (np.asarray(x[k]) for k in ("q", "k_codes", "v_codes", "k_books", "v_books"))
    b, t, h, d = q.shape
    hkv, n, m = kc.shape[1], kc.shape[2], kc.shape[3]
    f = x["freqs"].astype(np.float64).reshape(m, -1)  # [M, P]
    ang = np.arange(n, dtype=np.float64)[:, None, None] * f[None]  # [N, M, P]
    cos, sin = np.cos(ang), np.sin(ang)
    keys = np.stack([kb[g].astype(np.float64)[np.arange(m), kc[:, g]] for g in range(hkv)], axis=1)  # [B,Hkv,N,M,2P]
    keys = keys.reshape(keys.shape[:-1] + (f.shape[1], 2))
    k1, k2 = keys[..., 0], keys[..., 1]
    keys = np.stack([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1).reshape(b, hkv, n, d)
    vm = vc.shape[-1]
    vals = vb[0].astype(np.float64)[np.arange(vm), vc].reshape(b, hkv, n, d)
    out, lse = np.zeros((b, t, h, d)), np.full((b, t, h), -np.inf)
    for bi in range(b):
        for ti in range(t):
            sl = slice(int(lo[bi, ti]), int(hi[bi, ti]))
            if sl.stop <= sl.start:
                continue
            for hh in range(h):
                g = hh // (h // hkv)
                s = keys[bi, g, sl] @ q[bi, ti, hh].astype(np.float64) / math.sqrt(d)
                p = np.exp(s - s.max())
                out[bi, ti, hh] = p @ vals[bi, g, sl] / p.sum()
                lse[bi, ti, hh] = s.max() + np.log(p.sum())
    return out, lse


def check(got, want, tol=2e-5):
    out, lse = (np.asarray(a, np.float64) for a in got)
    inf = np.isneginf(want[1])
    assert (np.isneginf(lse) == inf).all()
    np.testing.assert_allclose(out, want[0], atol=tol, rtol=0)
    np.testing.assert_allclose(lse[~inf], want[1][~inf], atol=tol, rtol=0)


def xla(x, lo, hi, tile=64):
    fn = jax.jit(pq_attention_xla, static_argnames="tile")
    return fn(x["q"], x["stored_k"], x["v_codes"], x["k_books"], x["v_books"], lo, hi, tile=tile,
              rope_inv_freq=jnp.asarray(x["freqs"]))


@pytest.mark.parametrize("t, k_bits, packed, v_m, pairs", [
    (1, 8, False, None, 1), (3, 4, True, 8, 1), (12, 6, True, None, 1),
    (1, 8, False, None, 2), (12, 6, True, 16, 2), (2, 8, False, 4, 4),  # P pairs per sub-space
])
def test_xla_matches_float64_oracle(t, k_bits, packed, v_m, pairs):
    """Decode (LUT: q.c and q.Jc tables) and prefill (T > 8: rotated decoded keys), ragged windows."""
    rng = np.random.default_rng(100 * t + k_bits + pairs)
    b, h, hkv, d, n = 3, 4, 2, 32, 150
    x = make(rng, b, t, h, hkv, d, n, k_bits, v_m, packed, pairs)
    lo = rng.integers(0, 40, (b, t)).astype(np.int32)
    hi = rng.integers(41, n + 1, (b, t)).astype(np.int32)
    hi[0, 0], lo[1, 0], hi[1, 0] = n, 5, 5  # the full array; an empty window
    check(xla(x, lo, hi), oracle(x, lo, hi))


def test_xla_at_positions_near_128k():
    rng = np.random.default_rng(5)
    n = 131072
    x = make(rng, 1, 2, 2, 1, 32, n, k_bits=4)
    lo = np.array([[n - 300, n - 77]], np.int32)
    hi = np.array([[n, n - 3]], np.int32)
    check(xla(x, lo, hi, tile=4096), oracle(x, lo, hi))


@pytest.mark.parametrize("d, pairs", [(32, 1), (64, 2)])
def test_dispatch_kernel_and_xla_agree_on_pre_rope_keys(d, pairs):
    rng = np.random.default_rng(9 + pairs)
    x = make(rng, 2, 1, 4, 2, d, 70, pairs=pairs)
    lo = np.array([[0], [3]], np.int32)
    hi = np.array([[70], [41]], np.int32)
    args = tuple(jnp.asarray(a) for a in (x["q"], x["k_codes"], x["v_codes"], x["k_books"], x["v_books"], lo, hi))
    f = jnp.asarray(x["freqs"])
    plan = kernel_plan("pallas", *args[:5], rope=True)
    assert plan is not None and plan.rope
    want = oracle(x, lo, hi)
    check(pq_code_attention(*args, impl="pallas", rope_inv_freq=f), want, tol=5e-2)  # bf16 dots
    check(pq_code_attention(*args, impl="xla", rope_inv_freq=f), want)
    m = d // 8  # sub-spaces of 4 pairs need frequencies [M, 4]
    with pytest.raises(ValueError, match=rf"float32\[M={m}, P=4\]"):
        pq_code_attention(args[0], args[1][..., :m], args[2], jnp.ones((2, m, 256, 8)), args[4], args[5], args[6],
                          impl="xla", rope_inv_freq=jnp.ones((m,), jnp.float32))


_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    from million_jax.attention.pq_dispatch import KernelMesh, pq_code_attention
    rng = np.random.default_rng(3)
    b, h, hkv, d, n = 2, 4, 2, 32, 50
    q = rng.standard_normal((b, 1, h, d)).astype(np.float32)
    kc = rng.integers(0, 256, (b, hkv, n, 16)).astype(np.uint8)
    vc = rng.integers(0, 256, (b, hkv, n, 16)).astype(np.uint8)
    kb = rng.standard_normal((hkv, 16, 256, 2)).astype(np.float32)
    vb = rng.standard_normal((hkv, 16, 256, 2)).astype(np.float32)
    lo, hi = np.array([[0], [7]], np.int32), np.array([[50], [33]], np.int32)
    q, kc, vc, kb, vb, lo, hi = map(jnp.asarray, (q, kc, vc, kb, vb, lo, hi))
    f = jnp.asarray(1.0 / 10000 ** (np.arange(16) / 16), jnp.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    km = KernelMesh(mesh, batch_axes=("data",), kv_axes=("model",))
    # jitted: eagerly, shard_map runs the interpret-mode kernel op by op (~40 s instead of ~2 s)
    run = lambda **kw: jax.jit(lambda *a: pq_code_attention(*a, rope_inv_freq=f, **kw))(q, kc, vc, kb, vb, lo, hi)
    got = run(impl="pallas", mesh=km)
    one = run(impl="pallas")
    ref = run(impl="xla")
    print(float(jnp.max(jnp.abs(got[0] - one[0]))), float(jnp.max(jnp.abs(got[0] - ref[0]))))
""")


def test_pre_rope_kernel_under_shard_map_matches_one_device():
    """Batch and KV heads split over a (2, 2) mesh of CPU devices; inv_freq replicated."""
    r = subprocess.run([sys.executable, "-c", _SHARDED, ROOT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    same, vs_xla = map(float, r.stdout.split()[-2:])
    assert same < 1e-6 and vs_xla < 5e-2, (same, vs_xla)

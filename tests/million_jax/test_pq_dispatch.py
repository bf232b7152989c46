"""The kernel dispatch checks once and plans once per call, and tests the backend first.

Counting is done by wrapping the check / plan functions with monkeypatch; every test also
compares the result against an independent path on fresh random inputs.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_layer_step import attend_layer0
from million_jax.attention import pq_dispatch
from million_jax.attention.pq_xla import pq_attention_xla
from million_jax.cache.pq_cache import PQCache, PQLayer
from million_jax.quant.kv_codebooks import PQCodebooks
from pallas_kernels import pq_decode_attention, pq_decode_attention_reference

# the modules, not the function of the same name that pallas_kernels re-exports: the public
# entry (which checks a user's inputs) and the planner (which runs the kernel-support checks)
kernel_module = importlib.import_module("pallas_kernels.pq_decode_attention")
plan_module = importlib.import_module("pallas_kernels.pq_plan")

B, HKV, G, D, M, N = 2, 2, 2, 16, 8, 24


def _inputs(seed: int, nbits: int = 4):
    rng = np.random.default_rng(seed)
    k = 1 << nbits
    q = jnp.asarray(rng.normal(size=(B, 1, HKV * G, D)), jnp.float32)
    kb = jnp.asarray(rng.normal(size=(HKV, M, k, D // M)), jnp.float32)
    vb = jnp.asarray(rng.normal(size=(HKV, M, k, D // M)), jnp.float32)
    kc = jnp.asarray(rng.integers(0, k, size=(B, HKV, N, M)), jnp.uint8)
    vc = jnp.asarray(rng.integers(0, k, size=(B, HKV, N, M)), jnp.uint8)
    lo = jnp.asarray(rng.integers(0, 4, size=(B, 1)), jnp.int32)
    hi = jnp.asarray(rng.integers(8, N + 1, size=(B, 1)), jnp.int32)
    return q, kc, vc, kb, vb, lo, hi


def _count(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` so that each call is counted; returns the (one-element) counter."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _counters(monkeypatch) -> dict[str, list[int]]:
    return {
        "check_pq_inputs": _count(monkeypatch, kernel_module, "check_pq_inputs"),
        "plan": _count(monkeypatch, pq_dispatch, "plan_pq_kernel"),
        "kernel support": _count(monkeypatch, plan_module, "check_kernel_support"),
        "codes vs codebooks": _count(monkeypatch, PQLayer, "check_books"),
        "codes fit (public)": _count(monkeypatch, pq_dispatch, "check_code_fit"),
    }


def test_pallas_call_checks_nothing_twice_and_plans_once(monkeypatch):
    q, kc, vc, kb, vb, lo, hi = _inputs(0)
    want = pq_decode_attention_reference(q[:, 0], kc, vc, kb, vb, lo[:, 0], hi[:, 0])
    n = _counters(monkeypatch)
    out, lse = pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl="pallas")
    assert {k: v[0] for k, v in n.items()} == {
        "check_pq_inputs": 0, "plan": 1, "kernel support": 1,
        "codes vs codebooks": 0, "codes fit (public)": 1}
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(want[0]), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[:, 0]), np.asarray(want[1]), rtol=2e-2, atol=2e-2)


def test_public_kernel_checks_its_inputs_once(monkeypatch):
    q, kc, vc, kb, vb, lo, hi = _inputs(1)
    n = _counters(monkeypatch)
    got = pq_decode_attention(q[:, 0], kc, vc, kb, vb, lo[:, 0], hi[:, 0], interpret=True, precision="fp32")
    assert (n["check_pq_inputs"][0], n["kernel support"][0]) == (1, 1)
    want = pq_decode_attention_reference(q[:, 0], kc, vc, kb, vb, lo[:, 0], hi[:, 0])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit k_codes"):  # a user's bad input is still named
        pq_decode_attention(q[:, 0], kc[..., :-1], vc, kb, vb, lo[:, 0], hi[:, 0], interpret=True)


def test_cache_decode_checks_codebooks_once_and_plans_once(monkeypatch):
    """One decode step of a PQCache (impl='pallas'): codebooks checked once, in layer_consts,
    one launch planned, no input validation inside the kernel; equal to the xla cache."""
    rng = np.random.default_rng(2)
    books = PQCodebooks.from_centroids(rng.normal(size=(1, HKV, M, 16, D // M)).astype(np.float32),
                                       rng.normal(size=(1, HKV, M, 16, D // M)).astype(np.float32), num_layers=1)
    q, k = (jnp.asarray(rng.normal(size=(B, 5, h, D)), jnp.float32) for h in (HKV * G, HKV))
    outs = {}
    for impl in ("xla", "pallas"):
        cache = PQCache.create(1, B, HKV, 12, D, M=M, nbits=4, window=2, dtype=jnp.float32, impl=impl)
        _, cache = attend_layer0(cache, books, q[:, :4], k[:, :4], k[:, :4], jnp.asarray([4, 2], jnp.int32))
        with monkeypatch.context() as mp:
            n = _counters(mp)
            outs[impl], _ = attend_layer0(cache, books, q[:, 4:], k[:, 4:], k[:, 4:], jnp.ones((B,), jnp.int32))
        calls = {k: v[0] for k, v in n.items()}
    assert calls == {"check_pq_inputs": 0, "plan": 1, "kernel support": 1, "codes vs codebooks": 1,
                     "codes fit (public)": 0}
    np.testing.assert_allclose(np.asarray(outs["pallas"]), np.asarray(outs["xla"]), rtol=3e-2, atol=3e-2)


def test_public_entry_refuses_codes_that_do_not_fit_on_every_path():
    """pq_code_attention is public: mismatched codes are an error on the kernel path too."""
    q, kc, vc, kb, vb, lo, hi = _inputs(3)
    for impl in ("pallas", "xla"):
        with pytest.raises(ValueError, match="key codebook .* does not fit its codes"):
            pq_dispatch.pq_code_attention(q, kc[..., :-1], vc, kb, vb, lo, hi, impl=impl)


def test_public_entry_checks_rope_frequencies_on_every_path():
    """Per-head RoPE frequencies of pre-RoPE keys are checked on the kernel path too: a head count that
    is neither 1 nor Hkv, or a frequency <= 0, is an error by name (the kernel would read past its
    block or rotate silently wrong); valid per-head frequencies give the same answer on both paths."""
    rng = np.random.default_rng(4)
    m, k = 16, 16  # the kernel rotates pre-RoPE keys with M >= 16 sub-spaces (2-dim: one RoPE pair each)
    q = jnp.asarray(rng.normal(size=(B, 1, HKV * G, 2 * m)), jnp.float32)
    kb, vb = (jnp.asarray(rng.normal(size=(HKV, m, k, 2)), jnp.float32) for _ in range(2))
    kc, vc = (jnp.asarray(rng.integers(0, k, size=(B, HKV, N, m)), jnp.uint8) for _ in range(2))
    lo = jnp.asarray(rng.integers(0, 4, size=(B, 1)), jnp.int32)
    hi = jnp.asarray(rng.integers(8, N + 1, size=(B, 1)), jnp.int32)
    inv = jnp.asarray(np.geomspace(1.0, 1e-2, m)[None, :, None] * np.array([1.0, 0.5])[:, None, None], jnp.float32)
    for impl in ("pallas", "xla"):
        with pytest.raises(ValueError, match=r"rope_inv_freq must be .*per KV head.*got float32\[3, 16, 1\]"):
            pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl=impl,
                                          rope_inv_freq=jnp.concatenate([inv, inv[:1]]))
        with pytest.raises(ValueError, match="finite and > 0.*KV head 1, sub-space 0"):
            pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl=impl, rope_inv_freq=inv.at[1, 0, 0].set(-1.0))
    outs = [pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl=impl, rope_inv_freq=inv)[0]
            for impl in ("pallas", "xla")]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=3e-2, atol=3e-2)


def test_auto_off_gpu_never_computes_the_kernel_blocker(monkeypatch):
    if jax.default_backend() == "gpu":
        pytest.skip("impl='auto' on a GPU plans the kernel by design")

    def never(*args, **kwargs):
        raise AssertionError("impl='auto' off GPU looked at the kernel's shapes")

    for name in ("plan_pq_kernel", "pq_dims"):
        monkeypatch.setattr(pq_dispatch, name, never)
    monkeypatch.setattr(plan_module, "check_kernel_support", never)
    q, kc, vc, kb, vb, lo, hi = _inputs(3)
    assert pq_dispatch.kernel_plan("auto", q, kc, vc, kb, vb) is None
    got = pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl="auto")
    want = pq_attention_xla(q, kc, vc, kb, vb, lo, hi)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    # also where the kernel could not run at all (uint16 codes): still no planning, the xla path
    wide = pq_dispatch.pq_code_attention(q, kc.astype(jnp.uint16), vc.astype(jnp.uint16), kb, vb, lo, hi)
    np.testing.assert_array_equal(np.asarray(wide[0]), np.asarray(want[0]))


def test_pallas_names_why_the_kernel_cannot_run():
    q, kc, vc, kb, vb, lo, hi = _inputs(4)
    with pytest.raises(ValueError, match="impl='pallas' cannot run: the Pallas PQ kernel reads uint8 codes"):
        pq_dispatch.pq_code_attention(q, kc.astype(jnp.uint16), vc, kb, vb, lo, hi, impl="pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        pq_dispatch.pq_code_attention(q, kc, vc, kb, vb, lo, hi, impl="triton")
    # prefill (T > 1) never takes the kernel, whatever impl says
    q3 = jnp.concatenate([q] * 3, axis=1)
    lo3, hi3 = jnp.repeat(lo, 3, axis=1), jnp.repeat(hi, 3, axis=1)
    assert pq_dispatch.kernel_plan("pallas", q3, kc, vc, kb, vb) is None
    np.testing.assert_array_equal(
        np.asarray(pq_dispatch.pq_code_attention(q3, kc, vc, kb, vb, lo3, hi3, impl="pallas")[0]),
        np.asarray(pq_attention_xla(q3, kc, vc, kb, vb, lo3, hi3)[0]))

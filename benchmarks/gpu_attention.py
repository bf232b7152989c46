"""PQ decode-attention kernel vs bf16 dense decode attention on one GPU (H200), one run.

Installs nothing. Steps:
  1. device copy bandwidth (x -> x + 1 on a large array; bytes read + written per second);
  2. correctness of the Pallas kernel against the jnp reference on this device (both key
     paths, both precisions, ragged lengths, GQA 3 and 4) -- rows with impl "check:*";
  3. timings at contexts 4K..128K, batch 1 and 8, LLaMA-2-7B (32 q / 32 kv heads, d 128) and
     LLaMA-3.1-8B (32 / 8, d 128) head shapes, M = 64, nbits = 8 (4 bits / element), and
     the LLaMA-3.1-8B shape with 6-bit codes packed at their real width (3 bits / element,
     4 codes in 3 bytes, unpacked in the kernel), and Gemma 3's global layers (4 / 1 heads,
     d 256, M 128: the wide-head launch defaults), and TurboQuant 4-bit codes at the LLaMA-3.1-8B
     and Gemma 3 global shapes (M = d one-dim sub-spaces packed two per byte, a bf16 norm per
     token as key / value scale: the same kernel, 4.125 / 4.0625 bits per element read):
       pq          the Pallas kernel (default launch config, + any --variant)
       pq-pre      the same with keys quantized before RoPE (rope_inv_freq: each key pair
                   rotated in the kernel at its position; --rope post|pre|both, default both)
       bf16-xla    dense bf16 K/V, einsum + fp32 softmax + einsum (XLA)
       bf16-cudnn  jax.nn.dot_product_attention(implementation="cudnn") where it runs
     Each time is the mean of N calls inside one jitted fori_loop (no dispatch overhead; the
     query depends on the previous output so nothing is hoisted); when one cache copy fits
     in L2, calls rotate over several copies so reads come from HBM.
Reports achieved GB/s of cache bytes read (PQ: K+V codes; dense: K+V bf16), % of the
measured copy bandwidth, and speedup = best bf16 time / PQ time at the same shape.
Writes <out>/gpu_attention_<date>.json (a list of row dicts) and .md; rewritten after each
shape, so a run cut short still leaves its rows.

  python benchmarks/gpu_attention.py                       # full run on the GPU
  python benchmarks/gpu_attention.py --tiny --out /tmp/r   # CPU smoke test (interpret mode)
  python benchmarks/gpu_attention.py --contexts 32768 --batches 1 \
      --variant bt128:block_t=128 --variant w8:num_warps=8 --variant lut:key_path=lut
  python benchmarks/gpu_attention.py --rope pre --variant bt16:block_t=16 --variant bt64w8:block_t=64,num_warps=8
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._gpu_common import copy_bandwidth, gpu_parser, today, warn_if_no_gpu, write_json_md  # noqa: E402
from pallas_kernels import pq_decode_attention, pq_decode_attention_reference  # noqa: E402
from pallas_kernels.code_packing import pack_codes, stored_width  # noqa: E402

L2_BYTES = 50 * 2**20  # H100 / H200 L2
MIN_HBM_BYTES = 2 * L2_BYTES  # rotate cache copies until one loop step touches this much
MAX_COPIES = 32


@dataclasses.dataclass(frozen=True)
class HeadShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_subspaces: int
    nbits: int = 8
    token_scales: bool = False  # TurboQuant codes: dsub 1, a bf16 norm per token as key / value scale


FULL_SHAPES = [HeadShape("llama2-7b", 32, 32, 128, 64), HeadShape("llama3.1-8b", 32, 8, 128, 64),
               HeadShape("llama3.1-8b-6bit", 32, 8, 128, 64, nbits=6),
               HeadShape("gemma3-global", 4, 1, 256, 128),
               HeadShape("llama3.1-8b-tq4", 32, 8, 128, 128, nbits=4, token_scales=True),
               HeadShape("gemma3-global-tq4", 4, 1, 256, 256, nbits=4, token_scales=True)]
TINY_SHAPES = [HeadShape("tiny-mha", 4, 4, 64, 32), HeadShape("tiny-gqa", 4, 2, 64, 32),
               HeadShape("tiny-gqa-6bit", 4, 2, 64, 32, nbits=6),
               HeadShape("tiny-gqa-tq4", 4, 2, 64, 64, nbits=4, token_scales=True)]
KNOB_TYPES = {"block_t": int, "num_splits": int, "num_warps": int, "num_stages": int,
              "key_path": str, "precision": str}


# ----------------------------------------------------------------------------- timing


def time_per_call(step: Callable[..., jax.Array], q: jax.Array, operands: Any, *, tiny: bool) -> float:
    """Mean seconds of `step(q, i, operands) -> new q`, run N times inside one jitted loop.

    The operands (caches) are jit arguments, not closed-over constants.
    """

    @jax.jit
    def loop(q0, ops, n):
        return jax.lax.fori_loop(0, n, lambda i, qq: step(qq, i, ops), q0)

    jax.block_until_ready(loop(q, operands, 2))  # compile + warm-up
    n = 2
    while True:
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q, operands, n))
        dt = time.perf_counter() - t0
        if tiny or dt > 0.2 or n >= 4096:
            return dt / n
        n = min(4096, max(2 * n, int(n * 0.3 / max(dt, 1e-6))))


def rotating(fn: Callable[[jax.Array, Any], jax.Array], num_copies: int) -> Callable[..., jax.Array]:
    """step(q, i, copies) calling fn(q, copies[i % num_copies]) (reads differ from call to call)."""

    def step(q, i, copies):
        if num_copies == 1:
            return fn(q, copies[0])
        branches = [lambda qq, cc, c=c: fn(qq, cc[c]) for c in range(num_copies)]
        return jax.lax.switch(i % num_copies, branches, q, copies)

    return step


def _next_q(q: jax.Array, out: jax.Array) -> jax.Array:
    return q + (1e-3 * out).astype(q.dtype).reshape(q.shape)


# ----------------------------------------------------------------------------- impls


def make_pq_cache(key, b, shape: HeadShape, t, copies, cb_dtype):
    k = 2**shape.nbits
    m, d, hkv = shape.num_subspaces, shape.head_dim, shape.num_kv_heads
    ks = jax.random.split(key, 2 * copies + 2)
    def rand_codes(kk):
        bits = jax.random.bits(kk, (b, hkv, t, m), jnp.uint8)
        return bits if k == 256 else pack_codes(bits % jnp.uint8(k), shape.nbits)  # stored at real width

    def rand_scales(kk):  # TurboQuant's per-token norms (bf16), or nothing
        return jax.random.uniform(kk, (b, hkv, t), jnp.float32, 0.5, 2.0).astype(jnp.bfloat16)

    codes = [(rand_codes(ks[2 * c]), rand_codes(ks[2 * c + 1]))
             + ((rand_scales(jax.random.fold_in(ks[2 * c], 1)), rand_scales(jax.random.fold_in(ks[2 * c + 1], 1)))
                if shape.token_scales else ()) for c in range(copies)]
    kcb = jax.random.normal(ks[-2], (1, m, k, d // m), jnp.float32).astype(cb_dtype)
    vcb = jax.random.normal(ks[-1], (1, m, k, d // m), jnp.float32).astype(cb_dtype)
    return codes, kcb, vcb


def dense_xla(q, kk, vv, lengths):
    """bf16 dense decode: q [B, H, d], K/V [B, Hkv, T, d] -> [B, H, d]."""
    b, h, d = q.shape
    hkv, t = kk.shape[1], kk.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    s = jnp.einsum("bgqd,bgtd->bgqt", qg, kk, preferred_element_type=jnp.float32) / math.sqrt(d)
    s = jnp.where(jnp.arange(t)[None, None, None, :] < lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgqt,bgtd->bgqd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
    return o.reshape(b, h, d)


def dense_cudnn(q, kk, vv, lengths):
    """q [B, H, d]; K/V in cuDNN's [B, T, Hkv, d] layout."""
    o = jax.nn.dot_product_attention(
        q[:, None], kk, vv, implementation="cudnn",
        query_seq_lengths=jnp.ones_like(lengths), key_value_seq_lengths=lengths,
    )
    return o[:, 0]


def bench_shape(args, shape: HeadShape, b: int, t: int, variants, copy_bw, device) -> list[dict]:
    key = jax.random.PRNGKey(t * 31 + b)
    h, hkv, d, m = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.num_subspaces
    q = jax.random.normal(key, (b, h, d), jnp.bfloat16)
    lengths = jnp.full((b,), t, jnp.int32)
    zeros = jnp.zeros((b,), jnp.int32)
    pq_bytes = 2 * b * hkv * t * (stored_width(m, shape.nbits) + (2 if shape.token_scales else 0))
    dense_bytes = 2 * b * hkv * t * d * 2
    rows, times = [], {}

    def row(impl, seconds, nbytes, **extra):
        gbps = nbytes / seconds / 1e9
        r = dict(context=t, batch=b, shape=shape.name, pq_nbits=shape.nbits, impl=impl, seconds=seconds, gbps=gbps,
                 pct_copy_bw=100 * gbps * 1e9 / copy_bw, cache_bytes=nbytes, device=device,
                 speedup=None, **extra)
        rows.append(r)
        times[impl] = seconds
        print(f"  {shape.name:12s} T={t:7d} B={b} {impl:28s} {seconds * 1e6:10.1f} us "
              f"{gbps:8.1f} GB/s {r['pct_copy_bw']:5.1f}% copy", flush=True)

    copies = args.copies or (1 if args.tiny else max(1, min(MAX_COPIES, -(-MIN_HBM_BYTES // pq_bytes))))
    codes, kcb, vcb = make_pq_cache(key, b, shape, t, copies, jnp.dtype(args.codebook_dtype))
    freqs = rope_freqs(shape)
    ropes = [r for r in ("post", "pre") if args.rope in (r, "both")]
    if freqs is None:
        ropes = [r for r in ropes if r == "post"]  # pre-RoPE keys need dsub = 2
    for rope, (name, knobs) in ((r, v) for r in ropes for v in variants):
        if rope == "pre":
            if knobs.get("key_path", "centroid") != "centroid":
                continue  # the kernel takes pre-RoPE keys on the centroid path only
            name = name.replace("pq", "pq-pre", 1)
        fn = functools.partial(_pq_step, kcb=kcb, vcb=vcb, start=zeros, end=lengths,
                               knobs=knobs, interpret=args.tiny, rope_inv_freq=freqs if rope == "pre" else None)
        try:
            sec = time_per_call(rotating(fn, len(codes)), q, codes, tiny=args.tiny)
            row(name, sec, pq_bytes, knobs=knobs, copies=len(codes), key_rope=rope)
        except Exception as e:  # noqa: BLE001 - report and go on with the other impls
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    del codes

    copies = args.copies or (1 if args.tiny else max(1, min(MAX_COPIES, -(-MIN_HBM_BYTES // dense_bytes))))
    dense_impls = [("bf16-xla", dense_xla, "bght")]
    if not args.tiny or args.try_cudnn:
        dense_impls.append(("bf16-cudnn", dense_cudnn, "btgh"))
    for impl, fn, layout in dense_impls:
        try:
            kvs = []
            for c in range(copies):
                k1, k2 = jax.random.split(jax.random.fold_in(key, 100 + c))
                shp = (b, hkv, t, d) if layout == "bght" else (b, t, hkv, d)
                kvs.append((jax.random.normal(k1, shp, jnp.bfloat16), jax.random.normal(k2, shp, jnp.bfloat16)))
            step = rotating(lambda qq, kv, fn=fn: _next_q(qq, fn(qq, kv[0], kv[1], lengths)), len(kvs))
            sec = time_per_call(step, q, kvs, tiny=args.tiny)
            row(impl, sec, dense_bytes, copies=len(kvs))
        except Exception as e:  # noqa: BLE001 - cuDNN may not take this shape / device
            print(f"  {impl}: not run ({type(e).__name__}: {str(e)[:200]})", flush=True)
        finally:
            kvs = None

    dense_best = min([v for k, v in times.items() if k.startswith("bf16")], default=None)
    for r in rows:
        if not r["impl"].startswith("bf16") and dense_best is not None:
            r["speedup"] = dense_best / r["seconds"]
            r["dense_best_impl"] = min((k for k in times if k.startswith("bf16")), key=times.get)
    return rows


def rope_freqs(shape: HeadShape) -> jax.Array | None:
    """LLaMA-3 RoPE frequencies (theta 500000) of the shape's M pairs; None unless dsub = 2."""
    if shape.head_dim != 2 * shape.num_subspaces:
        return None
    m = shape.num_subspaces
    return jnp.asarray(1.0 / 500000.0 ** (np.arange(m) / m), jnp.float32)


def _pq_step(q, codes, *, kcb, vcb, start, end, knobs, interpret, rope_inv_freq=None):
    kc, vc = codes[:2]
    extra = {} if rope_inv_freq is None else dict(rope_inv_freq=rope_inv_freq)
    if len(codes) == 4:  # TurboQuant: per-token key / value scales
        extra.update(k_scales=codes[2], v_scales=codes[3])
    out, _ = pq_decode_attention(q, kc, vc, kcb, vcb, start, end, interpret=interpret, **knobs, **extra)
    return _next_q(q, out)


# ----------------------------------------------------------------------------- checks


def correctness_checks(args, device) -> list[dict]:
    """Kernel vs reference on this device at a few shapes; rows with impl 'check:...'."""
    rows = []
    cases = [  # (name, B, H, Hkv, d, M, nbits, T, G, codes packed[, per-token scales])
        ("gqa4-d128", 3, 32, 8, 128, 64, 8, 5000, 8, False),
        ("gqa3-d64", 2, 9, 3, 64, 32, 8, 777, 1, False),
        ("mha-nbits4", 2, 8, 8, 128, 32, 4, 1000, 1, False),
        ("gqa4-packed4", 2, 32, 8, 128, 64, 4, 3000, 8, True),
        ("gqa3-packed6", 3, 9, 3, 64, 32, 6, 777, 1, True),
        ("gqa4-packed12", 2, 32, 8, 128, 32, 12, 2000, 1, True),
        ("tq4-d128", 3, 32, 8, 128, 128, 4, 3000, 1, True, True),
        ("tq3-d256", 2, 4, 1, 256, 256, 3, 3000, 1, True, True),
    ]
    if args.tiny:
        cases = [("tiny-gqa3", 2, 6, 2, 64, 32, 8, 70, 1, False), ("tiny-packed6", 2, 6, 2, 64, 32, 6, 70, 1, True),
                 ("tiny-tq4", 2, 6, 2, 64, 64, 4, 70, 1, True, True)]
    for name, b, h, hkv, d, m, nbits, t, g, packed, *scaled in cases:
        rng = np.random.default_rng(0)
        k = 2**nbits
        store = (lambda c: pack_codes(c, nbits)) if packed else (lambda c: c)  # noqa: E731
        inputs = dict(
            q=jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16),
            k_codes=store(jnp.asarray(rng.integers(0, k, (b, hkv, t, m)), jnp.uint8 if nbits <= 8 else jnp.uint16)),
            v_codes=store(jnp.asarray(rng.integers(0, k, (b, hkv, t, m)), jnp.uint8 if nbits <= 8 else jnp.uint16)),
            k_codebooks=jnp.asarray(rng.standard_normal((g, m, k, d // m)), jnp.float32),
            v_codebooks=jnp.asarray(rng.standard_normal((g, m, k, d // m)), jnp.float32),
            start=jnp.asarray([0, 3, 0][:b], jnp.int32),
            end=jnp.asarray([t, 4, t // 2 + 1][:b], jnp.int32),  # ragged, one length-1 row
        )
        if scaled and scaled[0]:  # TurboQuant-style per-token norms
            inputs.update(k_scales=jnp.asarray(rng.uniform(0.5, 2.0, (b, hkv, t)), jnp.bfloat16),
                          v_scales=jnp.asarray(rng.uniform(0.5, 2.0, (b, hkv, t)), jnp.bfloat16))
        freqs = jnp.asarray(1.0 / 500000.0 ** (np.arange(m) / m), jnp.float32) if d == 2 * m else None
        paths = [(kp, None) for kp in ("centroid", "lut")] + ([("pre-rope", freqs)] if freqs is not None else [])
        for key_path, rope_inv_freq in paths:
            rope = {} if rope_inv_freq is None else dict(rope_inv_freq=rope_inv_freq)
            ref_out, ref_lse = jax.jit(pq_decode_attention_reference)(**inputs, **rope)
            for precision in ("bf16", "fp32"):
                fn = jax.jit(functools.partial(pq_decode_attention, key_path="centroid" if rope else key_path,
                                               precision=precision, interpret=args.tiny))
                try:
                    out, lse = fn(**inputs, **rope)
                    err = float(jnp.max(jnp.abs(out - ref_out)))
                    same_inf = jnp.isneginf(lse) & jnp.isneginf(ref_lse)
                    lse_err = float(jnp.max(jnp.where(same_inf, 0.0, jnp.abs(lse - ref_lse))))
                    tol = 5e-2 if precision == "bf16" else 1e-3
                    ok = bool(err < tol and lse_err < tol and not bool(jnp.isnan(out).any()))
                    status = "ok" if ok else "MISMATCH"
                except Exception as e:  # noqa: BLE001
                    err = lse_err = float("nan")
                    ok, status = False, f"FAILED {type(e).__name__}: {str(e)[:300]}"
                impl = f"check:{name}:{key_path}:{precision}"
                print(f"  {impl:40s} max|out err| {err:.2e} max|lse err| {lse_err:.2e} {status}", flush=True)
                rows.append(dict(context=t, batch=b, shape=name, impl=impl, seconds=None, gbps=None,
                                 speedup=None, device=device, max_abs_err=err, max_lse_err=lse_err,
                                 ok=ok, status=status))
    return rows


# ----------------------------------------------------------------------------- output


def write_results(rows: list[dict], meta: dict, out_dir: str, stamp: str) -> str:
    lines = [f"# PQ decode attention vs bf16 dense ({meta['device']})", "",
             f"jax {meta['jax']}, copy bandwidth {meta['copy_gbps']:.0f} GB/s (read + write), "
             f"M={meta['M']}, nbits={meta['nbits']}, codebooks {meta['codebook_dtype']}, {meta['date']}", ""]
    checks = [r for r in rows if r["impl"].startswith("check:")]
    if checks:
        lines += ["| check | max abs err (out) | max abs err (lse) | status |", "|---|---|---|---|"]
        lines += [f"| {r['impl'][6:]} | {r['max_abs_err']:.2e} | {r['max_lse_err']:.2e} | {r['status']} |"
                  for r in checks]
        lines.append("")
    lines += ["| shape | batch | context | impl | us | GB/s | % copy BW | speedup vs best bf16 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["seconds"] is None:
            continue
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['impl']} | "
                     f"{r['seconds'] * 1e6:.1f} | {r['gbps']:.0f} | {r['pct_copy_bw']:.1f} | {sp} |")
    lines += ["", "GB/s counts cache bytes read (PQ: key + value codes; dense: bf16 K + V). "
              "Small caches may partly hit L2 despite rotating copies (see `copies` in the JSON)."]
    return write_json_md(out_dir, "gpu_attention", stamp, rows, lines)


def parse_variant(spec: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> ('pq[name]', knobs)."""
    name, _, body = spec.partition(":")
    knobs = {}
    for item in filter(None, body.split(",")):
        k, _, v = item.partition("=")
        if k not in KNOB_TYPES:
            raise SystemExit(f"unknown knob {k!r} in --variant {spec!r}; known: {sorted(KNOB_TYPES)}")
        knobs[k] = KNOB_TYPES[k](v)
    return f"pq[{name}]", knobs


def main(argv: list[str] | None = None) -> int:
    p = gpu_parser(__doc__, "tiny shapes, interpret mode (CPU smoke test)")
    p.add_argument("--shapes", nargs="*", default=None, help="subset of shape names")
    for k, typ in KNOB_TYPES.items():
        p.add_argument("--" + k.replace("_", "-"), type=typ, default=None, help=f"default-row {k}")
    p.add_argument("--variant", action="append", default=[], help="extra PQ row, NAME:knob=v,...")
    p.add_argument("--codebook-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="codebooks as the cache would pass them (bf16: half the gather bytes)")
    p.add_argument("--copies", type=int, default=None,
                   help="cache copies to rotate over (default: enough to exceed 2x L2; 1 with --tiny)")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--rope", default="both", choices=["post", "pre", "both"],
                   help="PQ rows with keys quantized after RoPE (post), before (pre, rotated in the kernel), or both")
    p.add_argument("--try-cudnn", action="store_true", help="also try cuDNN in --tiny mode")
    args = p.parse_args(argv)

    device = jax.devices()[0].device_kind
    warn_if_no_gpu(args.tiny)
    shapes = TINY_SHAPES if args.tiny else FULL_SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s.name in args.shapes]
    contexts = args.contexts or ([64, 200] if args.tiny else [4096, 16384, 32768, 65536, 131072])
    batches = args.batches or ([1, 2] if args.tiny else [1, 8])
    base_knobs = {k: getattr(args, k) for k in KNOB_TYPES if getattr(args, k) is not None}
    variants = [("pq", base_knobs)] + [parse_variant(v) for v in args.variant]
    stamp = today()

    copy_bw = copy_bandwidth(args.tiny)
    print(f"device {device}, jax {jax.__version__}, copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    meta = dict(device=device, jax=jax.__version__, copy_gbps=copy_bw / 1e9, M=shapes[0].num_subspaces,
                nbits=sorted({sh.nbits for sh in shapes}), codebook_dtype=args.codebook_dtype, date=stamp)
    rows: list[dict[str, Any]] = []
    if not args.skip_checks:
        rows += correctness_checks(args, device)
        write_results(rows, meta, args.out, stamp)
    for shape in shapes:
        for b in batches:
            for t in contexts:
                rows += bench_shape(args, shape, b, t, variants, copy_bw, device)
                base = write_results(rows, meta, args.out, stamp)
    base = write_results(rows, meta, args.out, stamp)
    print(f"wrote {base}.json and {base}.md", flush=True)
    bad = [r["impl"] for r in rows if r["impl"].startswith("check:") and not r["ok"]]
    if bad:
        print(f"CORRECTNESS CHECKS FAILED: {bad}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

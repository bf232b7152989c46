"""Compile the PQ kernel's Triton IR to sm_90a PTX/SASS on a CPU-only machine (dev tool).

`jax.export` (see `cuda_export.export_for_cuda`) runs Pallas -> Triton IR (TTIR) only; Triton's
own passes (layouts, pipelining, MMA selection) and ptxas run at XLA compile time on the
GPU. This tool goes the rest of the way without a GPU: it captures the TTIR that Pallas
emits, compiles it with the `triton` pip package (which bundles LLVM and ptxas) for an H100 /
H200 (sm_90a), and reports registers, spills, shared memory and the memory / MMA
instruction mix. The `triton` package may live in another Python (`--triton-python`): it is
not a project dependency. Caveat: jaxlib bundles its own Triton build; pip's version differs,
so this approximates what the GPU's XLA will do (it caught nothing yet that export missed,
but it gives register and shared-memory budgets for choosing launch defaults).

  python tests/pallas_kernels/triton_compile_check.py --triton-python /tmp/tritonvenv/bin/python
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cuda_export import export_for_cuda
from pallas_kernels.code_packing import stored_width

__all__ = ["capture_ttir", "compile_ttir", "launch_of", "report", "rope_kernel"]

_COMPILE_SCRIPT = r"""
import collections, json, os, re, subprocess, sys, tempfile
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as tcompile
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = tcompile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=ns))
ptx = k.asm["ptx"]
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ptx)
for exe in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newest PTX versions
    r = subprocess.run([os.path.join(bindir, exe), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    if r.returncode == 0:
        break
os.unlink(f.name)
info = r.stdout + r.stderr
if r.returncode != 0:
    sys.exit("ptxas failed: " + info[-2000:])
num = lambda pat: int(m.group(1)) if (m := re.search(pat, info)) else 0
ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:ld\.global|cp\.async\.c[ag]|mma|wgmma)[\w\.]*)", ptx, re.M))
print(json.dumps(dict(triton=triton.__version__, regs=num(r"Used (\d+) registers"),
      spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
      stack=num(r"(\d+) bytes cumulative stack size"), shared=k.metadata.shared, ptx_ops=dict(ops),
      ptxas_ok=r.returncode == 0)))
"""


def capture_ttir(fn: Callable[..., Any], *args: Any) -> list[str]:
    """Triton IR (text) of every Pallas Triton kernel in `fn(*args)`, via a CUDA export."""
    from jax._src.pallas.triton import lowering  # private: the hook point of the lowering

    captured: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(*a: Any, **k: Any) -> Any:
        result = original(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        export_for_cuda(fn, *args)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured


def compile_ttir(ttir: str, num_warps: int, num_stages: int, triton_python: str = sys.executable) -> dict:
    """Compiles TTIR for sm_90a with `triton` in `triton_python`; returns the resource report."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        r = subprocess.run([triton_python, "-c", _COMPILE_SCRIPT, path, str(num_warps), str(num_stages)],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"Triton compile failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _specs(b: int, h: int, hkv: int, d: int, m: int, t: int, nbits: int = 8, g: int = 1) -> tuple:
    """Kernel inputs; codes of nbits != 8 packed at their real width."""
    s = jax.ShapeDtypeStruct
    k = 2**nbits
    w = stored_width(m, nbits)
    return (s((b, h, d), jnp.bfloat16), s((b, hkv, t, w), jnp.uint8), s((b, hkv, t, w), jnp.uint8),
            s((g, m, k, d // m), jnp.float32), s((g, m, k, d // m), jnp.float32),
            s((b,), jnp.int32), s((b,), jnp.int32))


SHAPES = {
    "llama2-mha": _specs(1, 32, 32, 128, 64, 32768),
    "llama3-gqa4": _specs(1, 32, 8, 128, 64, 32768),
    "smollm2-gqa3-d64": _specs(1, 9, 3, 64, 32, 32768),
    # packed codes: 2 b/elem (4-bit, dsub 2), 3 b/elem (6-bit, dsub 2; 12-bit, dsub 4)
    "llama3-gqa4-4bit": _specs(1, 32, 8, 128, 64, 32768, nbits=4),
    "llama3-gqa4-6bit": _specs(1, 32, 8, 128, 64, 32768, nbits=6),
    "llama3-gqa4-12bit": _specs(1, 32, 8, 128, 32, 32768, nbits=12),
    # Gemma 3 global layers: 4 query heads on 1 KV head, d 256; M 128 (dsub 2) or 64 (dsub 4)
    "gemma3-gqa4-d256": _specs(1, 4, 1, 256, 128, 32768),
    "gemma3-gqa4-d256-M64": _specs(1, 4, 1, 256, 64, 32768),
    "gemma3-gqa4-d256-4bit": _specs(1, 4, 1, 256, 128, 32768, nbits=4),
    "gemma3-gqa4-d256-6bit": _specs(1, 4, 1, 256, 128, 32768, nbits=6),
}


def rope_kernel(args: tuple, knobs: dict) -> tuple[Callable[..., Any], tuple, dict]:
    """(fn, args, launch knobs) of the kernel; knobs["rope"] True: pre-RoPE keys (rope_inv_freq
    float32[M] as one more argument). Unset knobs take the kernel's defaults for the shape."""
    from pallas_kernels.pq_decode_attention import pq_decode_attention

    knobs = dict(knobs)
    if not knobs.pop("rope", False):
        return functools.partial(pq_decode_attention, **knobs), args, knobs
    fn = lambda *a: pq_decode_attention(*a[:-1], rope_inv_freq=a[-1], **knobs)  # noqa: E731
    return fn, args + (jax.ShapeDtypeStruct((args[3].shape[1],), jnp.float32),), knobs


def launch_of(args: tuple, knobs: dict) -> Any:
    """The `LaunchConfig` the kernel uses for inputs ``args`` and ``knobs`` (knob "rope": pre-RoPE
    keys): the warps / stages that its TTIR must be compiled with."""
    from pallas_kernels.launch import default_launch_config

    b, hkv, t, _ = args[1].shape
    return default_launch_config(b, hkv, t, key_path=knobs.get("key_path", "centroid"), head_dim=args[0].shape[-1],
                                 rope=bool(knobs.get("rope")),
                                 **{k: knobs.get(k) for k in ("block_t", "num_splits", "num_warps", "num_stages")})


def report(
    knob_sets: Sequence[dict], shapes: Sequence[str], triton_python: str
) -> list[dict]:
    """Compile report rows for each (shape, knob set); knob "rope": True = pre-RoPE keys."""
    rows = []
    for shape in shapes:
        for knob_set in knob_sets:
            fn, args, _ = rope_kernel(SHAPES[shape], knob_set)
            (ttir,) = capture_ttir(fn, *args)
            cfg = launch_of(SHAPES[shape], knob_set)
            res = compile_ttir(ttir, cfg.num_warps, cfg.num_stages, triton_python)
            rows.append(dict(shape=shape, knobs=knob_set, block_t=cfg.block_t, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, **res))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton-python", default=sys.executable, help="a Python with the `triton` package")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also block_t / warps / stages / key_path variants")
    p.add_argument("--rope", action="store_true", help="also pre-RoPE keys (rope_inv_freq), default and swept knobs")
    args = p.parse_args(argv)
    knob_sets: list[dict] = [{}]
    if args.rope:
        knob_sets += [dict(rope=True)] + [dict(rope=True, block_t=bt, num_warps=w, num_stages=s)
                                          for bt, w, s in ((64, 4, 2), (32, 4, 3), (64, 8, 2), (16, 4, 2), (16, 8, 1))]
    if args.sweep:
        knob_sets += [dict(block_t=bt, num_warps=w, num_stages=s)
                      for bt in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]
        knob_sets += [dict(key_path="lut", block_t=bt, num_warps=w) for bt in (16, 32, 64) for w in (4, 8)]
        knob_sets += [dict(precision="fp32")]
    print(f"{'shape':18s} {'knobs':50s} {'regs':>4s} {'spill':>5s} {'smem':>6s}  ops")
    for r in report(knob_sets, args.shapes, args.triton_python):
        knobs = json.dumps(r["knobs"]) + f" -> bt={r['block_t']} w={r['num_warps']} s={r['num_stages']}"
        print(f"{r['shape']:18s} {knobs:50s} {r['regs']:4d} {r['spill_stores']:5d} {r['shared']:6d}  {r['ptx_ops']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV-cache bytes and maximum context per device for a LLaMA-2-7B-shaped model on a device mesh.

    python benchmarks/sharding_memory.py \\
        --json benchmarks/results/sharding_memory_cpu.json --md benchmarks/results/sharding_memory_cpu.md

For every mesh shape (data x model) and cache kind (dense bf16, PQ M=64
nbits=8 with layer_head codebooks, KIVI-style uniform 4-bit) this compiles the
sharded, cache-donating decode step of ``models.decode_step`` on 8 fake CPU
devices, with params, cache and codebooks given only as sharded
ShapeDtypeStructs (``jax.eval_shape``; no weight is ever materialised), and
reads the per-device memory from ``compiled.memory_analysis()``:

    peak(T) = arguments + outputs - aliased (donated cache) + temporaries

Each data-parallel replica holds one sequence (global batch = data axis size).
peak(T) is compiled at two context lengths; the fitted line gives the
predicted largest ``T_max`` (a multiple of 512, the attention tile) under the
budget, which is then compiled again (stepping down until it fits) and
reported with the compiled peak; ``T_max + 512`` is compiled to confirm it
does not fit. Cache bytes per device are the shard sizes of the cache arrays.

XLA:CPU has no bf16 matmul: it converts bf16 weights to f32, and its
loop-invariant code motion would hoist that conversion of all 32 stacked
layers out of the layer loop (3.3 GB/device of temporaries a GPU build does
not have). The pass is disabled here, so the conversion stays per layer; the
rest of it (about one layer of f32 weights) stays in the temporaries as a
conservative margin. Other temporaries also follow XLA:CPU's fusion
decisions, not the GPU's.
"""
from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("run sharding_memory.py as a script: it must set XLA_FLAGS before jax is imported")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_disable_hlo_passes=while-loop-invariant-code-motion").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from million_jax import sharding as S  # noqa: E402
from million_jax.cache.dense import DenseCache  # noqa: E402
from million_jax.cache.pq_cache import PQCache, PQCodebooks  # noqa: E402
from million_jax.cache.spec import CACHE_KINDS as KINDS  # noqa: E402
from million_jax.cache.uniform_cache import UniformCache  # noqa: E402
from million_jax.quant.pq import Codebooks  # noqa: E402
from models import LlamaConfig, decode_step, init_params, preset  # noqa: E402

GIB = 1024 ** 3
TILE = 512
KIND_LABEL = {"dense": "dense bf16", "pq": "PQ M=64 8-bit", "uniform": "KIVI int4 g32"}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark point: model, cache kind, mesh shape and the cache's window / sinks."""

    config: LlamaConfig
    kind: str
    mesh_shape: tuple[int, int]
    window: int
    sinks: int

    @property
    def batch(self) -> int:
        return self.mesh_shape[0]

    def cache(self, t_max: int) -> tuple[Any, Any]:
        """(abstract cache, abstract codebooks or None) for context length t_max."""
        c = self.config
        shape = (c.n_layers, self.batch, c.n_kv_heads, t_max, c.head_dim)
        if self.kind == "dense":
            return jax.eval_shape(lambda: DenseCache.create(*shape, jnp.bfloat16)), None
        if self.kind == "pq":
            cache = jax.eval_shape(lambda: PQCache.create(*shape, M=64, nbits=8, window=self.window,
                                                          sinks=self.sinks, impl="xla"))
            cb = Codebooks(jax.ShapeDtypeStruct((c.n_layers, c.n_kv_heads, 64, 256, c.head_dim // 64),
                                                jnp.float32))
            return cache, PQCodebooks(cb, cb, "layer_head")
        if self.kind == "uniform":
            return jax.eval_shape(lambda: UniformCache.create(*shape, bits=4, group_size=32, mode="kivi",
                                                              window=self.window, sinks=self.sinks)), None
        raise ValueError(self.kind)


def shard_bytes(tree: Any, mesh: jax.sharding.Mesh, rules: S.Rules) -> int:
    """Bytes of one device's shards of every leaf of an abstract tree."""
    if tree is None:
        return 0
    leaves = jax.tree.leaves(tree)
    shardings = jax.tree.leaves(S.tree_shardings(tree, mesh, rules),
                                is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    return sum(int(np.prod(sh.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
               for x, sh in zip(leaves, shardings))


def compile_step(setup: Setup, t_max: int, params: Any) -> dict[str, Any]:
    """Compile the sharded decode step at context t_max; per-device memory in bytes."""
    mesh = S.make_mesh(setup.mesh_shape)
    rules = S.rules_for(mesh, setup.config)
    cache, books = setup.cache(t_max)
    tok = jax.ShapeDtypeStruct((setup.batch,), jnp.int32)

    def step(p, c, t, b):
        return decode_step(setup.config, p, c, t, b)

    out = jax.eval_shape(step, params, cache, tok, books)
    fn = S.sharded_jit(step, mesh, in_trees=(params, cache, None, books), out_tree=(None, out[1]),
                       donate_argnums=1, rules=rules)
    tok = jax.ShapeDtypeStruct(tok.shape, tok.dtype, sharding=S.batch_sharding(mesh, tok.shape, rules))
    t0 = time.perf_counter()
    compiled = fn.lower(S.abstract_tree(params, mesh, rules), S.abstract_tree(cache, mesh, rules), tok,
                        None if books is None else S.abstract_tree(books, mesh, rules)).compile()
    ma = compiled.memory_analysis()
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes + ma.generated_code_size_in_bytes)
    return {
        "t_max": t_max,
        "peak_bytes": int(peak),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "cache_bytes": shard_bytes(cache, mesh, rules),
        "codebook_bytes": shard_bytes(books, mesh, rules),
        "param_bytes": shard_bytes(params, mesh, rules),
        "compile_s": time.perf_counter() - t0,
    }


def max_context(measure: Callable[[int], dict[str, Any]], budget: int, probes: tuple[int, int]) -> dict[str, Any]:
    """Largest T_max (multiple of TILE) whose compiled per-device peak fits ``budget``."""
    lo, hi = measure(probes[0]), measure(probes[1])
    slope = (hi["peak_bytes"] - lo["peak_bytes"]) / (probes[1] - probes[0])
    fixed = lo["peak_bytes"] - slope * probes[0]
    res: dict[str, Any] = {"probes": [lo, hi], "peak_bytes_per_token": slope, "fixed_bytes": fixed}
    if fixed >= budget:
        res.update(max_t=0, at_max=None, above_max=None, tight=True)
        return res
    t = max(TILE, int((budget - fixed) // slope) // TILE * TILE)
    at = measure(t)
    while at["peak_bytes"] > budget and t > TILE:
        t -= TILE
        at = measure(t)
    above = measure(t + TILE)
    res.update(max_t=t if at["peak_bytes"] <= budget else 0, at_max=at, above_max=above,
               tight=above["peak_bytes"] > budget)
    return res


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown table."""
    b = result["budget_gib"]
    lines = [
        f"# KV cache per device, LLaMA-2-7B shape (bf16 weights, random), budget {b:g} GiB/device",
        "",
        f"Decode step compiled for 8 fake CPU devices (jax {result['jax']}); per-device numbers from "
        "`compiled.memory_analysis()` (arguments + outputs - donated + temporaries). One sequence per "
        f"data-parallel replica; quantized caches keep a {result['window']}-token exact window"
        f" and {result['sinks']} sink tokens. Max context: largest T_max (multiple of {TILE}) whose "
        f"compiled peak fits the budget; T_max + {TILE} was compiled too and "
        + ("does not fit (every row)." if all(r["tight"] for r in result["rows"]) else
           "fits in some rows (not tight: see JSON)."),
        "",
        "| mesh (data x model) | cache | weights GiB/dev | cache KiB/token/dev | peak KiB/token/dev "
        "| cache GiB/dev @32K | max context/seq | cache GiB/dev @max | peak GiB/dev @max |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        at = r["at_max"] or {}
        lines.append(
            f"| {r['mesh'][0]}x{r['mesh'][1]} | {KIND_LABEL[r['kind']]} | {r['param_bytes'] / GIB:.2f} "
            f"| {r['cache_bytes_per_token'] / 1024:.1f} | {r['peak_bytes_per_token'] / 1024:.1f} "
            f"| {r['cache_bytes_32k'] / GIB:.2f} | {r['max_t']:,} "
            f"| {at.get('cache_bytes', 0) / GIB:.1f} | {at.get('peak_bytes', 0) / GIB:.2f} |")
    lines += ["", "cache KiB/token/dev: from the cache shards' shapes; peak KiB/token/dev: slope of the "
              "compiled peak between two context lengths (cache plus anything else that grows with T). "
              "The gap is XLA:CPU temporaries, mostly an f32 copy of one layer's bf16 cache slice for the "
              "attention dot (XLA:CPU has no bf16 dot), so on a GPU the contexts are somewhat longer; "
              "weights are exact shard sizes, and the bf16->f32 weight conversion XLA:CPU adds is kept to "
              "one layer (see the script's docstring).",
              "",
              f"Reproduce: `python benchmarks/sharding_memory.py --budget-gib {b:g} --json ... --md ...` "
              f"(this run: {result['seconds'] / 60:.0f} min on 2 shared CPU cores; "
              "`--render JSON` re-renders this table).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--md", help="write a markdown table to this path")
    ap.add_argument("--budget-gib", type=float, default=80.0, help="memory per device (GiB)")
    ap.add_argument("--meshes", default="1x1,8x1,4x2,2x4,1x8", help="data x model shapes")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--window", type=int, default=128, help="exact recent tokens (quantized caches)")
    ap.add_argument("--sinks", type=int, default=4, help="exact first tokens (quantized caches)")
    ap.add_argument("--probes", default="8192,16384", help="two context lengths for the linear fit")
    ap.add_argument("--render", help="only re-render the markdown of an existing results JSON")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        text = markdown(result)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
        print(text)
        return result

    config = preset("llama2-7b")
    budget = int(args.budget_gib * GIB)
    probes = tuple(int(x) for x in args.probes.split(","))
    params = jax.eval_shape(lambda k: init_params(config, k, jnp.bfloat16), jax.random.key(0))
    rows = []
    t0 = time.perf_counter()
    for mesh_txt in args.meshes.split(","):
        mesh_shape = tuple(int(x) for x in mesh_txt.lower().split("x"))
        for kind in args.kinds.split(","):
            setup = Setup(config, kind, mesh_shape, args.window, args.sinks)
            fit = max_context(lambda t: compile_step(setup, t, params), budget, probes)
            lo = fit["probes"][0]
            per_tok = (fit["probes"][1]["cache_bytes"] - lo["cache_bytes"]) / (probes[1] - probes[0])
            row = {"mesh": list(mesh_shape), "kind": kind, "batch": setup.batch,
                   "param_bytes": lo["param_bytes"], "codebook_bytes": lo["codebook_bytes"],
                   "cache_bytes_per_token": per_tok,
                   "cache_bytes_32k": lo["cache_bytes"] + per_tok * (32768 - probes[0]), **fit}
            rows.append(row)
            print(f"{mesh_txt:>4} {kind:8s} weights {row['param_bytes'] / GIB:6.2f} GiB  cache "
                  f"{per_tok / 1024:6.1f} KiB/token  max context {row['max_t']:>10,}", flush=True)
    result = {
        "benchmark": "sharding_memory",
        "model": "llama2-7b (random bf16 weights, abstract)",
        "budget_gib": args.budget_gib,
        "window": args.window,
        "sinks": args.sinks,
        "probes": list(probes),
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "jax": jax.__version__,
        "backend": "cpu (8 fake devices)",
        "xla_flags": os.environ["XLA_FLAGS"],
        "machine": platform.machine(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()

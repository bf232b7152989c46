"""SmolLM2-135M on CPU: prefill and decode tokens/s, and the jitted generate loop vs a Python loop.

    python benchmarks/model_cpu.py --json benchmarks/results/model_cpu.json

Measured in one run, same process, same cache shape:
* prefill tokens/s: ``prefill`` of a batch of prompts into an empty DenseCache;
* decode: per-step time of ``generate``'s jitted ``lax.while_loop`` (from the
  difference of an N-token and a 1-token generate, so prefill cancels out)
  against a Python loop calling a jitted, cache-donating ``decode_step`` plus
  a jitted argmax each step; their ratio is the host-loop overhead that the
  while_loop removes.
Times are the minimum over ``--repeats`` interleaved runs after a compile/warm-up run.
Absolute numbers depend on the CPU; the ratio is the portable result.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models import (PRESETS, decode_step, generate, init_cache, init_params,  # noqa: E402
                    load_model, prefill)


def _best(fn, repeats: int) -> float:
    fn()                                          # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, an HF dir / .gguf path, or a preset name (random weights, "
                         "e.g. 'tiny' to expose the per-step host overhead)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps measured")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    if args.model in PRESETS:                     # random weights: isolates per-step overhead
        cfg = PRESETS[args.model]
        params = init_params(cfg, jax.random.key(0), dtype)
        ids = np.random.default_rng(0).integers(0, cfg.vocab, args.prompt_len).tolist()
    else:
        model = load_model(args.model, dtype=dtype)
        cfg, params = model.config, model.params
        from pydoc_data.topics import topics

        text = " ".join(topics.values())
        ids = model.encode(text[: 20 * args.prompt_len])[: args.prompt_len]
    b, t, n = args.batch, len(ids), args.steps
    prompts = np.tile(np.asarray(ids, np.int32), (b, 1))
    lengths = np.full((b,), t, np.int32)
    max_len = t + n + 8

    def new_cache():
        return init_cache(cfg, b, max_len, dtype)

    # --- prefill
    def run_prefill():
        logits, cache = prefill(cfg, params, new_cache(), prompts, lengths, last_only=True)
        jax.block_until_ready(logits)

    t_prefill = _best(run_prefill, args.repeats)

    # --- generate (one jitted while_loop); per step from N- vs 1-token runs
    def run_generate(steps):
        def f():
            res = generate(cfg, params, new_cache(), prompts, lengths, max_new_tokens=steps,
                           eos_id=())
            jax.block_until_ready(res.tokens)
            assert int(res.num_generated[0]) == steps
        return f

    # --- Python loop of decode_step (jitted, cache donated) + jitted argmax
    argmax = jax.jit(lambda logits: jnp.argmax(logits, -1).astype(jnp.int32))
    _, cache0 = prefill(cfg, params, new_cache(), prompts, lengths, last_only=True)
    jax.block_until_ready(cache0)
    first = jnp.asarray(prompts[:, -1])

    def run_loop():
        cache = jax.tree.map(jnp.copy, cache0)    # fresh copy (donated below)
        jax.block_until_ready(cache)
        tok = first
        t0 = time.perf_counter()
        for _ in range(n - 1):
            logits, cache = decode_step(cfg, params, cache, tok)
            tok = argmax(logits)
        jax.block_until_ready(tok)
        return time.perf_counter() - t0

    def timed(f):
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    # Interleave the three measurements so load changes on a shared machine hit all alike.
    gen_n, gen_1 = run_generate(n), run_generate(1)
    gen_n(), gen_1(), run_loop()                  # compile + warm up
    t_n, t_1, t_loop = [], [], []
    for _ in range(args.repeats):
        t_n.append(timed(gen_n))
        t_1.append(timed(gen_1))
        t_loop.append(run_loop())
    gen_step = (min(t_n) - min(t_1)) / (n - 1)
    loop_step = min(t_loop) / (n - 1)

    result = {
        "benchmark": "model_cpu",
        "model": args.model,
        "dtype": args.dtype,
        "batch": b,
        "prompt_len": t,
        "cache_max_len": max_len,
        "decode_steps": n,
        "prefill_s": t_prefill,
        "prefill_tokens_per_s": b * t / t_prefill,
        "generate_step_ms": 1e3 * gen_step,
        "decode_tokens_per_s": b / gen_step,
        "python_loop_step_ms": 1e3 * loop_step,
        "python_loop_tokens_per_s": b / loop_step,
        "loop_over_generate_ratio": loop_step / gen_step,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    print(f"{args.model} {args.dtype} B={b} prompt={t} steps={n} (max_len {max_len})")
    print(f"  prefill            {result['prefill_tokens_per_s']:9.1f} tokens/s")
    print(f"  decode (generate)  {result['decode_tokens_per_s']:9.1f} tokens/s  "
          f"{result['generate_step_ms']:.2f} ms/step")
    print(f"  decode (py loop)   {result['python_loop_tokens_per_s']:9.1f} tokens/s  "
          f"{result['python_loop_step_ms']:.2f} ms/step")
    print(f"  python loop / jitted generate loop: {result['loop_over_generate_ratio']:.3f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

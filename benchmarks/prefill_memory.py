"""Peak memory and wall time of one long-prompt ``generate`` (a passkey prompt), whole prompt
in one forward against ``prefill_chunk`` forwards, each setting in a fresh process.

Peak resident set (``ru_maxrss`` of the child) covers weights, cache, compile and the prefill's
working set; the answer tokens are compared across settings (same greedy answer expected).

    PYTHONPATH=. python benchmarks/prefill_memory.py --model gemma3-270m --length 8192 \
        --chunks 0,2048 --json benchmarks/results/prefill_memory/gemma3_8k.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def child(model_name: str, length: int, chunk: int, codebooks: str | None) -> dict:
    import jax.numpy as jnp

    from million_app.calibrate import load_model_codebooks
    from million_app.passkey import passkey_prompt, run_trials
    from million_jax.cache.spec import CacheSpec
    from models import load_model

    model = load_model(model_name)
    if codebooks:
        books, meta = load_model_codebooks(codebooks, model)
        spec = CacheSpec("pq", codebooks=books, quantize_all=True, dtype=jnp.bfloat16,
                         precise_sinks=int(meta.get("precise_sinks", 0)))
    else:
        spec = CacheSpec("dense", dtype=jnp.bfloat16)
    prompt = passkey_prompt(model, length, 12345, 0.0)
    t0 = time.perf_counter()
    (row,) = run_trials(model, [prompt], [12345], spec, 1, chunk or None, score=False)
    wall = time.perf_counter() - t0
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"length": length, "prompt_tokens": len(prompt), "prefill_chunk": chunk, "cache": spec.kind,
            "answer": row["answer"], "correct": row["correct"], "wall_s": round(wall, 1),
            "peak_rss_gib": round(rss_kib / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--chunks", default="0,2048", help="prefill chunk sizes (0: whole prompt)")
    p.add_argument("--codebooks", help="a PQ codebook file: every row through a PQ cache instead of dense "
                   "(every token from codes but the precise sinks the file records)")
    p.add_argument("--json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.model, a.length, a.child, a.codebooks)))
        return
    rows = []
    for c in [int(x) for x in a.chunks.split(",")]:
        cmd = [sys.executable, __file__, "--model", a.model, "--length", str(a.length), "--child", str(c)]
        if a.codebooks:
            cmd += ["--codebooks", a.codebooks]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if out.returncode:
            rows.append({"length": a.length, "prefill_chunk": c, "error": out.stderr.strip().splitlines()[-1:],
                         "returncode": out.returncode})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

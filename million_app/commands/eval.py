"""``million-jax eval``: perplexity through one KV cache (MILLION's windowed protocol)."""
from __future__ import annotations

import argparse

from million_app import caches, progress
from million_app.calibrate import model_fingerprint
from million_app.commands.flag_groups import KEPT, TEXT_HELP, cache_args, force_arg, model_args, text_args
from million_app.corpus import text_hash
from million_app.flags import cache_spec, check_positions, check_positive, load_text
from million_app.loading import model_name, open_model, tokenize
from million_app.perplexity import evaluate
from million_app.report import check_writable, environment, memory_line, write_json

HELP = "perplexity through a KV cache (MILLION's protocol)"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help=HELP)
    model_args(p)
    p.add_argument("--text", required=True, help=TEXT_HELP)
    text_args(p)
    cache_args(p, "all")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--max-tokens", type=int, help="use the first N tokens (default: all)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--bos", action="store_true", help="prepend one BOS token to the text")
    p.add_argument("--json", help=f"write the result to this JSON file ({KEPT})")
    force_arg(p, "--json")
    return p


def run(args: argparse.Namespace) -> int:
    """Perplexity through one cache (MILLION's windowed protocol)."""
    check_positive(window=args.window, max_tokens=args.max_tokens, batch=args.batch)
    if args.json:
        check_writable(args.json, "--json", force=args.force)
    text = load_text(args.text, "--text", args)
    model = open_model(args.model)
    check_positions(model, args.window, f"--window {args.window}")
    spec, source = cache_spec(args, model)
    if note := caches.beyond_calibration(spec, args.window, source.get("calib_window"), source.get("codebooks")):
        progress.warn(note)
    ids = tokenize(model, text, bos=args.bos)
    progress.status(f"eval text {args.text}: {len(ids)} tokens; {caches.label(spec)}")
    r = evaluate(model, ids, spec, window=args.window, max_tokens=args.max_tokens, batch=args.batch)
    r.update(source)
    r.update(model=model_name(model), model_fingerprint=model_fingerprint(model), text=args.text,
             text_hash=text_hash(text), text_tokens=len(ids), bos=bool(args.bos),
             environment=environment())
    print(f"{caches.label(spec)}: ppl {r['ppl']:.4f} (nll {r['nll']:.4f}) over {r['tokens']} target "
          f"tokens in {r['windows']} windows of {r['window']}")
    print("  " + memory_line(r))
    if args.json:
        write_json(args.json, r, force=args.force)
        progress.status(f"wrote {args.json}")
    return 0

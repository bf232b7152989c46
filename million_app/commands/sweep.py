"""``million-jax sweep``: dense vs PQ vs uniform on one model, as a table, JSON and a plot
(the grid: :mod:`million_app.sweep`)."""
from __future__ import annotations

import argparse
import os

from million_app.commands.flag_groups import TEXT_HELP, cache_dtype_arg, force_arg, model_args, text_args
from million_app.errors import UsageError
from million_app.flags import check_positions, check_positive, load_text
from million_app.loading import open_model
from million_app import progress
from million_app.report import already_exists, check_writable
from million_app.sweep import SweepSettings, existing_outputs, markdown_table, partial_name, run_sweep

HELP = "dense vs PQ vs uniform: table, JSON and plot"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help=HELP)
    model_args(p)
    p.add_argument("--calib", required=True, help="calibration text: " + TEXT_HELP)
    p.add_argument("--text", required=True, help="evaluation text: " + TEXT_HELP)
    text_args(p)
    p.add_argument("--out", required=True,
                   help="output directory (created); results of an earlier sweep there are never replaced "
                        "unless --force, and then only once this sweep completes")
    p.add_argument("--calib-tokens", type=int, default=16384, help="default 16384")
    p.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens (default 8192)")
    p.add_argument("--window", type=int, default=512, help="default 512")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=10, help="k-means iterations (default 10)")
    p.add_argument("--max-vectors", type=int, default=8192,
                   help="vectors sampled per k-means problem (default 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=("all", "realistic"), default="all")
    p.add_argument("--recent", type=int, default=64, help="realistic: exact recent tokens (default 64)")
    p.add_argument("--sinks", type=int, default=0, help="realistic: exact first tokens")
    cache_dtype_arg(p, help="default bfloat16")
    p.add_argument("--bos", action="store_true")
    p.add_argument("--save-codebooks", action="store_true", help="also write DIR/codebooks/*.safetensors")
    force_arg(p, "the results in --out")
    return p


def run(args: argparse.Namespace) -> int:
    check_positive(calib_tokens=args.calib_tokens, max_tokens=args.max_tokens, window=args.window,
                   batch=args.batch, iters=args.iters, max_vectors=args.max_vectors)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} exists and is not a directory")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out: cannot create directory {args.out} ({e.strerror or e})") from None
    check_writable(os.path.join(args.out, "results.json"), "--out", force=True)
    earlier = existing_outputs(args.out)
    if earlier and not args.force:
        raise UsageError(already_exists(os.path.join(args.out, earlier[0]), "--out")
                         + (f" (and {len(earlier) - 1} more results of an earlier sweep)" if len(earlier) > 1 else ""))
    if earlier:
        progress.status(f"--force: results go to {partial_name('results.json')} etc. in {args.out} and replace "
                        "the earlier ones only when the sweep completes")
    calib = load_text(args.calib, "--calib", args)
    text = load_text(args.text, "--text", args)
    model = open_model(args.model)
    check_positions(model, args.window, f"--window {args.window}")
    s = SweepSettings(calib=args.calib, text=args.text, calib_tokens=args.calib_tokens,
                      max_tokens=args.max_tokens, window=args.window, batch=args.batch,
                      iters=args.iters, max_vectors=args.max_vectors, seed=args.seed,
                      protocol=args.protocol, recent=args.recent, sinks=args.sinks,
                      cache_dtype=args.cache_dtype, bos=args.bos)
    results = run_sweep(model, calib, text, s, args.out, save_codebooks=args.save_codebooks,
                        staged=bool(earlier))
    print(markdown_table(results["rows"], s.window, s.cache_dtype))
    print(f"wrote {args.out}/results.json, results.md, ppl_vs_bits.png "
          f"({results['total_seconds'] / 60:.1f} min)")
    return 0

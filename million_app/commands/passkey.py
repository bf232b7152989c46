"""``million-jax passkey``: synthetic passkey retrieval, dense vs the chosen cache
(prompts and scoring: :mod:`million_app.passkey`)."""
from __future__ import annotations

import argparse

from million_app import caches, progress
from million_app.commands.flag_groups import KEPT, cache_args, force_arg, model_args, prefill_chunk, prefill_chunk_arg
from million_app.flags import cache_spec, check_positive
from million_app.loading import model_name, open_model
from million_app.passkey import parse_lengths, passkey_eval
from million_app.report import check_writable, write_json
from million_jax.cache.spec import CacheSpec

HELP = "synthetic passkey retrieval, dense vs the chosen cache"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("passkey", help=HELP)
    model_args(p)
    cache_args(p, "realistic")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--trials", type=int, default=5, help="prompts per length (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=5, help="prompts per forward (default 5)")
    prefill_chunk_arg(p)
    p.add_argument("--json", help=f"write the accuracies to this JSON file ({KEPT})")
    force_arg(p, "--json")
    return p


def run(args: argparse.Namespace) -> int:
    check_positive(trials=args.trials, batch=args.batch)
    if args.json:
        check_writable(args.json, "--json", force=args.force)
    model = open_model(args.model)
    spec, source = cache_spec(args, model)
    lengths = parse_lengths(args.lengths, model.config.max_position_embeddings)
    if note := caches.beyond_calibration(spec, max(lengths), source.get("calib_window"), source.get("codebooks")):
        progress.warn(note)
    specs = [CacheSpec("dense", dtype=spec.dtype)]
    if spec.kind != "dense":
        specs.append(spec)
    r = passkey_eval(model, specs, lengths, trials=args.trials, seed=args.seed, batch=args.batch,
                     prefill_chunk=prefill_chunk(args))
    labels = [caches.label(s) for s in specs]
    print("accuracy (mean log p of the key, teacher-forced)")
    print("| length | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for i, n in enumerate(lengths):
        accs = [f"{r['results'][lab][i]['accuracy']:.0%} ({r['results'][lab][i]['key_logp']:.2f})" for lab in labels]
        print(f"| {n} | " + " | ".join(accs) + " |")
    if args.json:
        r.update(model=model_name(model), trials=args.trials, seed=args.seed, prefill_chunk=args.prefill_chunk,
                 caches={caches.label(s): {**caches.settings(s), **(source if s is spec else {})}
                         for s in specs})
        write_json(args.json, r, force=args.force)
    return 0

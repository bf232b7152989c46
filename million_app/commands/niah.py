"""``million-jax niah``: needle-in-a-haystack grid (context length x needle depth), dense vs the
chosen cache, as a table, JSON and a heatmap per cache (:mod:`million_app.niah`)."""
from __future__ import annotations

import argparse

from million_app import caches, progress
from million_app.commands.flag_groups import KEPT, cache_args, force_arg, model_args, prefill_chunk, prefill_chunk_arg
from million_app.flags import cache_spec, check_positive
from million_app.loading import model_name, open_model
from million_app.niah import heatmap, niah_grid, parse_depths
from million_app.passkey import parse_lengths
from million_app.report import atomic_path, check_writable, write_json
from million_jax.cache.spec import CacheSpec

HELP = "needle-in-a-haystack grid (context length x depth), dense vs the chosen cache"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("niah", help=HELP)
    model_args(p)
    cache_args(p, "realistic")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="context lengths in tokens (default 1K-8K)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1] (default 0-100%% in quarters)")
    p.add_argument("--trials", type=int, default=1, help="prompts (keys) per cell (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=5, help="prompts per forward (default 5)")
    prefill_chunk_arg(p)
    p.add_argument("--no-dense", action="store_true", help="only the chosen cache (no dense reference grid)")
    p.add_argument("--json", help=f"write the grid to this JSON file ({KEPT})")
    p.add_argument("--png", help=f"write the heatmaps to this PNG file ({KEPT})")
    force_arg(p, "--json/--png")
    return p


def print_table(title: str, lengths: list[int], depths: list[float], cells: list[list[str]]) -> None:
    """A markdown table: one row per length, one column per depth."""
    print(title)
    print("| length | " + " | ".join(f"{d:.0%}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for n, row in zip(lengths, cells):
        print(f"| {n} | " + " | ".join(row) + " |")


def run(args: argparse.Namespace) -> int:
    check_positive(trials=args.trials, batch=args.batch)
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path:
            check_writable(path, flag, force=args.force)
    depths = parse_depths(args.depths)
    model = open_model(args.model)
    spec, source = cache_spec(args, model)
    lengths = parse_lengths(args.lengths, model.config.max_position_embeddings)
    if note := caches.beyond_calibration(spec, max(lengths), source.get("calib_window"), source.get("codebooks")):
        progress.warn(note)
    specs = [] if args.no_dense and spec.kind != "dense" else [CacheSpec("dense", dtype=spec.dtype)]
    if spec.kind != "dense":
        specs.append(spec)
    r = niah_grid(model, specs, lengths, depths, trials=args.trials, seed=args.seed, batch=args.batch,
                  prefill_chunk=prefill_chunk(args))
    dense = caches.label(specs[0]) if specs[0].kind == "dense" else None
    for s in specs:
        lab = caches.label(s)
        print_table(f"{lab}: accuracy by length (rows) x depth (columns)", lengths, depths,
                    [[f"{a:.0%}" for a in row] for row in r["results"][lab]["accuracy"]])
    for s in specs:
        lab = caches.label(s)
        vs = dense is not None and lab != dense
        ref = r["results"][dense]["key_logp"] if vs else None
        rows = [[f"{x:.2f}" + (f" ({ref[i][j] - x:+.2f})" if vs else "") for j, x in enumerate(row)]
                for i, row in enumerate(r["results"][lab]["key_logp"])]
        print_table(f"{lab}: mean log p(key) by length x depth (teacher-forced"
                    + (f", loss vs {dense} in brackets)" if vs else ")"), lengths, depths, rows)
    r.update(model=model_name(model), prefill_chunk=args.prefill_chunk, caches={caches.label(s): {**caches.settings(s), **(source if s is spec else {})}
                                              for s in specs})
    if args.json:
        write_json(args.json, r, force=args.force)
    if args.png:
        with atomic_path(args.png, "--png", force=args.force) as tmp:
            heatmap(r, tmp, f"{model_name(model)}: needle in a haystack, {args.trials} prompt(s) per cell")
        progress.status(f"wrote {args.png}")
    return 0

"""``million-jax calibrate``: fit K/V codebooks on calibration text and save them with metadata."""
from __future__ import annotations

import argparse

from million_app import progress
from million_app.calibrate import (DEFAULT_KEY_ROPE, calibration_kvq, calibration_kvq_samples, codebook_metadata,
                                   default_calibration_windows, fit_model_codebooks, kmeans_problem_summary,
                                   parse_windows, save_model_codebooks)
from million_app.commands.flag_groups import (KEPT, TEXT_HELP, check_rope_subspaces, force_arg, model_args,
                                             rope_arg, text_args)
from million_app.corpus import text_hash
from million_app.errors import UsageError
from million_app.flags import check_codebook_settings, check_positions, check_positive, load_text
from million_app.loading import model_name, open_model, tokenize
from million_app.recipes import (adopted_precise_sinks, check_recipe_granularity, fit_recipe, recipe_for_bits,
                                 with_norms)
from million_app.report import check_writable, human_bytes
from million_jax.quant.kv_codebooks import GRANULARITIES, unit_vectors
from million_jax.quant.pq import MAX_NBITS, MIN_NBITS
from models.decoder import rope_inv_freq

HELP = "fit K/V codebooks on calibration text"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help=HELP)
    model_args(p)
    p.add_argument("--text", required=True, help=TEXT_HELP)
    text_args(p)
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    rope_arg(p, default=None, extra_help="; with --bits 1 the default is post, which measured better there "
             "(benchmarks/results/prerope_smollm2)")
    p.add_argument("--bits", type=int, choices=(1, 2, 3, 4),
                   help="stored bits per K/V element: picks the best measured recipe for --rope (key/value "
                        "budgets, query-aware keys for post); not with --M/--nbits")
    p.add_argument("--M", type=int, help="subspaces per head vector (default head_dim/2)")
    p.add_argument("--nbits", type=int, help=f"bits per code, {MIN_NBITS}..{MAX_NBITS} (default 8)")
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer_head",
                   help="one codebook for the model, per layer, or per layer and KV head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=25, help="k-means iterations (default 25)")
    p.add_argument("--max-vectors", type=int, default=65536,
                   help="vectors sampled per k-means problem (default 65536)")
    p.add_argument("--window", default=None,
                   help="calibration window(s), e.g. 512 or 512,8192 (the tokens split equally between "
                        "them; default 512 for --rope pre; for --rope post the codebooks serve positions "
                        "up to the longest window, default 512 and the model's context, at most 8192 and "
                        "at most half the calibration tokens)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--precise-sinks", type=int, metavar="N",
                   help="record N exact first tokens per sequence in the file: `eval`/`generate` keep them "
                        "in the cache dtype under both protocols (a fixed cost per sequence, not per token); "
                        "default: the measured choice of the model family (Gemma 3: 4) or of --bits, else 0")
    p.add_argument("--norms", choices=("adopted", "on", "unit", "off"), default="adopted",
                   help="norm-explicit PQ: a float16 scale |x| / |x_hat| per key and value vector stored beside its "
                        "codes (+16 bits per vector; 'unit': the codebooks fitted on unit vectors, which the "
                        "cache then encodes; 'adopted': what --bits measured best, else off)")
    p.add_argument("--out", required=True, help=f"output .safetensors file ({KEPT})")
    force_arg(p, "--out")
    return p


def run(args: argparse.Namespace) -> int:
    """Fit K/V codebooks on calibration text and save them with metadata."""
    check_positive(tokens=args.tokens, iters=args.iters, max_vectors=args.max_vectors,
                   batch=args.batch, M=args.M)
    if args.precise_sinks is not None and args.precise_sinks < 0:
        raise UsageError(f"--precise-sinks must be >= 0, got {args.precise_sinks}")
    check_writable(args.out, "--out", force=args.force)
    text = load_text(args.text, "--text", args)
    model = open_model(args.model)
    windows = None if args.window is None else parse_windows(args.window)
    for w in windows or ():
        check_positions(model, w, f"--window {args.window}")
    d = model.config.head_dim
    if args.rope is None:  # measured: pre-RoPE wins at 4, 3 and (pq2-pre-g2) 2 b/elem; 1 b has post only
        args.rope = "post" if args.bits == 1 else DEFAULT_KEY_ROPE
    recipe = None
    if args.bits is not None:
        if args.M is not None or args.nbits is not None:
            raise UsageError("--bits picks M and nbits itself: give either --bits or --M/--nbits")
        recipe = recipe_for_bits(args.bits, args.rope, model.config.family)
        recipe.budgets(d)
        check_recipe_granularity(recipe, model.config, args.granularity)
    nbits = 8 if args.nbits is None else args.nbits
    M = args.M or d // 2
    if d % M:
        raise UsageError(f"--M {M} does not divide the model's head_dim {d}")
    if recipe is None:
        check_rope_subspaces(args.rope, M, d)
    elif args.norms != "adopted":  # the flag decides the recipe's norms (and whether it fits unit vectors)
        recipe = with_norms(recipe, args.norms != "off", args.norms == "unit")
    check_codebook_settings(nbits, args.max_vectors)
    ids = tokenize(model, text)
    progress.status(f"calibration text {args.text}: {len(ids)} tokens, using up to {args.tokens}")
    if windows is None:
        windows = default_calibration_windows(model, min(args.tokens, len(ids)), args.rope)
        serve = "every position" if args.rope == "pre" else f"positions up to {max(windows)}"
        progress.status(f"calibration windows of {' and '.join(map(str, windows))} tokens (the codebooks serve "
                        f"{serve})")
    queries = None
    if recipe is not None and recipe.finetune is not None:
        if len(windows) > 1:
            raise UsageError(f"recipe {recipe.name} fine-tunes on one window length: give one --window")
        # fine-tuning recipes are post-RoPE only (fit_recipe refuses the others)
        k, v, gram, count, q, q_pos, used = calibration_kvq_samples(model, ids, tokens=args.tokens,
                                                                    window=windows[0], batch=args.batch,
                                                                    seed=args.seed)
        queries = (q, q_pos, windows[0])
    else:
        k, v, gram, count, used = calibration_kvq(model, ids, tokens=args.tokens, window=windows,
                                                  batch=args.batch, key_rope=args.rope)
    if recipe is None:
        progress.status("k-means: " + kmeans_problem_summary(k.shape, M, nbits, args.granularity,
                                                             args.max_vectors)
                        + f", {args.iters} iterations")
    else:
        progress.status(f"recipe {recipe.name} for --bits {args.bits} --rope {args.rope}: {recipe.describe()}")
    allocation: dict = {}  # recipes with pair_widths: the key widths per RoPE pair, recorded in the file
    with progress.timed("fitting codebooks") as t:
        if recipe is None:
            if args.norms == "unit":  # NEQ: the codebooks code directions, the stored scale the norm
                k, v = unit_vectors(k), unit_vectors(v)
            books = fit_model_codebooks(k, v, M=M, nbits=nbits, granularity=args.granularity,
                                        seed=args.seed, iters=args.iters, max_vectors=args.max_vectors,
                                        rope_inv_freq=rope_inv_freq(model.config) if args.rope == "pre" else None)
        else:
            books = fit_recipe(recipe, model, k, v, gram, count, granularity=args.granularity,
                               seed=args.seed, iters=args.iters, max_vectors=args.max_vectors,
                               queries=queries, allocation_report=allocation)
    if recipe is None and args.norms != "adopted":
        books = books.with_explicit_norms(args.norms != "off", args.norms != "off", args.norms == "unit")
    precise_sinks = args.precise_sinks
    if precise_sinks is None:
        precise_sinks = adopted_precise_sinks(recipe, model.config.family)
    meta = codebook_metadata(model, books, calib_text=args.text, calib_text_hash=text_hash(text),
                             calib_tokens=used, calib_windows=windows,
                             seed=args.seed,
                             iters=args.iters, max_vectors=args.max_vectors,
                             fit_seconds=round(t["seconds"], 2),
                             recipe=recipe.name if recipe else None,
                             finetune_steps=recipe.finetune_steps if recipe else 0,
                             precise_sinks=precise_sinks, **allocation)
    save_model_codebooks(args.out, books, meta, force=args.force, doing="calibrating")
    sinks = f", {precise_sinks} exact first tokens per sequence" if precise_sinks else ""
    print(f"wrote {args.out}: {books.recipe} {books.granularity} codebooks "
          f"({meta['bits_per_element']:.2f} bits/elem{sinks}, {human_bytes(books.nbytes)}) for "
          f"{model_name(model)} from {used} tokens of {args.text}")
    return 0

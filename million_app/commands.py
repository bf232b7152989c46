"""The subcommands behind ``million-jax`` (argparse namespaces in, exit status out)."""
from __future__ import annotations

import argparse

from million_app import progress
from million_app.calibrate import (calibration_kvq, calibration_kvq_samples, codebook_metadata,
                                   default_calibration_windows, fit_model_codebooks, parse_windows,
                                   kmeans_problem_summary, model_fingerprint,
                                   save_model_codebooks)
from million_app import caches
from million_app.corpus import text_hash
from million_app.errors import UsageError
from million_app.flags import (cache_spec, check_codebook_settings, check_positions,
                               check_positive, load_text)
from million_app.loading import model_name, open_model, tokenize
from million_app.perplexity import evaluate
from million_app.recipes import fit_recipe, recipe_for_bits
from million_app.report import check_writable, environment, human_bytes, memory_line, write_json


# ---------------------------------------------------------------------------- calibrate
def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit K/V codebooks on calibration text and save them with metadata."""
    check_positive(tokens=args.tokens, iters=args.iters, max_vectors=args.max_vectors,
                   batch=args.batch, M=args.M)
    check_writable(args.out, "--out", overwrite=args.force)
    text = load_text(args.text, "--text", args)
    model = open_model(args.model)
    windows = None if args.window is None else parse_windows(args.window)
    for w in windows or ():
        check_positions(model, w, f"--window {args.window}")
    d = model.config.head_dim
    recipe = None
    if args.bits is not None:
        if args.M is not None or args.nbits is not None:
            raise UsageError("--bits picks M and nbits itself: give either --bits or --M/--nbits")
        recipe = recipe_for_bits(args.bits)
        recipe.budgets(d)
    nbits = 8 if args.nbits is None else args.nbits
    M = args.M or d // 2
    if d % M:
        raise UsageError(f"--M {M} does not divide the model's head_dim {d}")
    check_codebook_settings(nbits, args.max_vectors)
    ids = tokenize(model, text)
    progress.status(f"calibration text {args.text}: {len(ids)} tokens, using up to {args.tokens}")
    if windows is None:
        windows = default_calibration_windows(model, min(args.tokens, len(ids)))
        progress.status(f"calibration windows of {' and '.join(map(str, windows))} tokens (the codebooks serve "
                        f"positions up to {max(windows)})")
    queries = None
    if recipe is not None and recipe.finetune is not None:
        if len(windows) > 1:
            raise UsageError(f"recipe {recipe.name} fine-tunes on one window length: give one --window")
        k, v, gram, count, q, q_pos, used = calibration_kvq_samples(model, ids, tokens=args.tokens,
                                                                    window=windows[0], batch=args.batch,
                                                                    seed=args.seed)
        queries = (q, q_pos, windows[0])
    else:
        k, v, gram, count, used = calibration_kvq(model, ids, tokens=args.tokens, window=windows,
                                                  batch=args.batch)
    if recipe is None:
        progress.status("k-means: " + kmeans_problem_summary(k.shape, M, nbits, args.granularity,
                                                             args.max_vectors)
                        + f", {args.iters} iterations")
    else:
        progress.status(f"recipe {recipe.name} for --bits {args.bits}: {recipe}")
    with progress.timed("fitting codebooks") as t:
        if recipe is None:
            books = fit_model_codebooks(k, v, M=M, nbits=nbits, granularity=args.granularity,
                                        seed=args.seed, iters=args.iters, max_vectors=args.max_vectors)
        else:
            books = fit_recipe(recipe, model, k, v, gram, count, granularity=args.granularity,
                               seed=args.seed, iters=args.iters, max_vectors=args.max_vectors,
                               queries=queries)
    meta = codebook_metadata(model, books, calib_text=args.text, calib_text_hash=text_hash(text),
                             calib_tokens=used, calib_windows=windows,
                             seed=args.seed,
                             iters=args.iters, max_vectors=args.max_vectors,
                             fit_seconds=round(t["seconds"], 2),
                             recipe=recipe.name if recipe else None,
                             finetune_steps=recipe.finetune_steps if recipe else 0)
    save_model_codebooks(args.out, books, meta)
    print(f"wrote {args.out}: {books.recipe} {books.granularity} codebooks "
          f"({meta['bits_per_element']:.2f} bits/elem, {human_bytes(books.nbytes)}) for "
          f"{model_name(model)} from {used} tokens of {args.text}")
    return 0


# ---------------------------------------------------------------------------- eval
def cmd_eval(args: argparse.Namespace) -> int:
    """Perplexity through one cache (MILLION's windowed protocol)."""
    check_positive(window=args.window, max_tokens=args.max_tokens, batch=args.batch)
    if args.json:
        check_writable(args.json, "--json")
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
        write_json(args.json, r)
        progress.status(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------- the rest
def cmd_sweep(args: argparse.Namespace) -> int:
    from million_app.sweep import run_sweep_command

    return run_sweep_command(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from million_app.generation import run_generate_command

    return run_generate_command(args)


def cmd_passkey(args: argparse.Namespace) -> int:
    from million_app.passkey import run_passkey_command

    return run_passkey_command(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from million_app.demo import run_demo_command

    return run_demo_command(args)


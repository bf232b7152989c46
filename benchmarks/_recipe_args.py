"""Command-line options shared by the recipe benchmarks (recipes.py, codebook_finetune.py):
model, calibration / evaluation text and the settings of the fit and the perplexity run."""
from __future__ import annotations

import argparse


def add_recipe_args(p: argparse.ArgumentParser, recipes: str) -> None:
    """Add the shared options to ``p``; ``recipes`` is the default of ``--recipes``."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calib", default="builtin:calib")
    p.add_argument("--text", default="builtin:eval")
    p.add_argument("--out", required=True)
    p.add_argument("--recipes", default=recipes)
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512, help="evaluation window (and calibration window "
                   "unless --calib-window)")
    p.add_argument("--calib-window", default=None,
                   help="calibration window(s), e.g. 8192 or 512,8192 (default: --window)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--max-vectors", type=int, default=4096)

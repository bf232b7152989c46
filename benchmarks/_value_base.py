"""What the value benchmarks (value_bit_allocation.py, value_basis.py) share: the options that name a
base codebook file and the calibration its values are refitted on, and that calibration run."""
from __future__ import annotations

import argparse

import numpy as np

from million_app.calibrate import calibration_kvq, load_model_codebooks
from million_app.flags import load_text
from million_app.loading import open_model, tokenize


def add_value_base_args(p: argparse.ArgumentParser) -> None:
    """--base, --model, the calibration and k-means settings, --sample, --out-dir and --json."""
    p.add_argument("--base", required=True, help="a calibrate file with 2-dim value sub-spaces, one stage")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calib", default="builtin:calib")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--max-vectors", type=int, default=65536)
    p.add_argument("--sample", type=int, default=4096, help="calibration values per (layer, head) the errors use")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json", required=True)


def open_value_base(a: argparse.Namespace):
    """(model, base PQCodebooks, its metadata); SystemExit unless the base holds values in 2-dim
    sub-spaces, one stage, no value transform."""
    model = open_model(a.model)
    base, meta = load_model_codebooks(a.base, model)
    if base.value.centroids.shape[-1] != 2 or base.stages != 1 or base.value_transform is not None:
        raise SystemExit("--base must hold values in 2-dim sub-spaces, one stage, no value transform")
    return model, base, meta


def calibration_values(a: argparse.Namespace, model, base) -> tuple[np.ndarray, int]:
    """The calibration values float32[L, Hkv, N, d] of ``--calib`` / ``--tokens`` (512-token windows,
    the keys' RoPE side as ``base``'s), and the tokens used."""
    _, v, _, _, used = calibration_kvq(model, tokenize(model, load_text(a.calib, "--calib")), tokens=a.tokens,
                                       window=512, key_rope=base.key_rope)
    return np.asarray(v), used


def command_line(script: str, a: argparse.Namespace) -> str:
    """The command that reproduces a run of ``benchmarks/<script>`` with these options."""
    return f"PYTHONPATH=. python benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items())

"""PQ reconstruction error of keys and values by token position in a long window (issue 13).

    PYTHONPATH=. python benchmarks/position_error.py --text builtin:eval --window 8192 \
        --codebooks a.safetensors b.safetensors --json out.json

Codebooks calibrated on short windows see post-RoPE keys only at the rotation angles of
positions < window; keys far beyond that may fall where no centroid is. This runs the model
over one ``--window``-token window of the text (dense, exact), encodes every post-RoPE key and
value with each codebook file (in the transformed space when the file has query-aware /
output-aware transforms, where the squared error is the expected score / output error) and
reports the relative squared error sum ||x - x_hat||^2 / sum ||x||^2 per block of
``--bucket`` positions, over all layers and KV heads.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from million_app.calibrate import collect_model_kv, load_model_codebooks
from million_app.corpus import read_text
from million_app.loading import open_model, tokenize
from million_app.report import write_json
from million_jax.kv_transforms import transform_rows
from million_jax.pq import decode, encode


def relative_error_by_position(x: np.ndarray, books, transform, bucket: int) -> list[float]:
    """x: float32[L, Hkv, N, d] -> relative squared error per block of ``bucket`` positions."""
    if transform is not None:
        x = transform_rows(x, np.asarray(transform))
    xhat = np.asarray(decode(books, encode(books, x)))
    err = ((x - xhat) ** 2).sum(axis=(0, 1, 3))  # [N]
    ref = (x ** 2).sum(axis=(0, 1, 3))
    n = x.shape[2] // bucket * bucket
    return [float(e / r) for e, r in zip(err[:n].reshape(-1, bucket).sum(1), ref[:n].reshape(-1, bucket).sum(1))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default="builtin:eval")
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--codebooks", nargs="+", required=True)
    p.add_argument("--json", default="")
    a = p.parse_args()
    model = open_model(a.model)
    ids = tokenize(model, read_text(a.text))
    k, v = collect_model_kv(model, ids, window=a.window, batch=1, max_tokens=a.window)
    rows = []
    for path in a.codebooks:
        books, meta = load_model_codebooks(path, model)
        row = {"codebooks": os.path.basename(path), "recipe": books.recipe,
               "calibration_window": meta.get("calib_window"),
               "key": relative_error_by_position(k, books.key, books.key_transform, a.bucket),
               "value": relative_error_by_position(v, books.value, books.value_transform, a.bucket)}
        rows.append(row)
        print(f"{row['codebooks']} ({row['recipe']}, calibrated on windows of {row['calibration_window']})")
        for name in ("key", "value"):
            print(f"  {name:5s} " + " ".join(f"{e:.4f}" for e in row[name]), flush=True)
    if a.json:
        write_json(a.json, {"model": a.model, "text": a.text, "window": a.window, "bucket": a.bucket,
                            "rows": rows})


if __name__ == "__main__":
    main()

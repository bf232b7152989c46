"""PQ reconstruction error of keys and values by token position in a long window (issue 13).

    PYTHONPATH=. python benchmarks/position_error.py --text builtin:eval --window 8192 \
        --codebooks a.safetensors b.safetensors --json out.json

Codebooks calibrated on short windows see post-RoPE keys only at the rotation angles of
positions < window; keys far beyond that may fall where no centroid is. This runs the model
over one ``--window``-token window of the text (dense, exact), encodes every post-RoPE key and
value with each codebook file and reports the relative squared error
sum ||x - x_hat||^2 / sum ||x||^2 per block of ``--bucket`` positions, over all layers and KV
heads: "fitted" in the space the codebook was fitted in (A k for query-aware keys, where the
squared error is the expected squared score error; B v for output-aware values), "plain" in
the model's own space (x_hat mapped back by the inverse transform); "first_4_*": the same
over the first 4 positions only (the attention sinks).

Codebooks of keys quantized before RoPE (``key_rope == "pre"``) encode the keys rotated back by
their position, in RoPE-pair layout; the rotation is orthogonal, so the error there equals the
error of the post-RoPE key against its rotated reconstruction.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from million_app.calibrate import collect_model_kv, load_model_codebooks
from million_app.corpus import read_text
from million_app.loading import open_model, tokenize
from million_app.report import write_json
from models.decoder import rope_inv_freq
from million_jax import rope
from million_jax.quant.kv_transforms import inverse, transform_rows
from million_jax.quant.residual_pq import decode_stages, encode_stages


def _by_bucket(x: np.ndarray, xhat: np.ndarray, bucket: int) -> list[float]:
    err = ((x - xhat) ** 2).sum(axis=(0, 1, 3))  # [N]
    ref = (x ** 2).sum(axis=(0, 1, 3))
    n = x.shape[2] // bucket * bucket
    return [float(e / r) for e, r in zip(err[:n].reshape(-1, bucket).sum(1), ref[:n].reshape(-1, bucket).sum(1))]


def relative_error_by_position(x: np.ndarray, books, transform, stages: int, bucket: int) -> dict[str, list[float]]:
    """x: float32[L, Hkv, N, d] -> relative squared error per block of ``bucket`` positions, in
    the space the codebook was fitted in ("fitted": A k or B v) and in the model's ("plain")."""
    y = x if transform is None else transform_rows(x, np.asarray(transform))
    yhat = np.asarray(decode_stages(books, encode_stages(books, y, stages), stages))
    xhat = yhat if transform is None else transform_rows(yhat, inverse(np.asarray(transform)))
    return {"fitted": _by_bucket(y, yhat, bucket), "plain": _by_bucket(x, xhat, bucket),
            "first_4_fitted": _by_bucket(y[:, :, :4], yhat[:, :, :4], 4),
            "first_4_plain": _by_bucket(x[:, :, :4], xhat[:, :, :4], 4)}


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
    cos, sin = rope.rope_cos_sin(np.arange(k.shape[2]), rope_inv_freq(model.config))  # one window: t = index
    k_pre = np.asarray(rope.to_pair_layout(rope.unrotate(k, cos, sin)), np.float32)
    rows = []
    for path in a.codebooks:
        books, meta = load_model_codebooks(path, model)
        keys = k_pre if books.key_rope == "pre" else k
        if books.key_pair_order is not None:  # [L, G, d/2]: each head's pairs in its sub-spaces' order
            order = np.asarray(books.key_pair_order)
            keys = np.stack([np.swapaxes(rope.order_pairs(np.swapaxes(keys[i], 0, 1), order[i]), 0, 1)
                             for i in range(keys.shape[0])])
        row = {"codebooks": os.path.basename(path), "recipe": books.recipe, "key_rope": books.key_rope,
               "calibration_window": meta.get("calib_window"),
               "key": relative_error_by_position(keys, books.key, books.key_transform, books.stages, a.bucket),
               "value": relative_error_by_position(v, books.value, books.value_transform, books.stages, a.bucket)}
        rows.append(row)
        print(f"{row['codebooks']} ({row['recipe']}, calibrated on windows of {row['calibration_window']})")
        for name in ("key", "value"):
            for space in ("fitted", "plain", "first_4_fitted", "first_4_plain"):
                print(f"  {name:5s} {space:14s} " + " ".join(f"{e:.4f}" for e in row[name][space]), flush=True)
    if a.json:
        write_json(a.json, {"model": a.model, "text": a.text, "window": a.window, "bucket": a.bucket,
                            "rows": rows}, force=True)


if __name__ == "__main__":
    main()

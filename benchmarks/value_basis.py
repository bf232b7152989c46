"""Issue 34, one change to the values at the same bits: the basis their 2-dim sub-spaces are cut in.

    PYTHONPATH=. python benchmarks/value_basis.py --base /tmp/kv/po/books_s0/pq4-pre-nu-po.safetensors \\
        --seed 0 --out-dir /tmp/vpca/books --json benchmarks/results/frontier/key_bits/value_basis/basis_s0.json
    million-jax eval --model smollm2 --text builtin:eval --max-tokens 32768 --window 512 --batch 4 --quiet \\
        --cache pq --protocol all --codebooks /tmp/vpca/books/pca_s0.safetensors --json ...

A value sub-space of 2 dims coded with 2^b centroids shares its bits between its two axes by
itself (k-means puts more levels along the wider one). Values have no RoPE, so any orthogonal
(or invertible) map B of the values is free: the codebooks hold it as their value transform and
attention maps its output back by B^-1 (``PQCodebooks.with_transforms``). This script refits
``--base``'s value codebooks (same width, same unit-code / norm flags, its keys untouched) on the
same calibration values in each basis of ``--bases``:

* ``identity``: the model's own axes, refitted here (the baseline of this process: k-means differs
  between processes, so this row, not the base file, is what the others compare with);
* ``pca``: :func:`million_jax.quant.kv_transforms.value_pca_transform`, the principal axes of each
  (layer, KV head)'s values, the i-th widest paired with the i-th narrowest in sub-space i;
* ``wpca``: the same on the output-weighted values B_o v (B_o the output-aware transform,
  ``output_value_transform``), B = value_pca_transform(B_o v) B_o;

and writes one codebook file per basis, with the value reconstruction error on ``--sample``
calibration values per basis: relative (sum |v - v_hat|^2 / sum |v|^2) and weighted by the output
projection (mean e^T G e, G = ``output_gram``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from _value_base import add_value_base_args, calibration_values, command_line, open_value_base
from million_app.calibrate import codebook_metadata, save_model_codebooks
from million_jax.calibration.fit import fit_value_centroids
from million_jax.quant.kv_codebooks import unit_vectors
from million_jax.quant.kv_transforms import (output_gram, output_value_transform, transform_rows,
                                             value_pca_transform)
from million_jax.quant.pq import Codebooks, decode, encode

BASES = ("identity", "pca", "wpca")


def basis(name: str, u: np.ndarray, wo: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray | None:
    """The value transform float32[L, Hkv, d, d] of basis ``name`` for the coded values u float[L, Hkv, N, d]."""
    if name == "identity":
        return None
    if name == "pca":
        return value_pca_transform(u)
    bo = output_value_transform(wo, n_heads, n_kv_heads)
    return np.einsum("lhij,lhjk->lhik", value_pca_transform(transform_rows(u, bo)), bo).astype(np.float32)


def value_errors(books, v: np.ndarray, gram: np.ndarray | None = None) -> dict[str, float]:
    """Relative error of values v float[L, Hkv, N, d] as the cache codes them (value transform, unit
    codes, norms), and with ``gram`` float[L, Hkv, d, d] (``output_gram``) the output-weighted one."""
    num = den = weighted = 0.0
    for layer in range(v.shape[0]):
        x = v[layer]
        x_in = unit_vectors(x) if books.unit_codes and books.value_norms else x
        if books.value_transform is not None:
            x_in = np.einsum("hij,hnj->hni", np.asarray(books.value_transform[layer]), x_in)
        cb = Codebooks(books.value.centroids[layer])
        xh = np.asarray(decode(cb, encode(cb, np.asarray(x_in, np.float32))), np.float64)
        if books.value_transform is not None:
            xh = np.einsum("hij,hnj->hni", np.asarray(books.output_transform[layer], np.float64), xh)
        if books.value_norms:
            xh = unit_vectors(xh) * np.linalg.norm(x, axis=-1, keepdims=True)
        e = x.astype(np.float64) - xh
        num += float(np.sum(e ** 2))
        den += float(np.sum(x.astype(np.float64) ** 2))
        if gram is not None:
            weighted += float(np.einsum("hni,hij,hnj->", e, gram[layer], e)) / (x.shape[0] * x.shape[1])
    out = {"relative": num / den}
    if gram is not None:
        out["output_weighted"] = weighted / v.shape[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_value_base_args(p)
    p.add_argument("--bases", default=",".join(BASES))
    a = p.parse_args()
    names = a.bases.split(",")
    if not names or any(n not in BASES for n in names):
        raise SystemExit(f"--bases must be a comma list of {BASES}, got {a.bases!r}")
    model, base, meta = open_value_base(a)
    c = model.config
    v, used = calibration_values(a, model, base)
    u = unit_vectors(v) if base.unit_codes and base.value_norms else v
    wo = np.asarray(model.params["layers"]["wo"], np.float32)[list(c.global_layers)]
    gram = output_gram(wo, c.n_heads, c.n_kv_heads)
    pick = np.sort(np.random.default_rng(a.seed).choice(v.shape[2], min(a.sample, v.shape[2]), replace=False))
    report = {"command": command_line("value_basis.py", a), "calib_tokens": used, "rows": []}
    os.makedirs(a.out_dir, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        b = basis(name, u, wo, c.n_heads, c.n_kv_heads)
        coded = u if b is None else transform_rows(u, b)
        cent = fit_value_centroids(coded, base.value_nbits, key=jax.random.fold_in(jax.random.PRNGKey(a.seed), 77),
                                   max_vectors=a.max_vectors, iters=a.iters)
        books = dataclasses.replace(base, value=Codebooks(jnp.asarray(cent)))
        if b is not None:
            books = books.with_transforms(value_transform=b)
        out = os.path.join(a.out_dir, f"{name}_s{a.seed}.safetensors")
        save_model_codebooks(out, books, codebook_metadata(
            model, books, calib_text=a.calib, calib_tokens=used, calib_windows=[512], seed=a.seed,
            recipe=f"{meta.get('recipe', 'base')} values {name}", precise_sinks=meta.get("precise_sinks", 0)),
            flag="--out-dir", force=True)
        row = {"basis": name, "file": out, **value_errors(books, v[:, :, pick], gram),
               "fit_s": round(time.perf_counter() - t0, 1)}
        report["rows"].append(row)
        print(row, flush=True)
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

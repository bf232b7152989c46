"""Issue 34, a measurement before a format change: key bits allocated across RoPE pairs.

    PYTHONPATH=. python benchmarks/pair_bit_allocation.py --base /tmp/kv/books_s0/pq4-pre-nu.safetensors \\
        --key-books 9=/tmp/kv/books_s0/pq4-pre-nu-k4.5v3.5.safetensors,10=/tmp/kv/books_s0/pq4-pre-nu-k5v3.safetensors \\
        --out-dir /tmp/kv --json benchmarks/results/frontier/key_bits/allocation_s0.json
    million-jax eval --model smollm2 --text builtin:eval --max-tokens 32768 --window 512 --batch 4 --quiet \\
        --cache pq --protocol all --codebooks /tmp/kv/alloc_head.safetensors --json ...

Pre-RoPE key codebooks (``calibrate --rope pre``) give each RoPE pair its own 2-dim sub-space and
every pair the same bits. The error of pair m enters a score as q_m . R(t) e_m; averaged over the
rotation its variance is E|q_m|^2 E|e_m|^2 / 2, so pairs that the queries read strongly (and
whose keys are hard to code) deserve more bits. This script measures how much a per-pair
allocation at the same mean width would buy, without a cache format for codes of mixed widths:

1. key codebooks at each width of ``--widths`` (default 6..10 bits), fitted on the same
   calibration keys as ``--base`` (``--key-books W=FILE`` reuses files of the same recipe and
   seed; the other widths are fitted here with ``--base``'s recipe flags: pre-RoPE, norms, unit);
2. per (layer, KV head, pair) and width, that weighted error on ``--sample`` calibration keys;
3. a greedy allocation that keeps the mean at ``--base``'s key width: per (layer, KV head)
   (``alloc_head``) and one for the whole model (``alloc_global``);
4. codebook files that compute exactly that allocation with today's cache: each pair's centroids
   are padded to 2^max(widths) with copies of its centroid 0 (the encoder's argmin keeps the
   first of equal distances, so a padded entry is never chosen). Such a file *stores* max(widths)
   bits per key code, so its ``bits_per_element`` is not the allocation's; the perplexity is.

Values and the norm flags are ``--base``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from million_app.calibrate import calibration_kvq, codebook_metadata, load_model_codebooks, save_model_codebooks
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.recipes import Recipe, fit_recipe
from million_jax.calibration.pair_bits import (greedy_allocation, pad_centroids, pair_key_error, pair_query_energy,
                                               shared_width_allocation, widths_in_pair_order)
from million_jax.quant.kv_codebooks import PQCodebooks
from million_jax.quant.pq import Codebooks


def pair_score_error(centroids: dict[int, np.ndarray], k: np.ndarray, gram: np.ndarray, count: np.ndarray,
                     unit: bool) -> np.ndarray:
    """float64[L, H, P, len(widths)]: E|q_m|^2 E|k_m - k_hat_m|^2 / 2 per pair m and width
    (:mod:`million_jax.calibration.pair_bits`; the base's keys carry norms).

    centroids: width -> key centroids float32[L, H, P, 2^w, 2] (pair layout); k float32[L, H, N, d]
    pre-RoPE keys; gram float[L, H, d, d] / count [L, H] the query second moments."""
    q2 = pair_query_energy(gram, count)
    return np.stack([q2 * pair_key_error(centroids[w], k, norms=True, unit=unit) / 2 for w in sorted(centroids)],
                    axis=-1)


def padded_books(base: PQCodebooks, centroids: dict[int, np.ndarray], index: np.ndarray) -> PQCodebooks:
    """``base`` with key centroids float32[L, H, P, 2^max(w), 2]: pair (l, h, m) takes the centroids of
    width ``widths[index[l, h, m]]``, padded with copies of its centroid 0 (stored at the widest)."""
    widths = np.asarray(sorted(centroids))
    return dataclasses.replace(base, key=Codebooks(jnp.asarray(pad_centroids(centroids, widths[index]))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="a calibrate file of a pre-RoPE recipe with 2-dim key sub-spaces")
    p.add_argument("--key-books", default="", help="W=FILE,...: files of the same recipe and seed with W-bit keys")
    p.add_argument("--widths", default="6,7,8,9,10")
    p.add_argument("--calib", default="builtin:calib")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=4096, help="calibration keys per (layer, head) the errors use")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model("smollm2")
    base, meta = load_model_codebooks(a.base, model)
    if base.key_rope != "pre" or base.key.centroids.shape[-1] != 2 or base.stages != 1:
        raise SystemExit("--base must hold pre-RoPE keys in 2-dim sub-spaces (one RoPE pair each), one stage")
    if base.key_parts is not None or base.key_pair_order is not None:
        raise SystemExit(f"--base must hold keys of one width in the natural pair order, got {base.recipe}")
    widths = sorted(int(w) for w in a.widths.split(","))
    if widths != list(range(widths[0], widths[-1] + 1)) or base.key_nbits not in widths:
        raise SystemExit(f"--widths must be consecutive and hold the base's key width {base.key_nbits}")
    centroids = {base.key_nbits: np.asarray(base.key.centroids)}
    for item in filter(None, a.key_books.split(",")):
        w, path = item.split("=", 1)
        books, _ = load_model_codebooks(path, model)
        same = (books.key_rope, books.key.centroids.shape[-1], books.stages, books.key_norms, books.unit_codes) == \
            (base.key_rope, 2, 1, base.key_norms, base.unit_codes)
        same = same and books.key_parts is None and books.key_pair_order is None
        if not same or books.key_nbits != int(w):
            raise SystemExit(f"--key-books {item}: not --base's recipe with {w}-bit keys "
                             f"(got {books.recipe}, {books.key_nbits}-bit keys)")
        centroids[int(w)] = np.asarray(books.key.centroids)
    k, v, gram, count, used = calibration_kvq(model, tokenize(model, load_text(a.calib, "--calib")),
                                              tokens=a.tokens, window=512, key_rope="pre")
    for w in widths:
        if w not in centroids:
            r = Recipe(f"keys{w}", 2, w, 2, w, rope="pre", norms=base.key_norms, unit=base.unit_codes)
            centroids[w] = np.asarray(fit_recipe(r, model, k, v, gram, count, seed=a.seed).key.centroids)
    pick = np.sort(np.random.default_rng(a.seed).choice(k.shape[2], min(a.sample, k.shape[2]), replace=False))
    err = pair_score_error({w: centroids[w] for w in widths}, k[:, :, pick], gram, count, base.unit_codes)
    L, H, P, _ = err.shape
    start = widths.index(base.key_nbits)
    per_head = np.stack([[greedy_allocation(err[l, h], start) for h in range(H)] for l in range(L)])
    glob = np.broadcast_to(greedy_allocation(err.sum((0, 1)), start), (L, H, P))
    slot_width, perm = shared_width_allocation(err.reshape(L * H, P, -1), start)
    shared = widths_in_pair_order(slot_width, perm).reshape(L, H, P)

    def total(index: np.ndarray) -> float:
        return float(np.take_along_axis(err, index[..., None], -1).sum())

    uniform = np.full((L, H, P), start)
    report = {"command": "PYTHONPATH=. python benchmarks/pair_bit_allocation.py " + " ".join(
        f"--{k_.replace('_', '-')} {v_}" for k_, v_ in vars(a).items() if v_ != ""),
        "widths": widths, "calib_tokens": used,
        "global_bits": [widths[i] for i in glob[0, 0]],
        "shared_slot_bits": [widths[i] for i in slot_width],
        "shared_pair_order": perm.reshape(L, H, P).tolist(),
        "per_head_bits": np.asarray(widths)[per_head].tolist(),
        "score_error_vs_uniform": {"alloc_head": total(per_head) / total(uniform),
                                   "alloc_global": total(glob) / total(uniform),
                                   "alloc_shared": total(shared) / total(uniform)},
        "score_error_share_per_pair": (err[..., start].sum((0, 1)) / err[..., start].sum()).tolist()}
    for w in widths:
        if w != base.key_nbits:
            report["score_error_vs_uniform"][f"uniform_{w}"] = total(np.full((L, H, P), widths.index(w))) / total(uniform)
    os.makedirs(a.out_dir, exist_ok=True)
    np.savez(os.path.join(a.out_dir, "pair_errors.npz"), err=err, widths=np.asarray(widths))
    for name, index in (("alloc_head", per_head), ("alloc_global", glob), ("alloc_shared", shared)):
        books = padded_books(base, centroids, index)
        save_model_codebooks(os.path.join(a.out_dir, f"{name}.safetensors"), books, codebook_metadata(
            model, books, calib_text=a.calib, calib_tokens=used, calib_windows=[512], seed=a.seed,
            recipe=f"{meta.get('recipe', 'base')} keys {name}"), flag="--out-dir", force=True)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["score_error_vs_uniform"]), report["global_bits"])


if __name__ == "__main__":
    main()

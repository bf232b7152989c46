"""Issue 34, a measurement before a format change: value bits allocated across 2-dim sub-spaces.

    PYTHONPATH=. python benchmarks/value_bit_allocation.py --base /tmp/kv/pa/books_s0/pq4-pre-nu-pa.safetensors \\
        --seed 0 --out-dir /tmp/kv/val0 --json benchmarks/results/frontier/key_bits/value_allocation_s0.json
    million-jax eval --model smollm2 --text builtin:eval --max-tokens 32768 --window 512 --batch 4 --quiet \\
        --cache pq --protocol all --codebooks /tmp/kv/val0/value_shared.safetensors --json ...

The keys' bits went where the queries read them (``benchmarks/pair_bit_allocation.py``,
:mod:`million_jax.calibration.pair_bits`). The values' 8 bits per 2-dim sub-space are still uniform,
though an error in value sub-space m moves the layer's output by tr(G_mm) / 2 per unit of error
(G = sum over the KV head's query heads of Wo_h Wo_h^T; ``value_output_energy``), and values have
no RoPE: a per-head permutation of value dims is a value transform (folded into the output), so
every KV head may order its sub-spaces freely. This script measures what that would buy:

1. value codebooks at each width of ``--widths`` (default 6..10 bits), fitted on the same
   calibration values as ``--base`` (its unit-code / norm flags);
2. per (layer, KV head, sub-space) and width, the output-weighted value error on ``--sample``
   calibration values;
3. allocations at the base's mean width: per (layer, KV head) (``value_head``), one width per
   sub-space for the model with each head ordering its sub-spaces (``value_shared``, what a value
   layout plus a permutation per head would store) and one width per sub-space index
   (``value_global``);
4. codebook files that compute each allocation with today's cache: value centroids padded to
   2^max(widths) with copies of centroid 0 (they *store* max(widths) bits per value code: only their
   perplexity means anything). Keys and every flag are ``--base``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from _value_base import add_value_base_args, calibration_values, command_line, open_value_base
from million_app.calibrate import codebook_metadata, save_model_codebooks
from million_jax.calibration.fit import fit_value_centroids
from million_jax.calibration.pair_bits import (greedy_allocation, pad_centroids, shared_width_allocation,
                                               subspace_error, value_output_energy, widths_in_pair_order)
from million_jax.quant.kv_codebooks import unit_vectors
from million_jax.quant.pq import Codebooks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_value_base_args(p)
    p.add_argument("--widths", default="6,7,8,9,10")
    a = p.parse_args()
    model, base, meta = open_value_base(a)
    c = model.config
    widths = sorted(int(w) for w in a.widths.split(","))
    if widths != list(range(widths[0], widths[-1] + 1)) or base.value_nbits not in widths:
        raise SystemExit(f"--widths must be consecutive and hold the base's value width {base.value_nbits}")
    v, used = calibration_values(a, model, base)
    unit = base.unit_codes and base.value_norms
    centroids = {base.value_nbits: np.asarray(base.value.centroids)}
    for w in widths:
        if w not in centroids:
            print(f"value codebooks of {w} bits", flush=True)
            centroids[w] = fit_value_centroids(unit_vectors(v) if unit else v, w,
                                               key=jax.random.fold_in(jax.random.PRNGKey(a.seed), 2000 + w),
                                               max_vectors=a.max_vectors, iters=a.iters)
    pick = np.sort(np.random.default_rng(a.seed).choice(v.shape[2], min(a.sample, v.shape[2]), replace=False))
    wo = np.asarray(model.params["layers"]["wo"], np.float32)[list(c.global_layers)]
    energy = value_output_energy(wo, c.n_heads, c.n_kv_heads)  # [L, H, P]
    err = np.stack([energy * subspace_error(centroids[w], v[:, :, pick], norms=base.value_norms, unit=unit,
                                            pair_layout=False) for w in widths], axis=-1)  # [L, H, P, W]
    L, H, P, W = err.shape
    start = widths.index(base.value_nbits)
    per_head = np.stack([[greedy_allocation(err[l_, h], start) for h in range(H)] for l_ in range(L)])
    glob = np.broadcast_to(greedy_allocation(err.sum((0, 1)), start), (L, H, P))
    slot, perm = shared_width_allocation(err.reshape(L * H, P, W), start)
    shared = widths_in_pair_order(slot, perm).reshape(L, H, P)

    def total(index: np.ndarray) -> float:
        return float(np.take_along_axis(err, index[..., None], -1).sum())

    uniform = total(np.full((L, H, P), start))
    report = {"command": command_line("value_bit_allocation.py", a),
        "widths": widths, "calib_tokens": used,
        "shared_slot_bits": [widths[i] for i in slot],
        "global_bits": [widths[i] for i in glob[0, 0]],
        "value_error_vs_uniform": {"value_head": total(per_head) / uniform, "value_shared": total(shared) / uniform,
                                   "value_global": total(glob) / uniform,
                                   **{f"uniform_{w}": total(np.full((L, H, P), j)) / uniform
                                      for j, w in enumerate(widths)}},
        "energy_spread_per_head": float(np.mean(energy.max(-1) / energy.min(-1)))}
    os.makedirs(a.out_dir, exist_ok=True)
    np.savez(os.path.join(a.out_dir, "value_errors.npz"), err=err, widths=np.asarray(widths))
    for name, index in (("value_head", per_head), ("value_shared", shared), ("value_global", glob)):
        books = dataclasses.replace(base, value=Codebooks(jnp.asarray(pad_centroids(centroids,
                                                                                    np.asarray(widths)[index]))))
        save_model_codebooks(os.path.join(a.out_dir, f"{name}.safetensors"), books, codebook_metadata(
            model, books, calib_text=a.calib, calib_tokens=used, calib_windows=[512], seed=a.seed,
            recipe=f"{meta.get('recipe', 'base')} values {name}",
            precise_sinks=meta.get("precise_sinks", 0)), flag="--out-dir", force=True)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["value_error_vs_uniform"]), report["shared_slot_bits"])


if __name__ == "__main__":
    main()

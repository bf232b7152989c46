"""Issue 34, the needle grid: is PQ's log p(key) loss in the keys or in the values?

The prompts of ``million-jax niah`` for the same ``--lengths``, ``--depths``, ``--trials`` and
``--seed`` (the same key draws), each answered with a dense float32 cache whose chosen parts are
read as their reconstruction through a ``calibrate`` file's codebooks, every token from codes
(``pq_loss_split.ReconstructedCache``: decode(encode(x)) with the file's transforms, pair order
and explicit norms, as the PQ cache reads them):

* ``keys+values``: both (the check: close to ``million-jax niah --cache pq --protocol all``),
* ``keys``: keys reconstructed, values exact,
* ``values``: values reconstructed, keys exact.

Per part and cell: found (greedy) and log p(key) (teacher forced), as ``niah`` reports them; with
``--dense`` (a ``niah`` JSON of the dense cache on the same cells) the mean log p loss against it
over the cells dense finds.

    PYTHONPATH=. python benchmarks/needle_split.py --codebooks /tmp/kv/po/books_s0/pq4-pre-nu-po.safetensors \\
        --dense benchmarks/results/frontier/smollm2_32k/niah_grid_dense.json \\
        --json benchmarks/results/frontier/smollm2_32k/needle_split_po_s0.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from benchmarks.pq_loss_split import make
from million_app.calibrate import load_model_codebooks
from million_app.niah import cell_scores, draw_cells, parse_depths
from million_app.passkey import passkey_prompt, run_trials
from models import load_model

PARTS = {"keys+values": (True, True), "keys": (True, False), "values": (False, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--codebooks", required=True)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="keys,values,keys+values")
    p.add_argument("--batch", type=int, default=5)
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward")
    p.add_argument("--dense", help="a `million-jax niah` JSON of the dense cache on the same cells")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    parts = a.parts.split(",")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        raise SystemExit(f"unknown --parts {unknown}: choose from {sorted(PARTS)}")
    model = load_model(a.model)
    books, meta = load_model_codebooks(a.codebooks, model)
    own = dict(norm_k=books.key_norms, norm_v=books.value_norms, unit=books.unit_codes,
               sinks=int(meta.get("precise_sinks", 0)))
    lengths, depths = [int(x) for x in a.lengths.split(",")], parse_depths(a.depths)
    rng = np.random.default_rng(a.seed)  # the key draws of `million-jax niah` for the same flags
    cells = {length: draw_cells(rng, depths, a.trials) for length in lengths}
    out: dict[str, Any] = {"command": "PYTHONPATH=. python benchmarks/needle_split.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None),
        "lengths": lengths, "depths": depths, "trials": a.trials, "seed": a.seed,
        "precise_sinks": own["sinks"], "results": {}}
    dense = json.load(open(a.dense)) if a.dense else None
    if dense is not None and any(x not in dense["lengths"] for x in lengths):
        raise SystemExit(f"--dense {a.dense} has lengths {dense['lengths']}, not all of {lengths}")
    for part in parts:
        qk, qv = PARTS[part]
        kw = dict(own, quant_k=qk, quant_v=qv)
        acc, logp, cells_out, t0 = [], [], [], time.perf_counter()
        for length in lengths:
            prompts = [passkey_prompt(model, length, k, d) for d, k in cells[length]]
            rows = run_trials(model, prompts, [k for _, k in cells[length]], None, min(a.batch, len(prompts)),
                              a.chunk or None, make_cache=lambda b, n, kw=kw: (make(model.config, books, b, n, **kw),
                                                                                books))
            cells_out += [{"length": length, "depth": d, **r} for (d, _), r in zip(cells[length], rows)]
            cell_acc, cell_logp = cell_scores(rows, len(depths), a.trials)
            acc.append(cell_acc)
            logp.append(cell_logp)
            print(json.dumps({"part": part, "length": length, "found": acc[-1], "logp": np.round(logp[-1], 3).tolist()}),
                  flush=True)
        res = {"accuracy": acc, "key_logp": logp, "cells": cells_out, "found": int(round(np.sum(acc) * a.trials)),
               "wall_s": round(time.perf_counter() - t0, 1)}
        if dense is not None:
            (_, dres), = dense["results"].items()
            rows_at = [dense["lengths"].index(x) for x in lengths]
            d_acc, d_logp = np.array(dres["accuracy"])[rows_at], np.array(dres["key_logp"])[rows_at]
            ok = d_acc > 0
            res["dense_found"] = int(round(d_acc.sum() * a.trials))
            res["mean_logp_loss_vs_dense"] = round(float((d_logp - np.array(logp))[ok].mean()), 4)
        out["results"][part] = res
        print(json.dumps({part: {k: v for k, v in res.items() if k not in ("accuracy", "key_logp", "cells")}}), flush=True)
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Issue 34, PQ improvement (b): a random rotation of the values before PQ (OPQ-style, folded into
the output after attention), one change against today's recipe, same samples, same seed.

    PYTHONPATH=. python benchmarks/pq_value_rotation.py --recipes pq4-pre,pq2-r2-qa --seed 0 \\
        --json benchmarks/results/frontier/pq_value_rotation.json

For each recipe: calibration K/V (and query statistics) collected once, then the recipe fitted
as ``calibrate`` fits it and again with every value encoded as R v, R the seeded orthogonal
rotation of its layer (:func:`million_jax.quant.turboquant.layer_rotations`, the turboquant
cache's), stored as the codebooks' value transform (output transform R^T applied after the code
attention, in ``PQLayer.attend``: every attention path and the kernel see plain PQ). Both
evaluated with every key/value from codes on the same windows; value reconstruction error too.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from million_app.calibrate import calibration_kvq
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import evaluate
from million_app.recipes import RECIPES
from million_jax import CacheSpec
from million_jax.calibration.fit import fit_kv_codebooks
from million_jax.quant.kv_transforms import query_aware_key_transform
from million_jax.quant.turboquant import layer_rotations
from models.decoder import rope_inv_freq
from value_basis import value_errors


def value_error(books, v: np.ndarray) -> float:
    """sum ||v - v_hat||^2 / sum ||v||^2 over the first 2048 calibration values, transform included."""
    return value_errors(books, v[:, :, :2048])["relative"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="pq4-pre,pq2-r2-qa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--max-vectors", type=int, default=4096)
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model("smollm2")
    c = model.config
    eval_ids = tokenize(model, load_text("builtin:eval", "--text"))
    calib_ids = tokenize(model, load_text("builtin:calib", "--calib"))
    out = {"settings": vars(a), "rows": []}
    cal = {}
    for name in a.recipes.split(","):
        rec = RECIPES[name]
        if rec.rope not in cal:
            cal[rec.rope] = calibration_kvq(model, calib_ids, tokens=a.calib_tokens, window=512, key_rope=rec.rope)
        k, v, gram, count, _ = cal[rec.rope]
        kt = query_aware_key_transform(gram, count) if rec.query_aware else None
        rot = np.asarray(layer_rotations(a.seed, k.shape[0], c.head_dim))
        rot = np.broadcast_to(rot[:, None], (k.shape[0], k.shape[1], c.head_dim, c.head_dim)).copy()
        for variant, vt in (("today", None), ("value rotation", rot)):
            t0 = time.perf_counter()
            books = fit_kv_codebooks(k, v, **rec.budgets(c.head_dim), granularity="layer_head",
                                     key=jax.random.PRNGKey(a.seed), max_vectors=a.max_vectors, iters=a.iters,
                                     key_transform=kt, value_transform=vt, stages=rec.stages,
                                     rope_inv_freq=rope_inv_freq(c) if rec.rope == "pre" else None)
            fit_s = time.perf_counter() - t0
            r = evaluate(model, eval_ids, CacheSpec("pq", codebooks=books, quantize_all=True), window=512,
                         max_tokens=a.max_tokens)
            row = dict(recipe=name, variant=variant, ppl=r["ppl"], storage_bits_per_element=r["storage_bits_per_element"],
                       value_error=value_error(books, v) if rec.stages == 1 else None, fit_seconds=fit_s)
            out["rows"].append(row)
            print(row, flush=True)
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

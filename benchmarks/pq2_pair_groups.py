"""Issue 34 item 3 (C): 2 b/elem keys before RoPE in 4-dim sub-spaces made of two RoPE pairs.

    PYTHONPATH=. python benchmarks/pq2_pair_groups.py --compare /tmp/fr/pq2_s0.safetensors \\
        --json benchmarks/results/frontier/pq2_pair_groups.json

Today's 2 b/elem pre-RoPE keys (pq2-pre) spend 4 bits on each 2-dim RoPE pair: 16 centroids
per pair. Here the same 2 b/elem as 256 centroids over 4-dim sub-spaces, each the union of two
RoPE pairs (the rotation then stays block-diagonal inside a sub-space: attention would need
four lookup tables per sub-space instead of two; no library change is made here). Groupings:

* ``adjacent``: pairs (2j, 2j + 1), neighbouring frequencies;
* ``far``: pairs (j, j + d/4), a fast pair with a slow one.

Keys: the calibration forward of ``calibrate`` (``--tokens`` of builtin:calib in 512-token
windows, keys rotated back to position 0), layer_head codebooks, k-means with ``--iters`` /
``--max-vectors``, seed ``--seed``; error: sum ||k - k_hat||^2 / sum ||k||^2 over every layer and
KV head of the first ``--max-tokens`` of builtin:eval in 512-token windows, overall and over the
first 4 positions of each window (the attention sinks). The pre-RoPE error is the post-RoPE one
(the rotation is orthogonal). ``--compare FILE``: the keys of a ``calibrate`` file on the same
tokens (a post-RoPE, query-aware file measured in the model's space: k_hat = A^-1 decode(encode(A k))).

``--ppl``: also the perplexity of ``million-jax eval --protocol all`` windows (``--max-tokens`` of
builtin:eval, 512-token windows) with only the keys from codes (values exact: ``pq_loss_split.py``'s
reconstruction with the variant's codebooks marked pre-RoPE), for each variant: plain, rescaled to
each key's bf16 norm (norm-explicit), and ``--unit``: codebooks fitted on unit keys, rescaled to
the norm (NEQ). ``far`` is the library's two-pair layout (pq2-pre-g2's keys); ``adjacent`` has no
library layout and is refused with ``--ppl``.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pq_loss_split import reconstructed_ppl, with_norm_of
from million_app.calibrate import calibration_kv, collect_model_kv, load_model_codebooks
from million_app.perplexity import eval_windows
from million_jax.quant.kv_codebooks import PQCodebooks, unit_vectors
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_jax import rope
from million_jax.quant.kv_transforms import inverse, transform_rows
from million_jax.quant.pq import Codebooks, decode, encode, fit_codebooks
from million_jax.quant.residual_pq import decode_stages, encode_stages
from models.decoder import rope_inv_freq


def rel_err(x: np.ndarray, xh: np.ndarray, pos: np.ndarray) -> dict[str, float]:
    """Relative squared error overall and over positions < 4; x [L, Hkv, N, d], pos [N]."""
    e, r = ((x - xh) ** 2).sum(-1), (x ** 2).sum(-1)
    s = pos < 4
    return {"all": float(e.sum() / r.sum()), "first_4": float(e[..., s].sum() / r[..., s].sum()),
            "rest": float(e[..., ~s].sum() / r[..., ~s].sum())}


def grouping(name: str, d: int) -> np.ndarray:
    """Pair order: sub-space j holds pairs order[2j], order[2j + 1] (pair layout dims 2p, 2p + 1)."""
    p = d // 2
    if name == "adjacent":
        pairs = np.arange(p)
    elif name == "far":
        pairs = np.stack([np.arange(p // 2), np.arange(p // 2) + p // 2], axis=1).reshape(-1)
    else:
        raise ValueError(name)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)  # dims permutation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--max-vectors", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="pairs-4bit,adjacent,far")
    p.add_argument("--compare", nargs="*", default=[])
    p.add_argument("--ppl", action="store_true", help="also keys-only perplexity (plain, norms)")
    p.add_argument("--unit", action="store_true", help="with --ppl: also codebooks fitted on unit keys")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model("smollm2")
    c = model.config
    d, inv = c.head_dim, rope_inv_freq(c)
    calib_ids = tokenize(model, load_text("builtin:calib", "--calib"))
    eval_ids = tokenize(model, load_text("builtin:eval", "--text"))
    k_cal, _, used = calibration_kv(model, calib_ids, tokens=a.tokens, window=512, key_rope="pre")
    k_cal = np.asarray(rope.to_pair_layout(k_cal), np.float32)  # [L, Hkv, N, d] pair layout
    k_post, _ = collect_model_kv(model, eval_ids, window=512, max_tokens=a.max_tokens)
    pos = np.arange(k_post.shape[2]) % 512
    cos, sin = rope.rope_cos_sin(pos, inv)
    k_pre = np.asarray(rope.to_pair_layout(rope.unrotate(k_post, cos, sin)), np.float32)
    out = {"settings": vars(a), "calib_tokens": used, "eval_tokens": int(k_post.shape[2]), "rows": []}

    def save(row):
        out["rows"].append(row)
        print(row, flush=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)

    w = eval_windows(eval_ids, 512, a.max_tokens)
    if a.ppl and "adjacent" in a.variants.split(","):
        raise SystemExit("--ppl reads the library's layouts: pairs-4bit (one pair per sub-space) and far (pairs m, "
                         "m + d/4; million_jax.rope.to_pair_layout(x, 2)), not adjacent")
    if a.ppl:
        t0 = time.perf_counter()
        save({"keys": "exact (dense)", "ppl": reconstructed_ppl(model, None, w, quant_k=False, quant_v=False),
              "seconds": time.perf_counter() - t0})
    for name in a.variants.split(","):
        perm = np.arange(d) if name == "pairs-4bit" else grouping(name, d)
        M, nbits = (d // 2, 4) if name == "pairs-4bit" else (d // 4, 8)
        x = k_cal[..., perm]
        rng = np.random.default_rng(a.seed)
        if x.shape[2] > a.max_vectors:
            x = x[:, :, np.sort(rng.choice(x.shape[2], a.max_vectors, replace=False))]
        for unit in (False, True) if a.unit else (False,):
            t0 = time.perf_counter()
            books = fit_codebooks(unit_vectors(x) if unit else x, M, nbits, key=jax.random.PRNGKey(a.seed),
                                  iters=a.iters)
            fit_s = time.perf_counter() - t0
            y = k_pre[..., perm]
            yh = np.asarray(decode(books, encode(books, unit_vectors(y) if unit else y)))
            if unit:
                yh = np.asarray(with_norm_of(jnp.asarray(y), jnp.asarray(yh)))
            label = f"pre-RoPE {name}" + (", unit codes + norms" if unit else "")
            row = {"keys": label, "M": M, "nbits": nbits, "bits_per_element": M * nbits / d,
                   **rel_err(y, yh, pos), "fit_seconds": fit_s}
            if a.ppl:  # the keys as the library reads pre-RoPE codebooks of d / 2M pairs per sub-space
                kb = PQCodebooks.from_centroids(books.centroids, books.centroids, "layer_head",
                                                num_layers=c.n_layers).with_pre_rope_keys(inv)
                row["ppl_keys_only"] = reconstructed_ppl(model, kb, w, quant_v=False, norm_k=unit, unit=unit)
                if not unit:
                    row["ppl_keys_only_norms"] = reconstructed_ppl(model, kb, w, quant_v=False, norm_k=True)
            save(row)
    for path in a.compare:
        books, _ = load_model_codebooks(path, model)
        if books.key_pair_order is not None or books.key_parts is not None:
            raise SystemExit(f"--compare {path}: keys of mixed widths or in a per-head pair order ({books.recipe}) "
                             f"are not read here (this script encodes every key sub-space in the natural order)")
        x = k_pre if books.key_rope == "pre" else k_post
        t = books.key_transform
        kb = Codebooks(books.key.centroids)
        y = x if t is None else transform_rows(x, np.asarray(t))
        yh = np.asarray(decode_stages(kb, encode_stages(kb, y, books.stages), books.stages))
        xh = yh if t is None else transform_rows(yh, inverse(np.asarray(t)))
        save({"keys": f"{path} ({books.recipe}, {books.key_rope}-RoPE)", "bits_per_element":
              books.key_M * books.key_nbits / d, **rel_err(x, xh, pos)})


if __name__ == "__main__":
    main()

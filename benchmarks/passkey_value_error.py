"""Issue 34: how well codebook files code the values of a passkey prompt (the needle grid's text).

    PYTHONPATH=. python benchmarks/passkey_value_error.py /tmp/vpca/vb/identity_s0.safetensors \\
        /tmp/vpca/vb/pca_s0.safetensors --length 2048 --depth 1 --json .../passkey_value_error.json

One prompt of ``million_app.passkey`` (``--length`` tokens, the needle at ``--depth``, key
``--key``) through the dense model; its values (every global layer and KV head) coded by each
file as the cache codes them (unit codes, norms, value transform;
``benchmarks/value_basis.py::value_errors``), relative error sum |v - v_hat|^2 / sum |v|^2 on the
needle's tokens, on the key's digit tokens and on the filler between the prompt's first 64 tokens
and the needle. Calibration text is Python's docs; this prompt is repeated filler sentences and a
number, so a file that codes calibration-like text well may code this worse.
"""
from __future__ import annotations

import argparse
import json

from million_app.calibrate import collect_model_kv, load_model_codebooks
from million_app.loading import open_model, tokenize
from million_app.passkey import NEEDLE, passkey_prompt
from value_basis import value_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("codebooks", nargs="+")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depth", type=float, default=1.0)
    p.add_argument("--key", type=int, default=123457)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model = open_model(a.model)
    ids = passkey_prompt(model, a.length, a.key, a.depth)
    needle = tokenize(model, NEEDLE.format(key=a.key))
    start = next(i for i in range(len(ids) - len(needle) + 1) if ids[i:i + len(needle)] == needle)
    span = range(start, start + len(needle))
    digits = [i for i in span if any(ch.isdigit() for ch in model.tokenizer.decode([ids[i]]))]
    parts = {"needle": list(span), "digits": digits, "filler": list(range(64, start))}
    _, v = collect_model_kv(model, ids, window=len(ids), batch=1, key_rope="pre")
    report = {"command": "PYTHONPATH=. python benchmarks/passkey_value_error.py " + " ".join(a.codebooks) + " "
              + " ".join(f"--{k} {getattr(a, k)}" for k in ("model", "length", "depth", "key", "json")),
              "prompt_tokens": len(ids), "needle_start": start, "parts_tokens": {k: len(x) for k, x in parts.items()},
              "rows": []}
    for path in a.codebooks:
        books, _ = load_model_codebooks(path, model)
        row = {"codebooks": path, "recipe": books.recipe,
               **{k: value_errors(books, v[:, :, pos])["relative"] for k, pos in parts.items() if pos}}
        report["rows"].append(row)
        print(row, flush=True)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

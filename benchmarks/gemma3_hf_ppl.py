"""Perplexity of transformers' Gemma3ForCausalLM (the same GGUF, float32) on exactly the windows
`million-jax eval --model gemma3-270m` uses: one BOS + 511 text tokens per window, every text token
but the window's first a target (million_app/perplexity.py).

    MILLION_JAX_CACHE=... PYTHONPATH=. python benchmarks/gemma3_hf_ppl.py --max-tokens 4096 \
        --json benchmarks/results/gemma3_270m/hf_dense.json
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from million_app.corpus import read_text
from million_app.loading import tokenize
from million_app.perplexity import eval_windows
from models import load_model
from models.loading import gemma3_gguf_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    ours = load_model("gemma3-270m")
    ids = tokenize(ours, read_text("builtin:eval"))
    text_w = eval_windows(ids, a.window - 1, a.max_tokens - a.max_tokens // a.window)
    w = np.concatenate([np.full((len(text_w), 1), ours.config.bos_id), text_w], axis=1)
    d, f = os.path.split(gemma3_gguf_path())
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for row in w:
        with torch.no_grad():
            logits = hf(torch.tensor(row[None])).logits[0].double()
        logp = torch.log_softmax(logits[:-1], -1)
        nll = -logp.gather(1, torch.tensor(row[1:, None]))[:, 0].numpy()[1:]  # skip BOS -> first text token
        total += float(nll.sum())
        count += nll.size
    out = {"ppl": math.exp(total / count), "nll": total / count, "tokens": count, "windows": len(w),
           "window": a.window, "reference": "transformers Gemma3ForCausalLM from the same GGUF, float32"}
    print(out)
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

"""A tiny random decoder (LLaMA, or Gemma 3 with ``config=preset("tiny-gemma3")``) written as an HF
checkpoint directory, for tests and quick trials.

``write_tiny_checkpoint(dir)`` writes ``config.json``, ``model.safetensors`` and a
byte-level ``tokenizer.json`` (256 tokens, one per byte, no merges), so every command
can be driven end to end offline in seconds: ``million-jax eval --model DIR ...``.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from models import LlamaConfig, init_params, preset
from models.families import FAMILIES
from models.hf_loader import hf_tensor_name

_MATRICES = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}


def byte_tokenizer():
    """A ``tokenizers.Tokenizer``: one token per UTF-8 byte (GPT-2 byte alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from models.tokenizer import _byte_alphabet

    vocab = {ch: b for b, ch in _byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tiny_checkpoint(path: str, *, config: LlamaConfig | None = None, seed: int = 0,
                          std: float = 0.1) -> str:
    """Write a random model (default: the ``tiny`` preset, vocab 256) to directory ``path``."""
    from safetensors.numpy import save_file

    config = config or preset("tiny")
    if config.vocab != 256:
        raise ValueError("the byte-level tokenizer needs vocab == 256")
    os.makedirs(path, exist_ok=True)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.PRNGKey(seed), stddev=std))
    family = config.family
    offset = np.float32(FAMILIES[family].hf_norm_offset)  # HF stores w where we hold offset + w

    def as_stored(key: str, w: np.ndarray) -> np.ndarray:
        w = w.T if key in _MATRICES else w - offset if key.endswith("norm") else w
        return np.ascontiguousarray(w, np.float32)

    tensors = {}
    for key, arr in params.items():
        if key == "layers":
            for lkey, stacked in arr.items():
                for i in range(config.n_layers):
                    tensors[hf_tensor_name(lkey, i, family)] = as_stored(lkey, stacked[i])
        else:
            tensors[hf_tensor_name(key, None, family)] = as_stored(key, arr)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=1)
    byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
    return path

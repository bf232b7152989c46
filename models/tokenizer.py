"""Building a ``tokenizers.Tokenizer`` from the vocabulary stored in GGUF metadata.

GGUF files carry no tokenizer.json; they store ``tokenizer.ggml.*`` fields
(model kind, pre-tokenizer name, tokens, scores, merges, token types, special
ids). ``tokenizer_from_gguf_fields`` dispatches on ``tokenizer.ggml.model``:

    "gpt2"   byte-level BPE (SmolLM, LLaMA-3, GPT-2)      models/tokenizer_bpe.py
    "llama"  SentencePiece BPE (LLaMA-1/2, Gemma 1-3)      models/tokenizer_spm.py

and adds the post-processor: BOS first when ``tokenizer.ggml.add_bos_token``
is true (the default for SentencePiece files, as in llama.cpp and HF), EOS
last when ``tokenizer.ggml.add_eos_token`` is true.

Building Gemma 3's 262,144-token tokenizer takes ~1.5 s of CPU (0.75 s of it
rebuilding the 514,906 merges, models/spm_merges.py). ``cached_tokenizer``
keeps the result as ``tokenizers`` JSON (14 MB) wherever the caller chooses,
keyed by a fingerprint of the metadata; loading it takes ~1.2 s of CPU, since
``Tokenizer.from_str`` itself spends ~0.7 s on the merges, so the cache saves
little and is optional::

    meta = read_gguf_metadata(path)                           # models/gguf_metadata.py
    tok = cached_tokenizer(meta, path, cache_dir / "gemma3-270m.tokenizer.json")
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np
from tokenizers import Tokenizer, processors

from models.errors import CheckpointError
from models.tokenizer_bpe import byte_alphabet, byte_level_bpe
from models.tokenizer_spm import sentencepiece_bpe

__all__ = ["tokenizer_from_gguf_fields", "tokenizer_from_gguf", "cached_tokenizer",
           "tokenizer_fingerprint"]

_BUILDERS = {"gpt2": byte_level_bpe, "llama": sentencepiece_bpe}
# bumped whenever the tokenizer built from the same metadata changes (invalidates caches)
_BUILD_VERSION = "1"
_CACHE_MAGIC = "million-jax tokenizer cache"

# kept for million_app/tiny.py, which builds a byte tokenizer from the same alphabet
_byte_alphabet = byte_alphabet


def _special_id(meta: Mapping[str, Any], field: str, n: int, source: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{field}")
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)) or not 0 <= int(value) < n:
        raise CheckpointError(f"{source}: tokenizer.ggml.{field}={value!r} is outside the "
                              f"vocabulary of {n} tokens")
    return int(value)


def _post_processor(meta: Mapping[str, Any], spelled: Sequence[str], kind: str,
                    source: str) -> processors.TemplateProcessing | None:
    """BOS / EOS around each sequence, laid out as HF's ``update_post_processor`` does."""
    n = len(spelled)
    bos = _special_id(meta, "bos_token_id", n, source)
    eos = _special_id(meta, "eos_token_id", n, source)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return None

    def around(seq: str, type_id: int) -> str:
        parts = ([f"{spelled[bos]}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"]
        return " ".join(parts + ([f"{spelled[eos]}:{type_id}"] if add_eos else []))

    specials = ([(spelled[bos], bos)] if add_bos else []) + ([(spelled[eos], eos)] if add_eos else [])
    return processors.TemplateProcessing(single=around("A", 0),
                                         pair=f"{around('A', 0)} {around('B', 1)}",
                                         special_tokens=list(dict(specials).items()))


def tokenizer_from_gguf_fields(meta: Mapping[str, Any], source: str = "gguf") -> Tokenizer:
    """A Tokenizer from GGUF ``tokenizer.ggml.*`` metadata values (already decoded).

    meta: field name -> python value (str / list / int / bool), e.g. from
    ``models.gguf_metadata.read_gguf_metadata``; source names the file in errors.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(
            f"{source}: no tokenizer metadata (field 'tokenizer.ggml.model' is missing); "
            "pass tokenizer=False to load the weights alone")
    if kind not in _BUILDERS:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', "
            "byte-level BPE, and 'llama', SentencePiece BPE); pass tokenizer=False to load "
            "the weights alone")
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{source}: metadata field 'tokenizer.ggml.tokens' is missing")
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or []
    if types and len(types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries but "
                              f"tokenizer.ggml.tokens has {len(tokens)}")
    if kind == "llama":
        _special_id(meta, "unknown_token_id", len(tokens), source)
    tok, spelled = _BUILDERS[kind](meta, source, tokens, types)
    post = _post_processor(meta, spelled, kind, source)
    if post is not None:
        tok.post_processor = post
    return tok


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the GGUF file at ``path`` (reads only its header)."""
    from models.gguf_metadata import read_gguf_metadata

    return tokenizer_from_gguf_fields(read_gguf_metadata(path), os.fspath(path))


def tokenizer_fingerprint(meta: Mapping[str, Any]) -> str:
    """sha256 (hex) of everything the tokenizer is built from: the ``tokenizer.ggml.*`` fields,
    ``general.architecture`` and this module's build version."""
    h = hashlib.sha256(f"{_CACHE_MAGIC} {_BUILD_VERSION}".encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.ggml.")
                      or k == "general.architecture"):
        value = meta[key]
        h.update(b"\x00" + key.encode() + b"\x00")
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
            h.update(f"str[{len(value)}]".encode())
            h.update("\x00".join(value).encode("utf-8", "surrogatepass"))
        elif isinstance(value, (list, tuple)):
            arr = np.asarray(value)
            h.update(f"{arr.dtype}[{len(value)}]".encode())
            h.update(arr.tobytes())
        else:
            h.update(f"{type(value).__name__}:{value!r}".encode())
    return h.hexdigest()


def cached_tokenizer(meta: Mapping[str, Any], source: str,
                     cache_path: str | os.PathLike) -> Tokenizer:
    """``tokenizer_from_gguf_fields(meta, source)``, kept as JSON at ``cache_path``.

    The file is ``tokenizers`` JSON (``Tokenizer.to_str()``) after one header
    line holding ``tokenizer_fingerprint(meta)``; a file that is missing,
    unreadable or made from other metadata (or by another build version) is
    rebuilt and replaced atomically. The directory is created if needed; if it
    cannot be written the tokenizer is still returned (built, not cached).
    """
    path = os.fspath(cache_path)
    key = tokenizer_fingerprint(meta)
    header = f"{_CACHE_MAGIC} {key}\n"
    try:
        with open(path, encoding="utf-8") as f:
            if f.readline() == header:
                return Tokenizer.from_str(f.read())
    except Exception:  # a missing, partial or foreign file (from_str raises Exception): rebuild
        pass
    tok = tokenizer_from_gguf_fields(meta, source)
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(header)
                f.write(tok.to_str())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
    return tok

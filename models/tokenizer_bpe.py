"""Byte-level BPE from GGUF metadata (``tokenizer.ggml.model == "gpt2"``: SmolLM, LLaMA-3, GPT-2).

    pre-tokenizer  chosen from ``tokenizer.ggml.pre`` (see ``_pre_tokenizer``)
    model          BPE(vocab, merges), the merges as the file stores them
    decoder        ByteLevel
    special tokens CONTROL tokens (type 3) spelled in the byte alphabet added as special,
                   USER_DEFINED (4) as plain added tokens

The BOS/EOS post-processor is added by ``models.tokenizer``.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from models.errors import CheckpointError

__all__ = ["byte_level_bpe", "byte_alphabet"]

CONTROL, USER_DEFINED = 3, 4

# LLaMA-3's split pattern (tiktoken cl100k style).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2 byte-level.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        _byte_level()])
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"),
                                        _byte_level(use_regex=False)])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return _byte_level()
    raise CheckpointError(
        f"tokenizer.ggml.pre={pre!r}: unknown pre-tokenizer; supported: smollm, llama-bpe, "
        "llama3, gpt2, default")


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _spell(token: str, alphabet: set[str], table: Mapping[int, str]) -> str:
    """A token as the byte-level model sees it (already spelled tokens are kept)."""
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def byte_level_bpe(meta: Mapping[str, Any], source: str, tokens: Sequence[str],
                   types: Sequence[int]) -> tuple[Tokenizer, list[str]]:
    """(Tokenizer without post-processor, the tokens as spelled in its vocabulary)."""
    merges: Sequence[str] = meta.get("tokenizer.ggml.merges") or []
    if not merges:
        raise CheckpointError(f"{source}: metadata field 'tokenizer.ggml.merges' is missing")
    table = byte_alphabet()
    alphabet = set(table.values())
    spelled = [_spell(t, alphabet, table) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not a pair")
        pairs.append((parts[0], parts[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    special = [AddedToken(spelled[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == CONTROL and set(tokens[i]) <= alphabet]
    added = [AddedToken(spelled[i], special=False, normalized=False)
             for i, ty in enumerate(types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if added:
        tok.add_tokens(added)
    return tok, spelled

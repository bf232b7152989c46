"""Building a ``tokenizers.Tokenizer`` from the vocabulary stored in GGUF metadata.

GGUF files carry no tokenizer.json; they store ``tokenizer.ggml.*`` fields
(model kind, pre-tokenizer name, tokens, merges, token types, special ids).
For byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM,
LLaMA-3, GPT-2 style) we assemble the equivalent ``tokenizers`` pipeline:

    pre-tokenizer  chosen from ``tokenizer.ggml.pre`` (see ``_PRE_TOKENIZERS``)
    model          BPE(vocab, merges) -- the ``tokenizers`` implementation
    decoder        ByteLevel
    special tokens CONTROL tokens (type 3) added as special, USER_DEFINED (4) as added
    post-processor prepends BOS when ``tokenizer.ggml.add_bos_token`` is true

SentencePiece vocabularies (``"llama"``: LLaMA-1/2) are not supported yet.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from models.errors import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4

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
def _byte_alphabet() -> dict[int, str]:
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


def tokenizer_from_gguf_fields(meta: Mapping[str, Any], source: str = "gguf") -> Tokenizer:
    """A Tokenizer from GGUF ``tokenizer.ggml.*`` metadata values (already decoded).

    meta: field name -> python value (str / list / int / bool).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(
            f"{source}: no tokenizer metadata (field 'tokenizer.ggml.model' is missing); "
            "pass tokenizer=False to load the weights alone")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, "
            "'gpt2', is); pass tokenizer=False to load the weights alone")
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: Sequence[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens:
        raise CheckpointError(f"{source}: metadata field 'tokenizer.ggml.tokens' is missing")
    if not merges:
        raise CheckpointError(f"{source}: metadata field 'tokenizer.ggml.merges' is missing")
    table = _byte_alphabet()
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

    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(spelled[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == _CONTROL and set(tokens[i]) <= alphabet]
    added = [AddedToken(spelled[i], special=False, normalized=False)
             for i, ty in enumerate(types) if ty == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if added:
        tok.add_tokens(added)

    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_tok = spelled[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B",
            special_tokens=[(bos_tok, int(bos))])
    return tok

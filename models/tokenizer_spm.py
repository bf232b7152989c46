"""SentencePiece BPE from GGUF metadata (``tokenizer.ggml.model == "llama"``: LLaMA-1/2, Gemma).

GGUF stores the pieces, their scores and token types but (usually) no merges.
The ``tokenizers`` pipeline built here is the one HF transformers builds from
the same file (so the ids are HF's):

    merges         the file's, else rebuilt from the vocabulary (models/spm_merges.py),
                   ranked by score -- or, for Gemma, by position (Gemma's scores do
                   not follow its merge order, its token order does)
    model          BPE(byte_fallback=True, fuse_unk=True): a character outside the
                   vocabulary becomes its UTF-8 bytes as ``<0xNN>`` tokens (``<unk>`` if
                   those are missing; HF leaves LLaMA files without an unknown token)
    Gemma          normalizer " " -> "▁" and no prefix space (Gemma 3's file says
                   tokenizer.ggml.add_space_prefix = false); tokens made only of
                   spaces, stored as real spaces, are spelled with "▁" so text finds them
    LLaMA          Metaspace pre-tokenizer: " " -> "▁" and, unless the file sets
                   tokenizer.ggml.add_space_prefix = false, one "▁" before the text
    decoder        "▁" -> " ", byte-fallback tokens -> bytes, fused (and the prefix
                   space stripped when one was added)
    special tokens CONTROL (type 3) and UNKNOWN (2, ``<unk>``) added as special,
                   USER_DEFINED (4) as plain added tokens (matched whole in the raw
                   text), all unnormalized

The BOS/EOS post-processor is added by ``models.tokenizer``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from models.errors import CheckpointError
from models.spm_merges import rebuild_merges

__all__ = ["sentencepiece_bpe", "GEMMA_ARCHITECTURES"]

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPACE = "\u2581"  # "▁", SentencePiece's visible space
# architectures whose SentencePiece files follow Gemma's conventions (as in HF transformers)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _merges(meta: Mapping[str, Any], source: str, spelled: Sequence[str], gemma: bool
            ) -> list[tuple[str, str]]:
    """The file's merges, or the ones its vocabulary implies."""
    stored = meta.get("tokenizer.ggml.merges")
    if stored:
        pairs = []
        for i, m in enumerate(stored):
            parts = m.split(" ")
            if len(parts) != 2:
                raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not a pair")
            pairs.append((parts[0], parts[1]))
        return pairs
    if gemma:
        return rebuild_merges(spelled, -np.arange(len(spelled), dtype=np.float64))
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise CheckpointError(f"{source}: metadata field 'tokenizer.ggml.scores' is missing "
                              "(a SentencePiece vocabulary without merges needs it)")
    scores = np.asarray(scores, np.float64)
    if np.isnan(scores).any():
        i = int(np.flatnonzero(np.isnan(scores))[0])
        raise CheckpointError(f"{source}: tokenizer.ggml.scores[{i}] is NaN")
    return rebuild_merges(spelled, scores)


def _unk_token(meta: Mapping[str, Any], spelled: Sequence[str], vocab: Mapping[str, int]
               ) -> str | None:
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is not None:
        return spelled[int(unk)]
    return "<unk>" if "<unk>" in vocab else None


def sentencepiece_bpe(meta: Mapping[str, Any], source: str, tokens: Sequence[str],
                      types: Sequence[int]) -> tuple[Tokenizer, list[str]]:
    """(Tokenizer without post-processor, the tokens as spelled in its vocabulary).

    tokens / types: ``tokenizer.ggml.tokens`` / ``token_type`` (types may be empty),
    already checked by the caller to have the same length.
    """
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries but "
                              f"tokenizer.ggml.tokens has {len(tokens)}")
    gemma = meta.get("general.architecture") in GEMMA_ARCHITECTURES
    if gemma:  # "   " is stored with real spaces but looked up (after normalization) as "▁▁▁"
        spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    else:
        spelled = list(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    model = models.BPE(vocab=vocab, merges=_merges(meta, source, spelled, gemma),
                       unk_token=_unk_token(meta, spelled, vocab), fuse_unk=True,
                       byte_fallback=True)
    tok = Tokenizer(model)
    steps: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)

    control = [t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # a user-defined token is added only under a spelling the vocabulary has (Gemma's
    # space runs are not: "▁▁" reaches them through the normalizer and the merges)
    known = vocab.keys() | set(control)
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in known]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok, spelled

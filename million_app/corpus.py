"""Built-in text: Python's own reference docs (``pydoc_data.topics``), present in every install."""
from __future__ import annotations

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


def read_text(spec: str) -> str:
    """A text file's contents, or ``builtin:calib`` / ``builtin:eval`` / ``builtin``."""
    if spec == "builtin":
        return builtin_text()
    if spec.startswith("builtin:"):
        return builtin_split(spec.split(":", 1)[1])
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"text file not found: {spec}")
    with open(spec, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"text file is empty: {spec}")
    return text


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

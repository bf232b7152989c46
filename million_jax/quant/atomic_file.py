"""Atomic file writes: a result appears whole at its path or not at all.

    with atomic_file("books.safetensors") as tmp:
        write(tmp)            # replaces the path on success; removed on any failure

The temporary file sits next to the target (same file system, so the final ``os.replace`` is
atomic). A replaced file keeps its permission bits; a new one gets the umask's default
(``0o666 & ~umask``), not the 0600 of a raw temporary file.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

__all__ = ["atomic_file", "replacement_mode"]


def replacement_mode(path: str) -> int:
    """The permission bits a file written at ``path`` should get (module docstring)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on a normal exit it replaces ``path`` (with
    :func:`replacement_mode`), on any exception it is removed and ``path`` is left as it was.
    OSErrors (no directory, no permission) propagate."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, replacement_mode(path))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

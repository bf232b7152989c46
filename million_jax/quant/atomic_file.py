"""Atomic file writes: a result appears whole at its path or not at all.

    with atomic_file("books.safetensors") as tmp:
        write(tmp)            # replaces the path on success; removed on any failure

The temporary file sits next to the target (same file system, so the final ``os.replace`` is
atomic). A replaced file keeps its permission bits; a new one gets the umask's default
(``0o666 & ~umask``), not the 0600 of a raw temporary file.

``atomic_file(path, replace=False)`` never replaces a file: the finished temporary file is
hard-linked to ``path``, which fails with FileExistsError if ``path`` appeared meanwhile (two
writers racing for one name: the later one fails instead of silently replacing the earlier).
On a file system without hard links it falls back to an existence check and a rename.
"""
from __future__ import annotations

import errno
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
def atomic_file(path: str | os.PathLike, replace: bool = True) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on a normal exit it replaces ``path`` (with
    :func:`replacement_mode`), on any exception it is removed and ``path`` is left as it was.
    With ``replace=False`` an existing ``path`` is kept and FileExistsError raised instead
    (module docstring). OSErrors (no directory, no permission) propagate."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, replacement_mode(path))
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _link_new(tmp: str, path: str) -> None:
    """Give ``tmp``'s content the name ``path`` only if ``path`` does not exist (atomically where
    the file system has hard links); FileExistsError otherwise."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network / FAT file systems): check, then rename
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "file exists", path) from None
        os.replace(tmp, path)

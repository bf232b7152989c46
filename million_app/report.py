"""Formatting helpers shared by the commands: sizes, JSON files, environment facts."""
from __future__ import annotations

import json
import os
import platform
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

import jax

from million_app.errors import UsageError
from million_app.progress import check_cancelled
from million_jax.quant.atomic_file import atomic_file


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_out_dir(path: str, flag: str) -> None:
    """UsageError unless the directory that will hold ``path`` exists."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}: directory {parent} does not exist")


def check_writable(path: str, flag: str, *, force: bool = False, force_flag: str = "--force") -> None:
    """UsageError (one line) unless ``path`` can be written; checked before any work starts.

    ``path`` must not be a directory, its directory must exist and accept a new file (tried
    for real: a probe file is created and removed), and an existing file must be writable.
    The overwrite rule of every command: an existing file is refused unless ``force`` (the
    user gave ``force_flag``); the final write re-checks (:func:`atomic_path`).
    """
    if os.path.isdir(path):
        raise UsageError(f"{flag}: {path} is a directory; give a file name")
    check_out_dir(path, flag)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):
        if not force:
            raise UsageError(already_exists(path, flag, force_flag))
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag}: {path} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".million-jax-probe-", dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {parent} ({e.strerror or e})") from None


def already_exists(path: str, flag: str, force_flag: str = "--force") -> str:
    """The one refusal line of the overwrite rule."""
    return f"{flag}: {path} already exists; pass {force_flag} to replace it or choose another name"


_PARTIAL: set[str] = set()


def remove_partial_files() -> None:
    """Delete temporary files of writes still in progress (called on Ctrl-C)."""
    for p in list(_PARTIAL):
        try:
            os.remove(p)
        except OSError:
            pass
        _PARTIAL.discard(p)


@contextmanager
def atomic_path(path: str, flag: str, *, force: bool = False, doing: str = "running",
                force_flag: str = "--force") -> Iterator[str]:
    """``with atomic_path(out, "--out") as tmp:`` write ``tmp``; it becomes ``out`` at the end.

    :func:`million_jax.quant.atomic_file.atomic_file` (mode kept or umask default), plus: a Ctrl-C before
    the final rename removes the temporary file and leaves ``out`` as it was, and an OSError
    becomes one UsageError line naming ``flag``. Without ``force`` an existing ``out`` is never
    replaced, re-checked at the final rename (an exclusive link): a file that appeared there
    while the command was ``doing`` its work (another run writing the same name) is kept and
    this write fails with one UsageError line.
    """
    parent = os.path.dirname(os.path.abspath(path))
    created = written = False
    try:
        with atomic_file(path, replace=force) as tmp:
            created = True
            _PARTIAL.add(tmp)
            try:
                yield tmp
                check_cancelled()
                written = True
            finally:
                _PARTIAL.discard(tmp)
    except FileExistsError:
        if not written:
            raise
        raise UsageError(f"{flag}: {path} appeared while {doing}; not replaced "
                         f"(pass {force_flag} to replace it)") from None
    except OSError as e:
        where = f"write {path}" if created else f"write in {parent}"
        raise UsageError(f"{flag}: cannot {where} ({e.strerror or e})") from None


def write_json(path: str, obj: Any, flag: str = "--json", *, force: bool = False) -> None:
    """Write ``obj`` as indented JSON, atomically (see :func:`atomic_path`; ``force``: replace
    an existing file)."""
    check_out_dir(path, flag)
    text = json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n"
    write_text(path, text, flag, force=force)


def write_text(path: str, text: str, flag: str, *, force: bool = False) -> None:
    """Write ``text`` (UTF-8) atomically (see :func:`atomic_path`)."""
    with atomic_path(path, flag, force=force) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded next to every result."""
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "machine": platform.machine()}


def memory_line(r: dict) -> str:
    """'4.00 bits/elem; cache 1.5 MiB vs dense bfloat16 6.0 MiB (4.00x smaller)' from an eval dict."""
    if r.get("cache") == "dense":
        line = f"{r['bits_per_element']:.0f} bits/elem; cache {human_bytes(r['cache_bytes'])}"
        return line + (f" ({r['note']})" if r.get("note") else "")
    ratio = r["dense_cache_bytes"] / max(r["cache_bytes"], 1)
    line = (f"{r['bits_per_element']:.2f} bits/elem; cache {human_bytes(r['cache_bytes'])} vs "
            f"dense {r['dense_cache_dtype']} {human_bytes(r['dense_cache_bytes'])} "
            f"({ratio:.2f}x smaller)")
    if r.get("sink_bytes"):
        line += f", of which {human_bytes(r['sink_bytes'])} exact first tokens (fixed per sequence)"
    if r.get("codebook_bytes"):
        line += f"; codebooks {human_bytes(r['codebook_bytes'])} (once per model)"
    return line

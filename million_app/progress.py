"""Progress reporting for long work: tqdm bars and status lines on stderr.

Bars are drawn only on a terminal (``disable=None``), so logs and tests stay clean;
``set_quiet(True)`` (the ``--quiet`` flag) silences status lines as well.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from tqdm.auto import tqdm

_QUIET = False


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) status lines and progress bars."""
    global _QUIET
    _QUIET = bool(quiet)


def status(msg: str) -> None:
    """One line of progress information on stderr."""
    if not _QUIET:
        print(msg, file=sys.stderr, flush=True)


def bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr (hidden when not a terminal or when quiet)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=True if _QUIET else None, dynamic_ncols=True)


@contextmanager
def timed(msg: str) -> Iterator[dict]:
    """``with timed("fitting codebooks"):`` prints the message, then its duration."""
    status(f"{msg} ...")
    info: dict = {}
    t0 = time.perf_counter()
    yield info
    info["seconds"] = time.perf_counter() - t0
    status(f"{msg}: done in {info['seconds']:.1f} s")

"""Progress reporting for long work, and the cancel flag an interrupt sets.

On a terminal, bars are tqdm bars on stderr. Elsewhere (CI logs, notebooks, pipes) a bar
prints one status line at most every ``interval()`` seconds (``MILLION_JAX_STATUS_EVERY``,
default 30) with its count, elapsed time and ETA, and :func:`heartbeat` (called by the CLI
while a command runs) prints a "still working" line when nothing was printed for that long,
so no phase is silent. ``set_quiet(True)`` (the ``--quiet`` flag) silences all of it.

``cancel()`` (the CLI calls it on Ctrl-C) makes the next status line, bar update or
:func:`check_cancelled` raise KeyboardInterrupt in the thread doing the work, so it stops
between steps instead of running to the end.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tqdm.auto import tqdm

_QUIET = False
_CANCEL = threading.Event()
_STATE: dict[str, Any] = {"last": time.monotonic(), "phase": "starting", "since": time.monotonic()}
_INTERVAL: float | None = None  # None: read MILLION_JAX_STATUS_EVERY (default 30 s)


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) status lines and progress bars."""
    global _QUIET
    _QUIET = bool(quiet)


def set_interval(seconds: float | None) -> None:
    """Seconds between status lines when stderr is not a terminal (None: the default)."""
    global _INTERVAL
    _INTERVAL = seconds


def interval() -> float:
    """Seconds between periodic status lines when stderr is not a terminal."""
    if _INTERVAL is not None:
        return _INTERVAL
    try:
        return float(os.environ.get("MILLION_JAX_STATUS_EVERY", "30"))
    except ValueError:
        return 30.0


def is_terminal() -> bool:
    """Whether stderr is an interactive terminal (bars are drawn only there)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


# ---------------------------------------------------------------------------- cancel
def cancel() -> None:
    """Ask the running work to stop at its next step."""
    _CANCEL.set()


def reset() -> None:
    """Clear the cancel flag and the phase (start of a command)."""
    _CANCEL.clear()
    now = time.monotonic()
    _STATE.update(last=now, phase="starting", since=now)


def check_cancelled() -> None:
    """Raise KeyboardInterrupt if :func:`cancel` was called."""
    if _CANCEL.is_set():
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------- output
def _emit(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    _STATE["last"] = time.monotonic()


def _set_phase(phase: str) -> None:
    _STATE.update(phase=phase, since=time.monotonic())


def warn(msg: str) -> None:
    """A warning line on stderr, shown even with --quiet."""
    _emit(f"warning: {msg}")


def status(msg: str) -> None:
    """One line of progress information on stderr (it also names the current phase)."""
    check_cancelled()
    _set_phase(msg.rstrip(". "))
    if not _QUIET:
        _emit(msg)


def heartbeat() -> None:
    """Off a terminal: a 'still working' line if nothing was printed for ``interval()`` s."""
    if _QUIET or is_terminal():
        return
    now = time.monotonic()
    if now - _STATE["last"] >= max(interval(), 1.0):
        _emit(f"  ... still working: {_STATE['phase']} ({now - _STATE['since']:.0f} s so far)")


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Bar:
    """A progress bar: tqdm on a terminal, periodic status lines elsewhere.

    ``update(n)`` advances it (and raises KeyboardInterrupt once cancelled); ``close()``
    ends it (a final line off a terminal).
    """

    def __init__(self, total: int, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.unit, self.n = int(total), desc, unit, 0
        self.t0 = time.monotonic()
        self._last_line = self.t0
        self._tqdm = None
        self._printed = False
        _set_phase(desc)
        if not _QUIET and is_terminal():
            self._tqdm = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                              dynamic_ncols=True)

    def line(self) -> str:
        """'desc: 3/8 windows, 12 s, ETA 20 s'."""
        el = time.monotonic() - self.t0
        eta = f", ETA {_duration(el / self.n * (self.total - self.n))}" if 0 < self.n < self.total else ""
        return f"  {self.desc}: {self.n}/{self.total} {self.unit}s, {_duration(el)}{eta}"

    def update(self, n: int = 1) -> None:
        check_cancelled()
        self.n += n
        if self._tqdm is not None:
            self._tqdm.update(n)
        elif not _QUIET:
            now = time.monotonic()
            if now - self._last_line >= interval() and self.n < self.total:
                self._last_line, self._printed = now, True
                _emit(self.line())

    def set(self, n: int, total: int | None = None) -> None:
        """Set the count to ``n`` (and the total), for callbacks that report done/total."""
        if total is not None and total != self.total:
            self.total = int(total)
            if self._tqdm is not None:
                self._tqdm.total = self.total
        self.update(n - self.n)

    def close(self) -> None:
        _set_phase(f"after {self.desc}")
        if self._tqdm is not None:
            self._tqdm.close()
        elif not _QUIET and (self._printed or time.monotonic() - self.t0 >= interval()):
            _emit(self.line() + " (done)")


def bar(total: int, desc: str, unit: str = "it") -> Bar:
    """A :class:`Bar` on stderr (tqdm on a terminal, status lines elsewhere, none when quiet)."""
    return Bar(total, desc, unit)


@contextmanager
def counting(desc: str, unit: str = "it") -> Iterator[Callable[[int, int], None]]:
    """``with counting("k-means", "fit") as report:`` gives a ``report(done, total)`` callback
    (the form the library's ``progress=`` arguments take) drawing a :class:`Bar`; closed at the end."""
    pbar = bar(1, desc, unit)
    try:
        yield pbar.set
    finally:
        pbar.close()


@contextmanager
def timed(msg: str) -> Iterator[dict]:
    """``with timed("fitting codebooks"):`` prints the message, then its duration."""
    status(f"{msg} ...")
    info: dict = {}
    t0 = time.perf_counter()
    yield info
    info["seconds"] = time.perf_counter() - t0
    status(f"{msg}: done in {info['seconds']:.1f} s")

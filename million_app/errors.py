"""The one exception type the command line turns into an ``error: ...`` line (exit status 2)."""
from __future__ import annotations


class UsageError(Exception):
    """A user mistake (bad flag, missing file, mismatched codebooks, model not installed).

    The message is one line, meant to be printed as ``error: <message>``.
    """

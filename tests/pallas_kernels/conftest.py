"""Shared helpers for the Pallas kernel tests (random PQ caches, a NumPy oracle)."""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run from any cwd / any venv without an editable install
    sys.path.insert(0, _ROOT)

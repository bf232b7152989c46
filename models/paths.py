"""Where million-jax keeps files it makes once: assembled model files, built tokenizers."""
from __future__ import annotations

import os

__all__ = ["model_cache_dir"]


def model_cache_dir() -> str:
    """``$MILLION_JAX_CACHE``, else ``$XDG_CACHE_HOME/million-jax`` (default ``~/.cache/million-jax``)."""
    base = os.environ.get("MILLION_JAX_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "million-jax")
    return base

"""Exceptions raised by the model package."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (HF directory, safetensors shard or GGUF file) cannot be used.

    The message always names the offending file and the tensor or metadata
    field (e.g. ``model.layers.3.self_attn.k_proj.weight``), so a user can tell
    a truncated download from an unsupported architecture.
    """


class ConfigError(ValueError):
    """A model configuration is inconsistent or uses an unsupported feature."""


class ModelNotInstalledError(FileNotFoundError):
    """A named model (e.g. ``"smollm2"``) whose files come from a pip package not installed."""

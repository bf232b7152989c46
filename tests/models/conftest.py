"""Fixtures for the model tests (helpers live in hf_helpers.py, a uniquely named module)."""
from __future__ import annotations

import pytest
from hf_helpers import HF_CONFIGS, make_hf_model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: (config, hf_model, path) with the model saved by save_pretrained (safetensors)."""

    def make(name: str, **save_kwargs):
        config = HF_CONFIGS[name]
        model = make_hf_model(config)
        path = tmp_path / name
        model.save_pretrained(path, safe_serialization=True, **save_kwargs)
        return config, model, path

    return make

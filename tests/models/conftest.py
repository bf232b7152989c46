"""Fixtures for the model tests (helpers live in hf_helpers.py, a uniquely named module)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import HF_CONFIGS, make_hf_model

from million_jax.calibration.fit import fit_kv_codebooks
from models import init_params, preset


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


@pytest.fixture(scope="session")
def tiny():
    """(config, params, codebooks): the ``tiny`` preset with 4 layers, random weights, and
    layer_head K/V codebooks (M = head_dim / 2, nbits 6) fitted on random [L, Hkv, 512, d] data."""
    cfg = preset("tiny").replace(n_layers=4)
    params = init_params(cfg, jax.random.PRNGKey(0))
    cal = np.random.default_rng(0).standard_normal(
        (cfg.n_layers, cfg.n_kv_heads, 512, cfg.head_dim)).astype(np.float32)
    books = fit_kv_codebooks(cal, cal, M=cfg.head_dim // 2, nbits=6, key=jax.random.PRNGKey(0), iters=2)
    return cfg, params, books


@pytest.fixture(scope="module")
def params(request):
    """float32 params of the test module's ``CONFIG``, std 0.2 (not HF's 0.02) so attention is
    peaked and position mistakes show."""
    config = getattr(request.module, "CONFIG", None)
    if config is None:
        pytest.fail(f"the params fixture needs a module-level CONFIG in {request.module.__name__}")
    return init_params(config, jax.random.key(0), jnp.float32, stddev=0.2)

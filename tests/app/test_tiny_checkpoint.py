"""million_app.tiny writes HF checkpoints that load back to the very params it drew (both families)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from million_app.tiny import write_tiny_checkpoint
from models import init_params, load_model, preset


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
def test_tiny_checkpoint_round_trip(tmp_path, name):
    config = preset(name)
    loaded = load_model(write_tiny_checkpoint(str(tmp_path / name), config=config, seed=3))
    assert loaded.config.family == config.family
    drawn = init_params(config, jax.random.PRNGKey(3), stddev=0.1)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(drawn)
    for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(drawn)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

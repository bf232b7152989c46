"""bf16 weights and a bf16 dense cache run at batch > 1 (XLA CPU lacks some bf16->f32 dots)."""
import jax
import jax.numpy as jnp
import numpy as np

from models import generate, init_cache, init_params, preset


def test_bf16_generate_batch2_matches_batch1():
    cfg = preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    toks = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab, (2, 8)), jnp.int32)
    both = generate(cfg, params, init_cache(cfg, 2, 32, jnp.bfloat16), toks, jnp.full((2,), 8),
                    max_new_tokens=4, eos_id=())
    for b in range(2):
        one = generate(cfg, params, init_cache(cfg, 1, 32, jnp.bfloat16), toks[b:b + 1], jnp.full((1,), 8),
                       max_new_tokens=4, eos_id=())
        np.testing.assert_array_equal(np.asarray(both.tokens[b]), np.asarray(one.tokens[0]))

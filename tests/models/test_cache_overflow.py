"""Cache overflow is never silent: host-side errors with concrete lengths, a flag under jit."""
import jax
import jax.numpy as jnp
import pytest

from million_jax import CacheOverflowError, CacheSpec, make_cache
from models import decode_step, prefill


@pytest.mark.parametrize("kind", ["pq", "dense", "uniform"])
def test_prefill_and_decode_past_max_len_raise(tiny, kind):
    cfg, params, books = tiny
    spec = {"pq": CacheSpec("pq", codebooks=books, dtype=jnp.float32),
            "dense": CacheSpec("dense", dtype=jnp.float32),
            "uniform": CacheSpec("uniform", bits=4, group_size=8, dtype=jnp.float32)}[kind]
    cache, consts = make_cache(spec, cfg, 1, 8)
    tokens = jnp.arange(12, dtype=jnp.int32)[None]
    with pytest.raises(CacheOverflowError, match="holds 0 of the cache's 8 positions.*12 more"):
        prefill(cfg, params, cache, tokens, jnp.array([12]), consts)
    _, cache = prefill(cfg, params, cache, tokens, jnp.array([6]), consts)   # ragged: 6 real
    for t in range(2):
        _, cache = decode_step(cfg, params, cache, jnp.array([t]), consts)
    assert cache.lengths.tolist() == [8]
    with pytest.raises(CacheOverflowError, match="holds 8 of"):
        decode_step(cfg, params, cache, jnp.array([3]), consts)
    # a frozen row writes nothing, so it may sit in a full cache
    decode_step(cfg, params, cache, jnp.array([3]), consts, active=jnp.array([False]))
    # under jit nothing is known on the host: the cache says it with a flag
    flag = jax.jit(lambda c: c.overflow(jnp.ones((1,), jnp.int32)))(cache)
    assert flag.tolist() == [True] and cache.overflow(jnp.zeros((1,), jnp.int32)).tolist() == [False]

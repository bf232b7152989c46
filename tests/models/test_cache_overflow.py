"""Cache overflow is never silent: ``check_room`` raises on the host, a flag under jit; the
jitted entry points donate the cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax import CacheOverflowError, CacheSpec, make_cache
from models import check_room, decode_step, forward, prefill


def _spec(kind, books):
    return {"pq": CacheSpec("pq", codebooks=books, dtype=jnp.float32),
            "dense": CacheSpec("dense", dtype=jnp.float32),
            "uniform": CacheSpec("uniform", bits=4, group_size=8, dtype=jnp.float32)}[kind]


@pytest.mark.parametrize("kind", ["pq", "dense", "uniform"])
def test_check_room_raises_on_the_host_past_max_len(tiny, kind):
    cfg, params, books = tiny
    cache, consts = make_cache(_spec(kind, books), cfg, 1, 8)
    tokens = jnp.arange(12, dtype=jnp.int32)[None]
    with pytest.raises(CacheOverflowError, match="holds 0 of the cache's 8 positions.*12 more"):
        check_room(cache, jnp.array([12]))
    check_room(cache, 6 + 2)                     # the whole run at once: prompt 6 + 2 steps fit
    _, cache = prefill(cfg, params, cache, tokens, jnp.array([6]), consts)   # ragged: 6 real
    for t in range(2):
        check_room(cache, 1)
        _, cache = decode_step(cfg, params, cache, jnp.array([t]), consts)
    assert cache.lengths.tolist() == [8]
    with pytest.raises(CacheOverflowError, match="holds 8 of"):
        check_room(cache, 1)
    # a frozen row writes nothing, so it may sit in a full cache
    active = jnp.array([False])
    check_room(cache, active)
    _, cache = decode_step(cfg, params, cache, jnp.array([3]), consts, active=active)
    assert cache.lengths.tolist() == [8]
    # under jit nothing is known on the host: the cache says it with a flag, check_room refuses
    flag = jax.jit(lambda c: c.overflow(jnp.ones((1,), jnp.int32)))(cache)
    assert flag.tolist() == [True] and cache.overflow(jnp.zeros((1,), jnp.int32)).tolist() == [False]
    with pytest.raises(TypeError, match="cache.overflow"):
        jax.jit(lambda c: check_room(c, 1))(cache)


def test_check_room_names_the_first_row_that_does_not_fit(tiny):
    cfg, params, books = tiny
    cache, _ = make_cache(_spec("dense", books), cfg, 3, 8)
    _, cache = prefill(cfg, params, cache, jnp.zeros((3, 7), jnp.int32), jnp.array([7, 2, 5]))
    check_room(cache, jnp.array([1, 6, 3]))
    with pytest.raises(CacheOverflowError, match="sequence 2 holds 5 of the cache's 8 positions and cannot take 4"):
        check_room(cache, jnp.array([1, 0, 4]))


@pytest.mark.parametrize("kind", ["pq", "dense", "uniform"])
def test_prefill_and_decode_step_donate_the_cache(tiny, kind):
    """The input cache's buffers are deleted after each call (donated to the output), the
    constants never are, and the returned cache gives the cache-free forward's logits."""
    cfg, params, books = tiny
    cache, consts = make_cache(_spec(kind, books), cfg, 2, 8)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab, (2, 5)), jnp.int32)
    _, filled = prefill(cfg, params, cache, tokens[:, :4], jnp.array([4, 4]), consts)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))
    logits, after = decode_step(cfg, params, filled, tokens[:, 4], consts)
    assert all(x.is_deleted() for x in jax.tree.leaves(filled))
    assert not any(x.is_deleted() for x in jax.tree.leaves(after) + jax.tree.leaves(consts) + jax.tree.leaves(params))
    assert after.lengths.tolist() == [5, 5]
    if kind == "dense":  # exact cache: the step equals the cache-free forward
        np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(cfg, params, tokens)[:, -1]),
                                   rtol=1e-4, atol=1e-4)

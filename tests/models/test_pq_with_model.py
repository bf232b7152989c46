"""The PQ cache inside the real model: fidelity on SmolLM2, jit hygiene on a tiny config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_app.calibrate import collect_model_kv, fit_kv_codebooks
from million_app.corpus import builtin_split
from million_jax.cache import DenseCache, PQCache, UniformCache
from models import decode_step, generate, init_cache, load_model, prefill


# ---------------------------------------------------------------- jit hygiene (tiny model)
def _caches(cfg, books, t_max):
    L, hkv, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    return {
        "pq": (PQCache.for_codebooks(books, 2, hkv, t_max, window=16, dtype=jnp.float32, impl="xla"), books),
        "dense": (DenseCache.create(L, 2, hkv, t_max, d, jnp.float32), None),
        "uniform": (UniformCache.create(L, 2, hkv, t_max, d, bits=4, group_size=d, window=16, dtype=jnp.float32),
                    None),
    }


@pytest.mark.parametrize("kind", ["pq", "dense"])
def test_decode_step_compiles_once(tiny, kind):
    cfg, params, books = tiny
    cache, consts = _caches(cfg, books, 64)[kind]
    before = decode_step._cache_size()
    for i in range(4):
        _, cache = decode_step(cfg, params, cache, jnp.full((2,), i, jnp.int32), consts)
    assert decode_step._cache_size() - before == 1
    assert cache.lengths.tolist() == [4, 4]


@pytest.mark.parametrize("kind", ["pq", "dense", "uniform"])
def test_donated_decode_step_scratch_does_not_grow_with_t_max(tiny, kind):
    """Every cache buffer aliases an output, and the step's scratch memory is the same for a
    cache 4x larger: no layer is sliced out or copied (the cache is read in place and written
    once after the layer loop; million_jax/cache/base.py)."""
    cfg, params, books = tiny
    temps = []
    for t_max in (2048, 8192):
        cache, consts = _caches(cfg, books, t_max)[kind]
        # decode_step itself is jitted with the cache donated: no wrapper needed
        ma = decode_step.lower(cfg, params, cache, jnp.zeros((2,), jnp.int32), consts).compile().memory_analysis()
        assert ma.alias_size_in_bytes >= cache.nbytes()
        temps.append(ma.temp_size_in_bytes)
    grown = _caches(cfg, books, 8192)[kind][0].nbytes() - _caches(cfg, books, 2048)[kind][0].nbytes()
    assert temps[1] - temps[0] < 0.02 * grown, (temps, grown)


def test_pq_cache_is_about_a_quarter_of_dense_at_4_bits(tiny):
    cfg, _, _ = tiny
    L, hkv, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    dense = DenseCache.create(L, 1, hkv, 4096, d, jnp.bfloat16)
    pq = PQCache.create(L, 1, hkv, 4096, d, M=d // 2, nbits=8, dtype=jnp.bfloat16)  # 4 bits/elem
    assert abs(pq.nbytes() / dense.nbytes() - 0.25) < 0.01


# ---------------------------------------------------------------- SmolLM2 fidelity
@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    """(model, calibration K/V): one forward over 4096 tokens of builtin:calib in 256-token
    windows, shared by the fits below."""
    m = load_model("smollm2")
    calib_ids = m.encode(builtin_split("calib")[:20000])
    return m, collect_model_kv(m, calib_ids, window=256, max_tokens=4096)


def _greedy(m, cache, consts, prompt, n):
    res = generate(m.config, m.params, cache, jnp.asarray([prompt]), jnp.asarray([len(prompt)]),
                   max_new_tokens=n, eos_id=(), cache_consts=consts)
    return [int(t) for t in np.asarray(res.tokens[0])]


@pytest.mark.slow
def test_smollm2_greedy_pq_12bit_follows_dense(smol):
    """nbits 12, M = d/2, every token read from codes. Along dense's greedy continuation
    (64 tokens), PQ picks the same next token at every step, except at near-ties of the
    dense logits (each flip's dense margin is printed and must be small)."""
    m, (k, v) = smol
    cfg = m.config
    books = fit_kv_codebooks(k, v, M=cfg.head_dim // 2, nbits=12, granularity="shared",
                             key=jax.random.PRNGKey(0), max_vectors=12288, iters=3)
    prompt = m.encode("The import statement combines two operations; it searches for the named module,")
    n = 64
    t_max = len(prompt) + n
    dense = _greedy(m, init_cache(cfg, 1, t_max, jnp.float32), None, prompt, n)
    seq = jnp.asarray([prompt + dense[:-1]])
    lengths = jnp.asarray([seq.shape[1]])
    ld, _ = prefill(cfg, m.params, init_cache(cfg, 1, t_max, jnp.float32), seq, lengths)
    pq_cache = PQCache.for_codebooks(books, 1, cfg.n_kv_heads, t_max,
                                     dtype=jnp.float32, quantize_all=True, impl="xla")
    lp, _ = prefill(cfg, m.params, pq_cache, seq, lengths, books)
    steps = slice(len(prompt) - 1, len(prompt) - 1 + n)
    ld, lp = np.asarray(ld[0, steps]), np.asarray(lp[0, steps])
    assert (ld.argmax(-1) == np.asarray(dense)).all()  # teacher forcing reproduces greedy
    flips = np.nonzero(lp.argmax(-1) != ld.argmax(-1))[0]
    margins = [float(ld[i].max() - ld[i, lp[i].argmax()]) for i in flips]
    print(f"PQ 12-bit: {n - len(flips)}/{n} greedy steps agree; flips at {flips.tolist()} "
          f"with dense logit margins {[round(x, 4) for x in margins]}")
    assert len(flips) <= 3
    assert all(x < 0.25 for x in margins), margins


@pytest.mark.slow
def test_smollm2_4bit_logits_stay_close(smol):
    """4 bits/elem (M = d/2, 8-bit codes, per-layer-per-head codebooks), all tokens quantized:
    KL(dense || PQ) of the next-token distributions stays small, and falls with more bits."""
    m, (k, v) = smol
    cfg = m.config
    ev = m.encode(builtin_split("eval")[:6000])[:256]
    x = jnp.asarray([ev])
    n = jnp.asarray([len(ev)])
    ld, _ = prefill(cfg, m.params, init_cache(cfg, 1, len(ev), jnp.float32), x, n)
    kls = {}
    for nbits in (4, 8):
        books = fit_kv_codebooks(k, v, M=cfg.head_dim // 2, nbits=nbits, granularity="layer_head",
                                 key=jax.random.PRNGKey(0), max_vectors=1024, iters=6)
        c = PQCache.for_codebooks(books, 1, cfg.n_kv_heads, len(ev), dtype=jnp.float32,
                                  quantize_all=True, impl="xla")
        lp, _ = prefill(cfg, m.params, c, x, n, books)
        pd, pp = jax.nn.log_softmax(ld, -1), jax.nn.log_softmax(lp, -1)
        kls[nbits] = float(jnp.sum(jnp.exp(pd) * (pd - pp), -1).mean())
    print(f"mean KL(dense || PQ) per token: 2 b/elem {kls[4]:.4f}, 4 b/elem {kls[8]:.4f}")
    assert kls[8] < 0.1
    assert kls[8] < kls[4]


def test_pre_rope_codebooks_of_other_rope_frequencies_are_refused(tiny):
    """Pre-RoPE codebooks record the frequencies they were fitted with; a model with another
    rope_theta or rope scaling is refused by make_cache and by prefill (never rotated wrongly)."""
    from million_jax import CacheSpec, make_cache
    from million_jax.rope import RopeScaling
    from models.decoder import rope_inv_freq
    cfg, params, books = tiny
    pre = books.with_pre_rope_keys(rope_inv_freq(cfg))
    make_cache(CacheSpec("pq", codebooks=pre, dtype=jnp.float32, impl="xla"), cfg, 1, 16)  # its own model: fine
    for other in (cfg.replace(rope_theta=cfg.rope_theta * 2),
                  cfg.replace(rope_scaling=RopeScaling("linear", factor=4.0))):
        with pytest.raises(ValueError, match="other RoPE frequencies"):
            make_cache(CacheSpec("pq", codebooks=pre, dtype=jnp.float32, impl="xla"), other, 1, 16)
        cache = PQCache.for_codebooks(pre, 1, cfg.n_kv_heads, 16, dtype=jnp.float32, impl="xla")
        with pytest.raises(ValueError, match="other RoPE frequencies"):
            prefill(other, params, cache, jnp.ones((1, 4), jnp.int32), jnp.array([4]), pre)
    make_cache(CacheSpec("pq", codebooks=books, dtype=jnp.float32, impl="xla"), cfg.replace(rope_theta=7.0), 1, 16)

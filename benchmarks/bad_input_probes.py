"""Bad inputs on the newer surfaces (issue 26): each probe feeds one wrong thing and records
what came back. Writes a markdown table (probe, what was wrong, outcome).

    PYTHONPATH=. python benchmarks/bad_input_probes.py --out benchmarks/results/bad_input_probes.md

A probe passes ("clear error") when it raises a ValueError / UsageError / TypeError /
CodebookFileError / CacheOverflowError whose message matches the expected words; "NaN out"
probes pass when the bad value reaches the output as NaN. Anything else is "BAD" (a crash deep
inside JAX, a wrong exception, a finite answer). Exit status 1 if any probe is BAD.
The failing-before tests of each fix live in tests/; this script is the survey.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from safetensors import safe_open
from safetensors.numpy import save_file

from million_app.errors import UsageError
from million_app.recipes import RECIPES, fit_recipe, recipe_for_bits
from million_jax import CacheOverflowError, CacheSpec, PQCodebooks, make_cache, rope
from million_jax import sharding
from million_jax.attention.pq_dispatch import pq_code_attention
from million_jax.cache import PQCache
from million_jax.calibration.finetune import FinetuneSettings, finetune_codebooks
from million_jax.calibration.fit import fit_kv_codebooks
from million_jax.flax import PQMultiHeadAttention
from million_jax.quant.codebook_io import CodebookFileError, load_kv_codebooks, save_kv_codebooks
from models import init_params, prefill, preset
from models.decoder import rope_inv_freq
from pallas_kernels import merge_partials, pq_decode_attention

CLEAR = (ValueError, UsageError, TypeError, CodebookFileError, CacheOverflowError)
PROBES: list[tuple[str, str, str, Callable[[], object]]] = []  # (surface, what, expect regex | "nan", fn)


def probe(surface: str, what: str, expect: str):
    def add(fn):
        PROBES.append((surface, what, expect, fn))
        return fn
    return add


def _kv(rng, L=2, H=2, N=200, d=16):
    return rng.standard_normal((L, H, N, d)).astype(np.float32)


def _books(**kw):
    x = _kv(np.random.default_rng(0))
    kw.setdefault("M", 8)
    return fit_kv_codebooks(x, x, nbits=3, key=jax.random.key(0), iters=1, **kw)


@functools.cache
def _tiny():
    """(config, params, codebooks) of a 2-layer tiny model; made once, shared by the probes."""
    cfg = preset("tiny").replace(n_layers=2)
    x = np.random.default_rng(0).standard_normal((2, cfg.n_kv_heads, 300, cfg.head_dim)).astype(np.float32)
    books = fit_kv_codebooks(x, x, M=cfg.head_dim // 2, nbits=4, key=jax.random.key(0), iters=1)
    return cfg, init_params(cfg, jax.random.key(0)), books


# ---------------------------------------------------------------- recipes (million_app.recipes)
def _recipe(**change):
    return dataclasses.replace(RECIPES["pq4"], **change)


probe("recipes", "Recipe with rope='mid'", "rope must be 'pre' or 'post'")(lambda: _recipe(rope="mid"))
probe("recipes", "Recipe with key_nbits=13", r"nbits must be an int in \[1, 12\]")(lambda: _recipe(key_nbits=13))
probe("recipes", "Recipe with value_dsub=0", "value_dsub must be an integer >= 1")(lambda: _recipe(value_dsub=0))
probe("recipes", "Recipe with stages=0", "stages must be an integer >= 1")(lambda: _recipe(stages=0))
probe("recipes", "Recipe with finetune_steps=-5", "finetune_steps must be an integer >= 0")(
    lambda: _recipe(finetune_steps=-5))
probe("recipes", "recipe_for_bits('4') (a string)", "--bits must be an integer, got '4'")(
    lambda: recipe_for_bits("4"))
probe("recipes", "recipe_for_bits(5)", "--bits with --rope pre must be one of")(
    lambda: recipe_for_bits(5))
probe("recipes", "recipe_for_bits(1, 'pre') (no pre-RoPE 1-bit recipe)", "--rope post has one")(
    lambda: recipe_for_bits(1, "pre"))


class _Model:  # what fit_recipe reads of a LoadedModel
    def __init__(self, cfg, params):
        self.config, self.params = cfg, params


def _fit_recipe(name, k, v, gram, count):
    cfg, params, _ = _tiny()
    return fit_recipe(RECIPES[name], _Model(cfg, params), k, v, gram, count, iters=1, max_vectors=64)


def _cal(n=64):
    """Calibration (k, q_gram, q_count) for the tiny model: float32[L, Hkv, n, d], identity Grams, counts 1."""
    cfg = _tiny()[0]
    L, h, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    x = np.random.default_rng(1).standard_normal((L, h, n, d)).astype(np.float32)
    return x, np.tile(np.eye(d, dtype=np.float32), (L, h, 1, 1)), np.ones((L, h))


probe("recipes", "fit_recipe with k of the wrong head_dim", "calibration k must be")(
    lambda: (lambda k, g, c: _fit_recipe("pq4", k[..., :-1], k, g, c))(*_cal()))
probe("recipes", "fit_recipe with k and v of different token counts", "calibration k .* and v .* differ")(
    lambda: (lambda k, g, c: _fit_recipe("pq4", k, k[:, :, :10], g, c))(*_cal()))
probe("recipes", "fit_recipe (query-aware) with q_gram of the wrong shape", "q_gram must have shape")(
    lambda: (lambda k, g, c: _fit_recipe("pq4-qa", k, k, g[:1], c))(*_cal()))
@probe("recipes", "fit_recipe of a pre-RoPE recipe that fine-tunes", "fine-tuning is not implemented")
def _fit_ft_pre():
    cfg, params, _ = _tiny()
    k, g, c = _cal()
    r = _recipe(name="pq4-pre-ft", rope="pre", finetune_steps=3)
    return fit_recipe(r, _Model(cfg, params), k, k, g, c, iters=1, max_vectors=64, queries=(None, None, 64))


# ---------------------------------------------------------------- residual / fine-tuned codebooks
probe("residual", "fit_kv_codebooks with stages=0", "stages")(lambda: _books(stages=0))
probe("residual", "fit_kv_codebooks with stages='2' (a string)", "stages must be an integer")(lambda: _books(stages="2"))
probe("residual", "fit_kv_codebooks with stages=2 and a NaN key", "NaN|finite")(
    lambda: fit_kv_codebooks(
        np.full((2, 2, 50, 16), np.nan, np.float32), _kv(np.random.default_rng(0), N=50), M=8, nbits=3, stages=2,
        key=jax.random.key(0), iters=1))
probe("fine-tuning", "FinetuneSettings(learning_rate=nan)", "learning_rate")(
    lambda: FinetuneSettings(learning_rate=float("nan")))
probe("fine-tuning", "FinetuneSettings(steps=-1)", "steps must be an int >= 0")(
    lambda: FinetuneSettings(steps=-1))


def _finetune(books, q=None, pos=None):
    x = _kv(np.random.default_rng(0), N=64)
    q = np.random.default_rng(1).standard_normal((2, 2, 1, 16, 16)).astype(np.float32) if q is None else q
    pos = np.arange(16) * 4 if pos is None else pos
    return finetune_codebooks(books, q, x, x, pos, window=64, settings=FinetuneSettings(steps=2), key=jax.random.key(0))


probe("fine-tuning", "finetune_codebooks with a NaN query", "NaN|finite")(
    lambda: _finetune(_books(), q=np.full((2, 2, 1, 16, 16), np.nan, np.float32)))
probe("fine-tuning", "finetune_codebooks with query positions past the tokens", "q_pos|position")(
    lambda: _finetune(_books(), pos=np.arange(16) + 100))
probe("fine-tuning", "finetune_codebooks on pre-RoPE codebooks", "before RoPE|pre")(
    lambda: _finetune(_books(rope_inv_freq=rope.rope_inv_freq(16, 1e4))))


# ---------------------------------------------------------------- Flax layers
def _nnx(**kw):
    rng = np.random.default_rng(0)
    shape = (1, 2, 4, 16, 2)  # [L, Hkv, M, K, dsub]: head_dim 8
    books = PQCodebooks.from_centroids(rng.standard_normal(shape), rng.standard_normal(shape))
    layer = PQMultiHeadAttention(4, 32, num_kv_heads=2, decode=True, codebooks=books,
                                 cache_spec=CacheSpec("pq", **kw), rngs=nnx.Rngs(0))
    return layer


probe("flax", "NNX init_cache((2, 16)) (features != in_features 32)", "input_shape must be")(
    lambda: _nnx().init_cache((2, 16)))
probe("flax", "NNX init_cache((2, 0, 32)) (max_length 0)", "input_shape must be")(
    lambda: _nnx().init_cache((2, 0, 32)))
probe("flax", "NNX decode call with T = 0 tokens", r"no tokens to append")(
    lambda: (lambda l: (l.init_cache((2, 8, 32)), l(jnp.ones((2, 0, 32)))))(_nnx()))
probe("flax", "NNX decode call, key/value of 3 tokens for 1 query", "key/value have 3 tokens")(
    lambda: (lambda l: (l.init_cache((2, 8, 32)), l(jnp.ones((2, 1, 32)), jnp.ones((2, 3, 32)))))(_nnx()))
probe("flax", "NNX decode call past max_length (eager)", "cannot take")(
    lambda: (lambda l: (l.init_cache((2, 4, 32)), l(jnp.ones((2, 5, 32)))))(_nnx()))
probe("flax", "NNX decode step with a NaN input (every key from codes)", "nan")(
    lambda: (lambda l: (l.init_cache((1, 8, 32)), l(jnp.full((1, 1, 32), jnp.nan)))[1])(_nnx()))
probe("flax", "NNX layer given pre-RoPE codebooks (it applies no RoPE)", "RoPE")(
    lambda: PQMultiHeadAttention(
        4, 32, num_kv_heads=2, decode=True, codebooks=_books(M=8, rope_inv_freq=rope.rope_inv_freq(16, 1e4)),
        rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------- sharding
def _mesh(shape, names):
    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


probe("sharding", "mesh axes named ('batch', 'tp'), none in the rules", "used by no sharding rule")(
    lambda: sharding.rules_for(_mesh((2, 4), ("batch", "tp")), _tiny()[0]))
probe("sharding", "rules_for without head counts", "head counts")(
    lambda: sharding.rules_for(_mesh((2, 4), ("data", "model"))))
probe("sharding", "tree_specs of a leaf no rule knows", "no sharding rule for a leaf named 'mystery'")(
    lambda: sharding.tree_specs(
        {"mystery": np.zeros((2, 2))}, _mesh((2, 4), ("data", "model"))))
probe("sharding", "make_mesh shape and axis names of different lengths", "differ in length")(
    lambda: sharding.make_mesh((1, 1), ("data",)))


# ---------------------------------------------------------------- keys before RoPE
def _pre_cfg_books():
    cfg, params, books = _tiny()
    return cfg, params, books.with_pre_rope_keys(rope_inv_freq(cfg))


probe("pre-RoPE", "make_cache: pre-RoPE codebooks, model with another rope_theta", "other RoPE frequencies")(
    lambda: (lambda c, p, b: make_cache(CacheSpec("pq", codebooks=b, dtype=jnp.float32), c.replace(rope_theta=5e5),
                                        1, 16))(*_pre_cfg_books()))


def _prefill_other_theta():
    cfg, params, pre = _pre_cfg_books()
    cache = PQCache.for_codebooks(pre, 1, cfg.n_kv_heads, 16, dtype=jnp.float32, impl="xla")
    return prefill(cfg.replace(rope_theta=5e5), params, cache, jnp.ones((1, 4), jnp.int32), jnp.array([4]), pre)


probe("pre-RoPE", "prefill with pre-RoPE cache_consts of another rope_theta", "other RoPE frequencies")(
    _prefill_other_theta)
probe("pre-RoPE", "with_pre_rope_keys on 4-dim key sub-spaces", "RoPE pair|dsub")(
    lambda: _books(M=4).with_pre_rope_keys(rope.rope_inv_freq(16, 1e4)))
probe("pre-RoPE", "with_pre_rope_keys with a NaN frequency", "finite positive")(
    lambda: _books().with_pre_rope_keys(np.full(8, np.nan, np.float32)))
probe("pre-RoPE", "query-aware key transform on pre-RoPE codebooks", "RoPE|transform")(
    lambda: _books(rope_inv_freq=rope.rope_inv_freq(16, 1e4)).with_transforms(
        key_transform=np.tile(np.eye(16, dtype=np.float32), (2, 1, 1, 1))))


def _kernel_freq(bad):
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 16, (1, 1, 20, 32)), jnp.uint8)  # [B, Hkv, T, M]
    books = jnp.asarray(rng.standard_normal((1, 32, 16, 2)), jnp.float32)  # [G, M, K, dsub]
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.float32)
    f = np.asarray(rope.rope_inv_freq(64, 1e4), np.float32)
    f[3] = bad
    return pq_decode_attention(q, codes, codes, books, books, jnp.zeros((1,), jnp.int32), jnp.full((1,), 20, jnp.int32),
                               rope_inv_freq=jnp.asarray(f), interpret=True)


probe("pre-RoPE", "kernel with a NaN RoPE frequency", "finite and > 0")(lambda: _kernel_freq(np.nan))
probe("pre-RoPE", "kernel with a zero RoPE frequency", "finite and > 0")(lambda: _kernel_freq(0.0))


# ---------------------------------------------------------------- codebook files
def _edited_file(edit: dict | None = None, drop: str | None = None, truncate: bool = False):
    d = tempfile.mkdtemp()
    path = os.path.join(d, "kv.safetensors")
    save_kv_codebooks(path, _books(rope_inv_freq=rope.rope_inv_freq(16, 1e4)))
    if truncate:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        return load_kv_codebooks(path)
    with safe_open(path, framework="numpy") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    header = json.loads(meta["million_jax"])
    header["user"].update(edit or {})
    if drop:
        tensors.pop(drop)
        header["extras"].pop(drop)
    save_file(tensors, path, {**meta, "million_jax": json.dumps(header)})
    return load_kv_codebooks(path)


probe("files", "K/V file with metadata stages edited 1 -> 2", "metadata and the tensors disagree")(
    lambda: _edited_file({"stages": 2}))
probe("files", "pre-RoPE file without its rope_inv_freq tensor", "lacks the rope_inv_freq tensor")(
    lambda: _edited_file(drop="rope_inv_freq"))
probe("files", "K/V file with key_rope 'sideways'", "key_rope='sideways'")(lambda: _edited_file({"key_rope": "sideways"}))
probe("files", "K/V file truncated to half", "corrupt or truncated")(lambda: _edited_file(truncate=True))


# ---------------------------------------------------------------- attention math
def _merge_nan():
    lse = jnp.array([[0.5], [jnp.nan]])
    out = jnp.ones((2, 1, 4))
    return merge_partials([out[0], out[1]], [lse[0], lse[1]])[0]


probe("attention", "merge of a finite partial and a NaN partial", "nan")(_merge_nan)


def _attn_nan_query():
    rng = np.random.default_rng(3)
    books = _books()  # layer_head: [L, Hkv, M, K, dsub]
    codes = jnp.asarray(rng.integers(0, 8, (1, 2, 12, 8)), jnp.uint8)
    q = jnp.asarray(rng.standard_normal((1, 1, 4, 16)), jnp.float32).at[0, 0, 1, 2].set(jnp.nan)
    lo, hi = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 12, jnp.int32)
    out, _ = pq_code_attention(q, codes, codes, books.key.centroids[0], books.value.centroids[0], lo, hi, impl="xla")
    return out[0, 0, 1]


probe("attention", "PQ attention (xla) with a NaN query head", "nan")(_attn_nan_query)


def run(fn, expect: str) -> tuple[bool, str]:
    try:
        got = fn()
    except CLEAR as e:
        msg = str(e).splitlines()[0]
        if expect != "nan" and re.search(expect, msg):
            return True, f"clear error ({type(e).__name__}): {msg[:160]}"
        return False, f"unexpected message ({type(e).__name__}): {msg[:160]}"
    except Exception as e:  # noqa: BLE001 - the survey records whatever happened
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if expect == "nan":
        leaves = [np.asarray(x) for x in jax.tree.leaves(got) if hasattr(x, "dtype")]
        nan = any(np.isnan(a).any() for a in leaves if np.issubdtype(a.dtype, np.floating))
        return nan, "NaN out (the bad value is not lost)" if nan else "finite output: the NaN was dropped"
    return False, "accepted without an error"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="markdown file to write (default: print only)")
    a = p.parse_args()
    rows, bad = [], 0
    for i, (surface, what, expect, fn) in enumerate(PROBES, 1):
        ok, outcome = run(fn, expect)
        bad += not ok
        rows.append(f"| {i} | {surface} | {what} | {'ok' if ok else 'BAD'} | {outcome.replace('|', '/')} |")
        print(rows[-1], flush=True)
    text = "\n".join(["| # | surface | bad input | verdict | outcome |", "|---|---|---|---|---|", *rows,
                      "", f"{len(PROBES) - bad} of {len(PROBES)} ok, {bad} BAD", ""])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(f"{len(PROBES) - bad} of {len(PROBES)} ok, {bad} BAD")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""Sharded-vs-single-device checks, run as a script under 8 fake CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only works if it is set
before jax is imported, so ``test_sharded_model.py`` launches this file in a
subprocess and asserts on the JSON it writes::

    python tests/sharding/sharded_checks.py --part dense --out dense.json
    python tests/sharding/sharded_checks.py --part pq --out pq.json

For the dense and the PQ cache (impl="xla", random layer_head codebooks) it
runs ``prefill`` of a first prompt chunk, greedy ``generate`` appending the
ragged rest of the prompts (its own prefill + the jitted decode loop, cache
donated), then two ``decode_step`` calls on the resulting cache, on one
device and on the meshes (8, 1), (2, 4) and (1, 8) with params, cache,
codebooks and inputs sharded by :mod:`million_jax.sharding`. It records the
generated tokens, max |logit difference| of prefill and decode steps, the difference
of the final cache contents, whether every output cache leaf keeps its rule
sharding, whether donation worked, and the collectives in the compiled
decode step's HLO (those touching a cache-shaped operand listed separately).
Extra cases, same checks: the PQ cache with impl="pallas" (decode steps in the Pallas
kernel, interpret mode, run per shard under ``shard_map`` on (2, 4) and (1, 8)), a UniformCache (KIVI 4-bit) on (2, 4), and GQA with
fewer KV heads than the "model" axis (4 KV heads on (1, 8): ``rules_for``
replicates attention and the cache over "model", the MLP stays split).
"""
from __future__ import annotations

import os
import sys

if "jax" in sys.modules:  # the flag below is read once, when jax initialises its backends
    raise RuntimeError("sharded_checks.py must run in a fresh interpreter (jax already imported)")
# backend optimisation level 0 halves CPU compile time; the SPMD partitioning checked here is unaffected
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from million_jax import sharding as S  # noqa: E402
from million_jax.cache.dense import DenseCache  # noqa: E402
from million_jax.cache.pq_cache import PQCache, PQCodebooks  # noqa: E402
from million_jax.cache.uniform_cache import UniformCache  # noqa: E402
from million_jax.quant.pq import Codebooks  # noqa: E402
from models import LlamaConfig, decode_step, generate, init_params, prefill  # noqa: E402

MESHES = [(8, 1), (2, 4), (1, 8)]
PALLAS_MESHES = [(2, 4), (1, 8)]   # the kernel per shard: batch and KV heads split, all heads split
BATCH = 8
T_MAX = 520        # distinctive extents: a collective whose shape has one of these moves cache data
WINDOW = 5
SINKS = 2
PROMPT_T = 14      # FIRST_T tokens through prefill (> 8: the PQ multi-query path), the rest
FIRST_T = 10       # (1-4 per row, ragged: the LUT path) through generate's own prefill
NEW_TOKENS = 8
CONFIG = LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=8, n_kv_heads=8,
                     head_dim=8, eos_ids=())
GQA_CONFIG = CONFIG.replace(n_kv_heads=4)
COLLECTIVE = re.compile(
    r"=\s+(.+?)\s+(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(?:-start)?\(")
SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collectives(hlo: str) -> list[dict[str, Any]]:
    """Every collective op in an HLO module text: op name and result shapes."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            shapes = [(dt, [int(x) for x in dims.split(",") if x]) for dt, dims in SHAPE.findall(m.group(1))]
            out.append({"op": m.group(2), "shapes": shapes})
    return out


def cache_sized(coll: dict[str, Any], min_elems: int) -> bool:
    """Does a collective move cache data (a T_max / ring extent, or >= one layer's cache shard)?"""
    for _, dims in coll["shapes"]:
        if T_MAX in dims or WINDOW in dims or int(np.prod(dims)) >= min_elems:
            return True
    return False


def sharding_error(what: str, cache: Any, mesh: Any, rules: Any) -> str | None:
    """None if every leaf of ``cache`` has its rule sharding, else the mismatch."""
    try:
        S.assert_sharded_as(cache, mesh, rules)
    except AssertionError as e:
        return f"{what}: {e}"
    return None


def min_layer_shard_elems(cache: Any) -> int:
    """Elements of the smallest per-device, per-layer shard of a T_max-long cache array of codes /
    vectors (per-token scalars, e.g. norm-explicit scales [..., T_max, 1], are left out: their shard
    is smaller than the codebooks, which are not cache data)."""
    sizes = [int(np.prod(x.sharding.shard_shape(x.shape)[1:])) for x in jax.tree.leaves(cache)
             if x.ndim == 5 and x.shape[3] == T_MAX and x.shape[4] > 1]
    return min(sizes)


def make_cache(kind: str, config: LlamaConfig) -> tuple[Any, Any]:
    """(empty cache, cache_consts) of one kind for ``config``.

    "pq" reads codes on the xla path; "pq-pallas" runs decode steps in the Pallas kernel
    (interpret mode on CPU; on a mesh, per shard under ``shard_map``), with norm-explicit
    codebooks, so the per-token float16 scales are sharded with the codes and read by the kernel.
    """
    L, hkv, d = config.n_layers, config.n_kv_heads, config.head_dim
    if kind == "dense":
        return DenseCache.create(L, BATCH, hkv, T_MAX, d, jnp.float32), None
    if kind in ("pq", "pq-pallas"):
        k1, k2 = jax.random.split(jax.random.key(7))
        shape = (L, hkv, 4, 16, d // 4)                      # layer_head, M=4, nbits=4
        books = PQCodebooks(Codebooks(jax.random.normal(k1, shape)), Codebooks(jax.random.normal(k2, shape)),
                            "layer_head")
        if kind == "pq-pallas":
            books = books.with_explicit_norms(True, True)
        cache = PQCache.for_codebooks(books, BATCH, hkv, T_MAX, window=WINDOW, sinks=SINKS, dtype=jnp.float32,
                                      impl="pallas" if kind == "pq-pallas" else "xla")
        return cache, books
    if kind == "uniform":
        cache = UniformCache.create(L, BATCH, hkv, T_MAX, d, bits=4, group_size=4, window=WINDOW,
                                    sinks=SINKS, dtype=jnp.float32, tile=64)
        return cache, None
    raise ValueError(kind)


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts in two chunks: a full first chunk int32[B, FIRST_T], then a ragged rest.

    Returns (first chunk, rest int32[B, PROMPT_T - FIRST_T] left-aligned, rest lengths >= 1).
    """
    rng = np.random.default_rng(0)
    rest_t = PROMPT_T - FIRST_T
    first = rng.integers(3, CONFIG.vocab, (BATCH, FIRST_T)).astype(np.int32)
    rest = rng.integers(3, CONFIG.vocab, (BATCH, rest_t)).astype(np.int32)
    lengths = rng.integers(1, rest_t + 1, BATCH).astype(np.int32)
    lengths[0] = rest_t
    rest[np.arange(rest_t)[None, :] >= lengths[:, None]] = 0
    return first, rest, lengths


def run_case(config: LlamaConfig, kind: str, mesh_shape: tuple[int, int] | None,
             params: Any) -> dict[str, Any]:
    """Prefill, greedy ``generate`` (appending), two ``decode_step`` calls; one device or a mesh."""
    t0 = time.perf_counter()
    first, rest, lengths = inputs()
    cache, books = make_cache(kind, config)
    res: dict[str, Any] = {"kind": kind, "mesh": list(mesh_shape) if mesh_shape else None,
                           "n_kv_heads": config.n_kv_heads}
    first_len = np.full((BATCH,), FIRST_T, np.int32)
    if mesh_shape is not None:
        mesh = S.make_mesh(mesh_shape)
        rules = S.rules_for(mesh, config)
        params = S.shard_params(params, mesh, rules)
        cache, books = S.shard_cache(cache, mesh, rules), S.shard_codebooks(books, mesh, rules)
        first, rest, lengths, first_len = S.shard_batch((first, rest, lengths, first_len), mesh, rules)
    logits_p, cache = prefill(config, params, cache, first, first_len, books)
    errors = [] if mesh_shape is None else [e for e in [sharding_error("prefill", cache, mesh, rules)] if e]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(config, params, cache, rest, lengths, max_new_tokens=NEW_TOKENS,
                       cache_consts=books)
        jax.block_until_ready(out.tokens)
    res["tokens"] = np.asarray(out.tokens).tolist()
    res["donation_warnings"] = [str(w.message)[:200] for w in caught if "donat" in str(w.message)]
    cache = out.cache
    if mesh_shape is not None:  # before the decode steps below, which donate this cache
        errors += [e for e in [sharding_error("generate", cache, mesh, rules)] if e]
    res["cache"] = {jax.tree_util.keystr(path): np.asarray(x)
                    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]}
    tok = jnp.asarray(out.tokens[:, -1])
    traced = decode_step.trace(config, params, cache, tok, books)  # traced once: jaxpr and executable
    step = traced.lower().compile()
    hlo = step.as_text()
    # interpret mode inlines the kernel into plain HLO: look for it in the traced program
    jaxpr = str(traced.jaxpr)
    res["pallas_kernel_in_step"] = "pallas_call" in jaxpr
    res["shard_map_in_step"] = "shard_map" in jaxpr
    l1, cache = step(params, cache, tok, books)
    tok = jnp.argmax(l1, axis=-1).astype(jnp.int32)
    l2, cache = step(params, cache, tok, books)
    res["logits"] = [np.asarray(x, np.float32) for x in (logits_p, l1, l2)]
    if mesh_shape is not None:
        errors += [e for e in [sharding_error("decode_step", cache, mesh, rules)] if e]
        res["cache_sharding_errors"] = errors
        min_elems = min_layer_shard_elems(cache)
        colls = collectives(hlo)
        res["min_cache_shard_elems"] = min_elems
        res["collectives"] = [f"{c['op']} {c['shapes']}" for c in colls]
        res["cache_collectives"] = [f"{c['op']} {c['shapes']}" for c in colls if cache_sized(c, min_elems)]
        # a collective of codebook-shaped data ([..., M, K, dsub]): the codebooks are split with the
        # KV heads and must stay per shard (encoding once all-gathered them every decode step)
        book = None if books is None else list(books.key.centroids.shape[-3:])
        res["codebook_collectives"] = [f"{c['op']} {c['shapes']}" for c in colls
                                       if book and any(dims[-3:] == book for _, dims in c["shapes"])]
    res["seconds"] = time.perf_counter() - t0
    return res


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """JSON-able summary of one sharded case against the single-device reference."""
    out = {k: v for k, v in got.items() if k not in ("logits", "cache")}
    out["logit_max_abs_diff"] = [float(np.max(np.abs(a - b))) for a, b in zip(ref["logits"], got["logits"])]
    out["logit_scale"] = float(np.max(np.abs(ref["logits"][0])))
    out["ref_tokens"] = ref["tokens"]
    out["tokens_equal"] = ref["tokens"] == got["tokens"]
    diffs = {}
    for name, a in ref["cache"].items():
        b = got["cache"][name]
        if np.issubdtype(a.dtype, np.floating):
            diffs[name] = float(np.max(np.abs(a - b), initial=0.0))
        else:
            diffs[name] = float(np.mean(a != b)) if a.size else 0.0   # codes / lengths: fraction differing
    out["cache_diff"] = diffs
    return out


# The cases in two halves of about equal cost, so that two pytest-xdist workers run
# them side by side (``--part``); each half computes the single-device references it needs.
PARTS = {
    "dense": [("dense", CONFIG, MESHES), ("uniform", CONFIG, [(2, 4)]), ("dense", GQA_CONFIG, [(1, 8)])],
    "pq": [("pq", CONFIG, MESHES), ("pq-pallas", CONFIG, PALLAS_MESHES)],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--part", choices=sorted(PARTS), required=True, help="which half of the cases")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    assert jax.device_count() == 8, jax.devices()
    cases, ref_seconds = [], {}
    for kind, config, meshes in PARTS[args.part]:
        key = 0 if config is CONFIG else 1
        params = init_params(config, jax.random.key(key), jnp.float32, 0.2)
        ref = run_case(config, kind, None, params)
        ref_seconds[f"{kind}-kv{config.n_kv_heads}"] = ref["seconds"]
        for shape in meshes:
            cases.append(compare(ref, run_case(config, kind, shape, params)))
    result = {"devices": jax.device_count(), "seconds": time.perf_counter() - t0,
              "reference_seconds": ref_seconds, "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

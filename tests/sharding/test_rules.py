"""Sharding rules: logical axes per leaf -> PartitionSpecs, on abstract meshes (no devices needed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from million_jax import sharding as S
from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache, PQCodebooks
from million_jax.cache.uniform_cache import UniformCache
from million_jax.quant.pq import Codebooks
from models import LlamaConfig, init_params, preset

CONFIG = LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=8, n_kv_heads=8,
                     head_dim=8, attention_bias=True, mlp_bias=True)


def mesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), (S.DATA, S.MODEL), axis_types=(AxisType.Auto,) * 2)


def specs_by_name(tree, m, rules=S.DEFAULT_RULES) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(S.tree_specs(tree, m, rules),
                                                is_leaf=lambda x: isinstance(x, P))[0]
    return {S._leaf_name(path): spec for path, spec in flat}


def test_params_tensor_parallel_over_heads_and_mlp():
    params = jax.eval_shape(lambda k: init_params(CONFIG, k), jax.random.key(0))
    specs = specs_by_name(params, mesh(2, 4), S.rules_for(mesh(2, 4), CONFIG))
    col, row, rep = P(None, None, "model"), P(None, "model"), P()
    assert {n: specs[n] for n in ("wq", "wk", "wv", "w_gate", "w_up")} == dict.fromkeys(
        ("wq", "wk", "wv", "w_gate", "w_up"), col)
    assert specs["wo"] == row and specs["w_down"] == row
    assert specs["bq"] == row and specs["bk"] == row and specs["b_gate"] == row
    assert specs["bo"] == rep and specs["b_down"] == rep          # added after the all-reduce
    assert specs["embed"] == P("model") and specs["lm_head"] == P(None, "model")
    assert specs["attn_norm"] == rep and specs["final_norm"] == rep


def test_caches_split_by_batch_and_kv_heads():
    m = mesh(2, 4)
    make = {
        "dense": lambda: DenseCache.create(2, 8, 8, 32, 8),
        "pq": lambda: PQCache.create(2, 8, 8, 32, 8, M=4, nbits=8, window=4, sinks=2),
        "uniform": lambda: UniformCache.create(2, 8, 8, 32, 8, bits=4, group_size=4, window=4, sinks=2),
    }
    for kind, fn in make.items():
        specs = specs_by_name(jax.eval_shape(fn), m)
        assert specs.pop("lengths") == P("data"), kind
        assert set(specs.values()) == {P(None, "data", "model")}, (kind, specs)


@pytest.mark.parametrize("granularity,shape,want", [
    ("layer_head", (2, 8, 4, 16, 2), P(None, "model")),
    ("layer", (2, 4, 16, 2), P()),
    ("shared", (4, 16, 2), P()),
])
def test_codebooks_follow_their_heads_else_replicated(granularity, shape, want):
    cb = Codebooks(jax.ShapeDtypeStruct(shape, jnp.float32))
    books = PQCodebooks(cb, cb, granularity)
    specs = jax.tree.leaves(S.tree_specs(books, mesh(2, 4)), is_leaf=lambda x: isinstance(x, P))
    assert specs == [want, want]


def test_gqa_with_fewer_kv_heads_than_model_axis_replicates_attention_only():
    cfg = CONFIG.replace(n_kv_heads=4)
    m = mesh(1, 8)
    rules = S.rules_for(m, cfg)
    assert rules["heads"] is None and rules["kv_heads"] is None and rules["mlp"] == "model"
    params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    specs = specs_by_name(params, m, rules)
    # H*d = 64 and Hkv*d = 32 both divide by 8, but 4 whole KV heads do not: no split
    assert specs["wq"] == P() and specs["wk"] == P() and specs["wo"] == P()
    assert specs["w_gate"] == P(None, None, "model")
    cache = jax.eval_shape(lambda: DenseCache.create(2, 8, 4, 32, 8))
    assert S.tree_specs(cache, m, rules).layers.k == P()
    # (2, 4): 4 KV heads split 4 ways, query heads follow
    rules = S.rules_for(mesh(2, 4), cfg)
    assert rules["heads"] == rules["kv_heads"] == ("model",)


def test_indivisible_dims_are_replicated_and_axes_used_once():
    m = mesh(2, 4)
    assert S.logical_to_spec(("batch", None), (3, 5), m) == P()
    assert S.logical_to_spec(("batch", "kv_heads"), (4, 6), m) == P("data")
    rules = {**S.DEFAULT_RULES, "batch": ("data", "model")}
    assert S.logical_to_spec(("batch",), (8,), m, rules) == P(("data", "model"))
    assert S.logical_to_spec(("batch",), (6,), m, rules) == P("data")      # longest dividing prefix
    # "model" already taken by the batch: the heads stay replicated
    assert S.logical_to_spec(("batch", "kv_heads"), (8, 8), m, rules) == P(("data", "model"))


def test_one_dimensional_mesh_ignores_missing_axes():
    m = AbstractMesh((4,), (S.MODEL,), axis_types=(AxisType.Auto,))
    cache = jax.eval_shape(lambda: DenseCache.create(2, 8, 8, 32, 8))
    assert S.tree_specs(cache, m).layers.k == P(None, None, "model")
    assert S.tree_specs(cache, m).lengths == P()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no sharding rule for a leaf named 'mystery'"):
        S.tree_specs({"mystery": np.zeros((2, 2))}, mesh(2, 4))
    with pytest.raises(ValueError, match="has rank 2"):
        S.tree_specs({"wq": np.zeros((2, 2))}, mesh(2, 4))
    with pytest.raises(ValueError, match="no entry in the sharding rules"):
        S.logical_to_spec(("batch",), (8,), mesh(2, 4), {})
    with pytest.raises(ValueError, match="head counts"):
        S.rules_for(mesh(2, 4))


def test_make_mesh_on_local_devices():
    n = jax.device_count()
    m = S.make_mesh((1, -1))
    assert dict(m.shape) == {S.DATA: 1, S.MODEL: n}
    assert all(t == AxisType.Auto for t in m.axis_types)
    with pytest.raises(ValueError, match="needs"):
        S.make_mesh((n + 1, 1))
    with pytest.raises(ValueError, match="at most one"):
        S.make_mesh((-1, -1))


def test_shard_and_check_on_one_device_mesh():
    """The whole API also runs on a 1-device mesh (CI without fake devices)."""
    m = S.make_mesh((1, 1))
    rules = S.rules_for(m, CONFIG)
    cache = S.shard_cache(DenseCache.create(2, 2, 8, 16, 8, jnp.float32), m, rules)
    S.assert_sharded_as(cache, m, rules)
    tokens = S.shard_batch(np.zeros((2, 3), np.int32), m, rules)
    assert tokens.sharding.is_equivalent_to(S.batch_sharding(m, (2, 3), rules), 2)
    text = S.describe_shardings(cache, m, rules)
    assert ".k " in text and "(2, 2, 8, 16, 8)" in text


def test_seven_b_abstract_params_shard_eight_ways():
    """A 7B-shaped tree (ShapeDtypeStructs only, nothing materialised) splits 8 ways."""
    cfg = preset("llama2-7b")
    m = mesh(1, 8)
    params = jax.eval_shape(lambda k: init_params(cfg, k, jnp.bfloat16), jax.random.key(0))
    shards = S.tree_shardings(params, m, S.rules_for(m, cfg))
    assert shards["layers"]["wq"].shard_shape((32, 4096, 4096)) == (32, 4096, 512)
    assert shards["layers"]["w_down"].shard_shape((32, 11008, 4096)) == (32, 1376, 4096)
    assert shards["embed"].shard_shape((32000, 4096)) == (4000, 4096)


def test_abstract_tree_carries_shardings():
    m = S.make_mesh((1, 1))
    cache = jax.eval_shape(lambda: DenseCache.create(2, 2, 8, 16, 8))
    abstract = S.abstract_tree(cache, m)
    assert isinstance(abstract.layers.k, jax.ShapeDtypeStruct) and abstract.layers.k.dtype == jnp.bfloat16
    assert abstract.layers.k.sharding.spec == P()      # size-1 mesh axes are left out of the spec


def test_mesh_axis_no_rule_names_is_refused_not_silently_replicated():
    """A mesh whose axes carry other names than the rules' would replicate everything over
    them; rules_for and tree_specs refuse it. Size-1 axes of any name are harmless."""
    odd = AbstractMesh((2, 4), ("batch", "tp"), axis_types=(AxisType.Auto,) * 2)
    cache = jax.eval_shape(lambda: DenseCache.create(2, 8, 8, 32, 8))
    with pytest.raises(ValueError, match=r"mesh axis 'batch' \(size 2\), 'tp' \(size 4\) is used by no sharding rule"):
        S.rules_for(odd, CONFIG)
    with pytest.raises(ValueError, match="'tp' .size 4. is used by no sharding rule"):
        S.tree_specs(cache, odd)
    extra = AbstractMesh((2, 4, 1), (S.DATA, S.MODEL, "pipe"), axis_types=(AxisType.Auto,) * 3)
    assert S.tree_specs(cache, extra, S.rules_for(extra, CONFIG)).layers.k == P(None, "data", "model")

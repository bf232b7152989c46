"""Sharding the model, its KV caches and the PQ codebooks over a device mesh.

Everything here builds on JAX's own SPMD partitioner (``jax.jit`` over
``NamedSharding`` inputs); nothing is home-made. A 2-D mesh has a ``"data"``
axis (data parallel: the batch) and a ``"model"`` axis (tensor parallel:
attention heads and the MLP hidden dimension, Megatron style: column-parallel
q/k/v/gate/up projections, row-parallel o/down projections).

The rules are written once, in two small tables:

* :data:`LEAF_AXES` gives every array of the params, of every cache kind and of
  the codebooks *logical* axis names, keyed by the leaf's field name (the last
  key of its pytree path: ``"wq"``, ``"k_codes"``, ``"centroids"``...);
* :data:`DEFAULT_RULES` maps each logical name to mesh axes (``"batch" ->
  "data"``, ``"heads"``/``"kv_heads"``/``"mlp"``/``"vocab" -> "model"``, all
  others replicated).

:func:`tree_shardings` applies both to any pytree, so params, DenseCache,
PQCache, UniformCache and PQCodebooks are all sharded by the same code. A
dimension whose size is not divisible by its mesh axes is replicated instead
(e.g. a batch of 3 on a 2-way ``"data"`` axis), so any mesh works;
:func:`describe_shardings` shows what was decided.

The q/k/v/o weights fuse heads and head_dim into one axis, so whether whole
heads divide the mesh is decided from the model's head counts by
:func:`rules_for` (use its result everywhere; ``DEFAULT_RULES`` alone is only
right when the "model" axis divides ``n_kv_heads``).

Typical use (single or multi host; see :func:`make_mesh`)::

    mesh = make_mesh((2, 4))                     # 2-way data x 4-way tensor parallel
    rules = rules_for(mesh, config)              # heads / kv_heads resolved for this model
    params = shard_params(params, mesh, rules)
    cache = shard_cache(cache, mesh, rules)      # DenseCache | PQCache | UniformCache
    books = shard_codebooks(books, mesh, rules)  # PQCodebooks (cache_consts)
    tokens, lengths = shard_batch((tokens, lengths), mesh, rules)
    logits, cache = prefill(config, params, cache, tokens, lengths, books)
    logits, cache = decode_step(config, params, cache, tok, books)
    res = generate(config, params, cache, tokens, lengths, cache_consts=books, ...)

The jitted entry points need no change: ``jax.jit`` partitions the program
from the input shardings, and the partitioner keeps every cache shard on its
device (the caches' per-layer scans, scatters and attention only ever mix
data of one sequence and one KV head). :func:`sharded_jit` makes the cache's
output sharding explicit (out_shardings) and donates it, for users who compile
their own step functions; :func:`assert_sharded_as` checks a result.

What moves between devices in a decode step (compiled HLO, tests/sharding):
one all-reduce of the [B, 1, D] activations after ``wo``, ``w_down`` and the
vocab-split embedding lookup (tensor parallelism), and small all-gathers of
the new token's K/V / codes / write indices across "data" (the caches'
scatter). Never the cache. Decode steps that run the Pallas kernel run it per
shard under ``shard_map`` (:func:`shard_cache` records the split in a PQ
cache). The xla PQ path also all-gathers codebook-sized
operands over "model" every layer and step: the value centroids of the
layer (``pallas_kernels.pq_math.gather_centroids`` indexes heads with an iota; 4 MiB
per layer at LLaMA-2-7B shape) and, with more than one sequence per device,
their per-sequence broadcast in ``pq.encode`` (which flattens [B, Hkv, M]).
Both go away when those gathers are written with ``jax.vmap`` over batch and
heads.

Multi-host: every process passes the same global values to ``shard_*``;
``generate``'s ``prompt_lengths`` must be a host array (it is validated on
the host); read results with ``multihost_utils.process_allgather``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from million_jax.cache.pq_cache import PQCache
from million_jax.cache.turboquant_cache import TurboQuantCache
from million_jax.attention.pq_dispatch import KernelMesh

__all__ = [
    "DATA",
    "MODEL",
    "DEFAULT_RULES",
    "LEAF_AXES",
    "make_mesh",
    "rules_for",
    "check_mesh_axes",
    "logical_axes",
    "logical_to_spec",
    "tree_specs",
    "tree_shardings",
    "shard_tree",
    "shard_params",
    "shard_cache",
    "shard_codebooks",
    "shard_batch",
    "batch_sharding",
    "replicated",
    "abstract_tree",
    "sharded_jit",
    "assert_sharded_as",
    "describe_shardings",
]

DATA = "data"
MODEL = "model"

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]
LogicalAxes = tuple[str | None, ...]
PyTree = Any

# Logical axis name -> mesh axes. Names not listed here are an error (a typo
# must not silently replicate a tensor); None means replicated.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": DATA,          # sequences of a batch: data parallel
    "heads": MODEL,         # query heads (the fused H*d axis of wq / wo)
    "kv_heads": MODEL,      # key/value heads: wk / wv, every cache array, layer_head codebooks
    "mlp": MODEL,           # MLP hidden (intermediate) dimension
    "vocab": MODEL,         # embedding rows / LM-head columns
    "embed": None,          # model width D: activations are replicated over "model"
    "layers": None,         # the stacked layer axis (scanned)
    "kv_seq": None,         # cache positions (T_max, sinks S, ring W, key-stat groups)
    "kv_feature": None,     # head_dim / PQ subspaces M / packed bytes / stats per token
    "subspace": None,       # codebook subspaces M
    "centroid": None,       # codebook entries K
    "subdim": None,         # codebook sub-vector dims d/M
}

_CACHE_5D: LogicalAxes = ("layers", "batch", "kv_heads", "kv_seq", "kv_feature")

# Leaf field name -> logical axes (or {rank: logical axes} where one name has
# several layouts). Covers models.decoder params, DenseCache, PQCache,
# UniformCache and PQCodebooks.
LEAF_AXES: dict[str, LogicalAxes | dict[int, LogicalAxes]] = {
    # --- params (weights are [in, out]; see models/decoder.py)
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "heads", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "bo": ("layers", "embed"),
    "b_gate": ("layers", "mlp"),
    "b_up": ("layers", "mlp"),
    "b_down": ("layers", "embed"),
    "q_norm": ("layers", "kv_feature"),     # Gemma 3: per-head QK-norm over head_dim
    "k_norm": ("layers", "kv_feature"),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    # --- caches: every per-token array is [L, B, Hkv, N, F]
    **{name: _CACHE_5D for name in (
        "k", "v",                                        # DenseCache
        "k_codes", "v_codes", "sink_k", "sink_v", "ring_k", "ring_v",   # PQCache
        "k_scales", "v_scales",                                         # PQCache, norm-explicit
        "k_scale", "k_zero", "k_stage", "v_scale", "v_zero",            # UniformCache
        "k_norms", "v_norms", "k_qjl", "k_rnorms",                      # TurboQuantCache
    )},
    "lengths": ("batch",),
    # --- turboquant constants: one rotation / QJL projection per layer, [L, d, d], replicated
    "rotation": ("layers", "kv_feature", "kv_feature"),
    "qjl": ("layers", "kv_feature", "kv_feature"),
    # --- PQ codebooks: PQCodebooks are [L, G, M, K, dsub] (G = Hkv or 1); a bare
    # Codebooks may also be [L, M, K, dsub] or [M, K, dsub]
    "centroids": {
        5: ("layers", "kv_heads", "subspace", "centroid", "subdim"),
        4: ("layers", "subspace", "centroid", "subdim"),
        3: ("subspace", "centroid", "subdim"),
    },
    "key_pair_order": ("layers", "kv_heads", "subspace"),  # [L, G, M]: the RoPE pair of each key sub-space
}


# ------------------------------------------------------------------ mesh
def make_mesh(
    shape: Sequence[int] = (1, -1),
    axis_names: Sequence[str] = (DATA, MODEL),
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over ``devices`` (default: all devices of all processes).

    ``shape`` may contain one -1, filled with the remaining device count
    (``(1, -1)``: pure tensor parallel over every device). Axes are
    ``AxisType.Auto``: the partitioner propagates shardings through the model
    (the explicit-sharding mode that ``jax.make_mesh`` defaults to would
    require annotating every reshape). Multi-host: call
    ``jax.distributed.initialize()`` first; the mesh then spans the devices of
    every process, and ``jax.make_mesh`` orders them so that the inner
    ("model") axis stays inside a host where possible.
    """
    devs = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} and axis names {tuple(axis_names)} differ in length")
    if shape.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {tuple(shape)}")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest <= 0 or len(devs) % rest:
            raise ValueError(f"cannot fill mesh shape {tuple(shape)} from {len(devs)} devices")
        shape[shape.index(-1)] = len(devs) // rest
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh axis sizes must be >= 1, got {tuple(shape)}")
    if math.prod(shape) > len(devs):
        raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, "
                         f"{len(devs)} available")
    return jax.make_mesh(tuple(shape), tuple(axis_names), (AxisType.Auto,) * len(shape),
                         devices=devs[: math.prod(shape)])


# ------------------------------------------------------------------ rules
def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _divisor_prefix(axes: Sequence[str], size: int, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The longest prefix of ``axes`` (those present in the mesh) whose total size divides ``size``."""
    cand = [a for a in axes if a in mesh_shape]
    while cand and size % math.prod(mesh_shape[a] for a in cand):
        cand.pop()
    return tuple(cand)


def check_mesh_axes(mesh: Mesh, rules: Rules) -> None:
    """ValueError if a mesh axis of size > 1 is named by no rule: everything would silently be
    replicated over it (e.g. a mesh made with other axis names than the rules')."""
    named = {a for axes in rules.values() for a in _as_tuple(axes)}
    unused = [f"{a!r} (size {n})" for a, n in mesh.shape.items() if n > 1 and a not in named]
    if unused:
        raise ValueError(f"mesh axis {', '.join(unused)} is used by no sharding rule (the rules name "
                         f"{sorted(named)}): nothing would be split over it. Name the mesh axes "
                         f"{DATA!r} / {MODEL!r} (million_jax.sharding.make_mesh) or pass rules that use it")


def rules_for(
    mesh: Mesh,
    config: Any = None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    base: Rules = DEFAULT_RULES,
) -> dict[str, MeshAxes]:
    """``base`` rules resolved for a model's head counts on ``mesh``.

    The q/k/v/o weights fuse heads and head_dim into one axis ([D, H*d]), so
    their divisibility by the mesh says nothing about whole heads: this fixes
    the "heads" / "kv_heads" rules from the real head counts (``config`` is
    anything with ``n_heads`` / ``n_kv_heads``, e.g. a ``models.LlamaConfig``).
    KV heads are split over the longest prefix of their mesh axes that divides
    ``n_kv_heads``; query heads are split exactly like the KV heads (each
    device keeps whole GQA groups next to their K/V and cache shard). With
    fewer KV heads than the "model" axis, attention is therefore replicated
    over "model" (the MLP and vocab stay split) rather than the cache being
    moved between devices on every step.
    """
    if config is not None:
        n_heads = config.n_heads if n_heads is None else n_heads
        n_kv_heads = config.n_kv_heads if n_kv_heads is None else n_kv_heads
    if n_heads is None or n_kv_heads is None:
        raise ValueError("rules_for needs the head counts: pass config or n_heads and n_kv_heads")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    check_mesh_axes(mesh, base)
    rules = dict(base)
    kv = _divisor_prefix(_as_tuple(base.get("kv_heads")), n_kv_heads, mesh.shape)
    rules["kv_heads"] = kv or None
    rules["heads"] = kv or None   # n_heads = G * n_kv_heads: whatever splits KV heads splits heads
    return rules


def _leaf_name(path: tuple[Any, ...]) -> str:
    """The field name of a pytree leaf: the last dict key / attribute name on its path."""
    for entry in reversed(path):
        for attr in ("key", "name"):
            val = getattr(entry, attr, None)
            if isinstance(val, str):
                return val
    return jax.tree_util.keystr(path)


def logical_axes(name: str, ndim: int) -> LogicalAxes:
    """Logical axis names of the leaf called ``name`` with ``ndim`` dims (from LEAF_AXES)."""
    entry = LEAF_AXES.get(name)
    if isinstance(entry, dict):
        entry = entry.get(ndim)
    if entry is None:
        raise ValueError(f"no sharding rule for a leaf named {name!r} of rank {ndim}; "
                         f"known names: {sorted(LEAF_AXES)}")
    if len(entry) != ndim:
        raise ValueError(f"leaf {name!r} has rank {ndim}, its logical axes {entry} have {len(entry)}")
    return entry


def logical_to_spec(
    axes: Iterable[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` whose dims carry the logical names ``axes``.

    Each logical name maps through ``rules`` to mesh axes. A dimension is
    split over the longest prefix of those mesh axes that divides its size and
    that no earlier dimension already uses; otherwise it is replicated. Mesh
    axes missing from ``mesh`` are ignored (so one rule set serves 1-D and 2-D
    meshes).
    """
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name, size in zip(axes, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no entry in the sharding rules")
        free = [a for a in _as_tuple(rules[name]) if a not in used]
        cand = [a for a in _divisor_prefix(free, size, mesh.shape) if mesh.shape[a] > 1]
        used.update(cand)
        spec.append(None if not cand else cand[0] if len(cand) == 1 else tuple(cand))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def tree_specs(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """PartitionSpec per leaf of ``tree`` (arrays or ShapeDtypeStructs), from LEAF_AXES + rules."""
    check_mesh_axes(mesh, rules)

    def one(path, leaf):
        shape = tuple(np.shape(leaf))
        return logical_to_spec(logical_axes(_leaf_name(path), len(shape)), shape, mesh, rules)

    return jax.tree_util.tree_map_with_path(one, tree)


def tree_shardings(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """NamedSharding per leaf of ``tree``: usable as jit in/out_shardings or for device_put."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_tree(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """``tree`` with every leaf placed on ``mesh`` per the rules (jax.device_put).

    Multi-host: every process passes the same global values (e.g. weights
    read from the same checkpoint); each keeps only its addressable shards.
    """
    return jax.device_put(tree, tree_shardings(tree, mesh, rules))


def shard_params(params: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Model params (``models.decoder`` layout): heads / MLP hidden / vocab over "model"."""
    return shard_tree(params, mesh, rules)


def shard_cache(cache: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """A DenseCache / PQCache / UniformCache / TurboQuantCache / KiviCache: every array by batch ("data") and KV
    head ("model").

    A PQ (or TurboQuant) cache also records how its codes are split (a ``KernelMesh`` in its layer state),
    so that decode steps run the Pallas kernel per shard under ``shard_map`` instead of
    gathering the cache (``million_jax.attention.pq_dispatch``).
    """
    if isinstance(cache, (PQCache, TurboQuantCache)):
        codes = cache.layers.k_codes  # [L, B, Hkv, T, M]
        spec = tuple(logical_to_spec(logical_axes("k_codes", 5), codes.shape, mesh, rules)) + (None,) * 5
        km = KernelMesh(mesh, batch_axes=_as_tuple(spec[1]), kv_axes=_as_tuple(spec[2]))
        cache = dataclasses.replace(cache, layers=dataclasses.replace(cache.layers, mesh=km))
    return shard_tree(cache, mesh, rules)


def shard_codebooks(codebooks: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """PQCodebooks: split with their KV heads at ``layer_head`` granularity, else replicated."""
    if codebooks is None:
        return None
    return shard_tree(codebooks, mesh, rules)


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a model input of ``shape`` whose leading axis is the batch (tokens [B, T], lengths [B])."""
    axes = ("batch",) + (None,) * (len(shape) - 1) if len(shape) else ()
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def shard_batch(inputs: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Every leaf of ``inputs`` (batch-leading arrays) split over the batch rule's mesh axes.

    Falls back to replication where the batch size does not divide. Multi-host
    with per-process data: use ``jax.make_array_from_process_local_data(
    batch_sharding(mesh, global_shape), local_x, global_shape)`` instead.
    """

    def one(x):
        x = x if isinstance(x, jax.Array) else np.asarray(x)
        return jax.device_put(x, batch_sharding(mesh, x.shape, rules))

    return jax.tree.map(one, inputs)


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on ``mesh`` (scalars, PRNG keys, small tables)."""
    return NamedSharding(mesh, PartitionSpec())


def abstract_tree(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """ShapeDtypeStructs carrying the rule shardings (for ``jit(...).lower`` without data).

    ``tree`` may hold arrays or ShapeDtypeStructs (e.g. from ``jax.eval_shape``),
    so a 7B-parameter program can be compiled and its memory measured
    without materialising a single weight.
    """
    shardings = tree_shardings(tree, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


# ------------------------------------------------------------------ jit helpers
def sharded_jit(
    fn: Callable[..., Any],
    mesh: Mesh,
    *,
    in_trees: Sequence[PyTree],
    out_tree: PyTree,
    donate_argnums: int | Sequence[int] = (),
    rules: Rules = DEFAULT_RULES,
) -> Callable[..., Any]:
    """``jax.jit(fn)`` with in/out shardings derived from the rules.

    in_trees: one example (arrays or ShapeDtypeStructs) per positional
    argument of ``fn``; leaves are looked up in LEAF_AXES by name, so pass
    params / caches / codebooks here, and ``None`` for token ids, PRNG keys
    and other inputs: their sharding is then taken from the argument itself
    (e.g. from :func:`shard_batch`). out_tree: a tuple with one entry per
    output of ``fn`` (``jax.eval_shape(fn, ...)``), ``None`` where the
    partitioner may choose; or a single tree / ``None``. Close over static
    arguments (the model config) in ``fn``.

    Example (a decode step that keeps and donates its cache)::

        step = lambda p, c, t, b: decode_step(config, p, c, t, b)
        out = jax.eval_shape(step, params, cache, tok, books)
        step = sharded_jit(step, mesh, in_trees=(params, cache, None, books),
                           out_tree=(None, out[1]), donate_argnums=1)
    """

    def shard_or_none(t):
        return None if t is None else tree_shardings(t, mesh, rules)

    in_sh = tuple(shard_or_none(t) for t in in_trees)
    out_sh = (tuple(shard_or_none(t) for t in out_tree) if isinstance(out_tree, tuple)
              else shard_or_none(out_tree))
    return jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate_argnums)


def assert_sharded_as(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Raise AssertionError unless every array leaf of ``tree`` has its rule sharding."""
    want = tree_shardings(tree, mesh, rules)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), sh in zip(leaves, jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, NamedSharding))):
        if not leaf.sharding.is_equivalent_to(sh, leaf.ndim):
            raise AssertionError(f"{jax.tree_util.keystr(path)}: sharded as {leaf.sharding}, "
                                 f"rules say {sh.spec}")


def describe_shardings(tree: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> str:
    """One line per leaf: path, global shape, PartitionSpec and per-device shard shape."""
    lines = []
    specs = tree_specs(tree, mesh, rules)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        shape = tuple(np.shape(leaf))
        local = NamedSharding(mesh, spec).shard_shape(shape)
        lines.append(f"{jax.tree_util.keystr(path):40s} {str(shape):28s} {str(spec):40s} -> {local}")
    return "\n".join(lines)

"""PQCodebooks: the key and value codebooks of a model, normalised once to their per-layer shape.

Codebooks are fitted at one of three granularities (one codebook per ...):

    shared       ... model (MILLION's choice)       fitted as [M, K, dsub]
    layer        ... layer                          fitted as [L, M, K, dsub]
    layer_head   ... layer and KV head              fitted as [L, Hkv, M, K, dsub]

Whatever the granularity, a ``PQCodebooks`` holds them as float32[L, G, M, K, dsub] with
G = Hkv (layer_head) or 1 (shared, layer), so the model scans them with its layers and every
attention path reads ``[G, M, K, dsub]`` per layer, without reshaping or re-checking per call.
``compact()`` gives back the fitted form (what a codebook file stores).

Keys and values may have their own budgets (M and nbits each; same granularity). Optional
per-layer transforms (:mod:`million_jax.quant.kv_transforms`), float32[L, Gt, d, d], Gt in {1, Hkv}:

    key_transform     A: keys are encoded as A k; query_transform = A^-T maps the query
    value_transform   B: values are encoded as B v; output_transform = B^-1 maps the output

Build them with :meth:`PQCodebooks.with_transforms` (the inverses are computed there, once).

``stages`` > 1: residual PQ (:mod:`million_jax.quant.residual_pq`); the S stages of keys (and of
values) are stored as one codebook of S * M sub-spaces, float32[L, G, S * M, K, d / M], and
``key_M`` / ``value_M`` count the codes of all stages (what the cache stores per token).

``rope_inv_freq`` d/2 floats, static (None: keys quantized after RoPE, MILLION's choice): the keys
were quantized *before* RoPE (:mod:`million_jax.rope`), in RoPE-pair layout, each sub-space made
of P = dsub / 2 whole pairs (``key_rope_pairs``; P = 1: one pair, key M = S * d/2; P = 2: pairs m
and m + d/4); attention rotates pair i of code row t by t * inv_freq[i].
Build them with :meth:`PQCodebooks.with_pre_rope_keys`. A key transform does not commute with
the rotation and is refused with pre-RoPE keys; residual stages do (the rotation is linear).

``key_norms`` / ``value_norms`` (static bools; norm-explicit PQ): the cache stores, beside each
token's codes, one float16 scale ``|x| / |x_hat|`` (the vector's norm over its reconstruction's, both
in the model's key / value space: after the inverse transform and the sum of the stages; RoPE
keeps norms), and every attention path multiplies the token's score (keys) or value by it, so
each reconstruction has the norm of the vector it codes. 16 more bits per token and head each.
float16, not bfloat16: the scale multiplies every score of its key, and bf16's 8-bit significand
(up to 0.4% off) moves scores of large keys by tenths of a logit; float16 rounds 8x finer in the
same 16 bits (a scale above its largest finite value, 65504, is clipped there).
``unit_codes`` (static; with norms): the codebooks were fitted on unit vectors and the cache
encodes x / |x| (the norm is all in the scale, the codes only carry the direction: NEQ, Dai et al.
2020); without it today's codebooks code x itself and the scale corrects the length.
Build them with :meth:`PQCodebooks.with_explicit_norms`.

``key_parts`` (static; None: every key code has ``key_nbits`` bits): key codes of several widths,
a layout ``((n_0, bits_0), (n_1, bits_1), ...)`` over the key sub-spaces in order
(:mod:`pallas_kernels.code_packing`, sum n_p = key_M): sub-space m of a part of b bits uses its
first 2**b centroids only; the key codebook holds K = 2**max(bits) rows, the rows past 2**b of a
narrower sub-space being copies of its centroid 0 (the encoder's argmin keeps the first of equal
distances, so they are never chosen). The cache stores each part at its own width, so a per-pair
allocation of key bits (:mod:`million_jax.calibration.pair_bits`) costs its mean width.
Build them with :meth:`PQCodebooks.with_key_parts`.

``key_pair_order`` (int32[L, G, d/2] or None; pre-RoPE keys, one RoPE pair per sub-space, one
stage): key sub-space s of head group g in layer l codes RoPE pair ``key_pair_order[l, g, s]``
(a permutation per row), so that each KV head can give its own pairs the widths of one shared
``key_parts`` layout (:func:`million_jax.calibration.pair_bits.allocate_key_bits`). The cache puts
each head's keys and queries in that order (:func:`million_jax.rope.order_pairs`) and attention
rotates sub-space s by the frequency of its pair (``key_subspace_freqs``, then per KV head).
Build them with :meth:`PQCodebooks.with_key_pair_order`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from million_jax import rope
from million_jax.quant.kv_transforms import check_transform, inverse, inverse_transpose
from million_jax.quant.pq import Codebooks
from million_jax.quant.residual_pq import check_stages
from pallas_kernels.code_packing import Parts, check_layout

__all__ = ["PQCodebooks", "GRANULARITIES", "NORM_SCALE_BITS", "NORM_SCALE_DTYPE", "check_pre_rope_keys", "per_layer_centroids", "unit_vectors"]

GRANULARITIES = ("shared", "layer", "layer_head")
NORM_SCALE_DTYPE = jnp.float16  # an explicit norm scale: one per token and head, in the cache (module doc)
NORM_SCALE_BITS = 8 * jnp.dtype(NORM_SCALE_DTYPE).itemsize


def unit_vectors(x):
    """float[..., d] / its norms in float32, 0 staying 0: what unit-code (NEQ) codebooks are fitted
    on and encode (``PQCodebooks.unit_codes``). numpy in, numpy out (calibration samples); else jnp."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = xp.asarray(x, xp.float32)
    n = xp.linalg.norm(x, axis=-1, keepdims=True)
    return x / xp.where(n > 0, n, 1.0)


def check_pre_rope_keys(head_dim: int, key_M: int, has_key_transform: bool) -> None:
    """ValueError unless keys of ``head_dim`` can be quantized before RoPE with ``key_M``
    sub-spaces per stage (whole RoPE pairs each: key_M divides head_dim / 2) and no key transform."""
    if has_key_transform:
        raise ValueError("a key transform (query-aware keys) does not commute with RoPE: it cannot be used "
                         "with keys quantized before RoPE (rope 'pre'); use rope 'post' or drop the transform")
    if key_M < 1 or head_dim % 2 or (head_dim // 2) % key_M:
        raise ValueError(f"pre-RoPE keys use sub-spaces of whole RoPE pairs: key M must divide head_dim / 2 = "
                         f"{head_dim // 2} per stage (M = {head_dim // 2}: one pair each, {head_dim // 4}: two), "
                         f"got {key_M}")


_GROUP_RANK = {"shared": 0, "layer": 1, "layer_head": 2}


def per_layer_centroids(c, granularity: str, num_layers: int | None) -> jax.Array:
    """Centroids in the fitted form of ``granularity`` (module docstring) -> float32[L, G, M, K, dsub]."""
    c = jnp.asarray(c, jnp.float32)
    rank = c.ndim - 3
    if rank != _GROUP_RANK[granularity]:
        raise ValueError(
            f"{granularity!r} codebooks must have {_GROUP_RANK[granularity]} group axes before "
            f"[M, K, dsub], got shape {tuple(c.shape)}"
        )
    if granularity == "shared":
        if num_layers is None:
            raise ValueError("shared codebooks need num_layers to be laid out per layer")
        return jnp.broadcast_to(c[None, None], (num_layers, 1) + c.shape)
    if granularity == "layer":
        c = c[:, None]
    if num_layers is not None and c.shape[0] != num_layers:
        raise ValueError(f"codebooks are for {c.shape[0]} layers, the model has {num_layers}")
    return c


_TRANSFORMS = ("key_transform", "query_transform", "value_transform", "output_transform")


def _is_orthogonal(t) -> bool:
    """Whether every matrix of the concrete t float[..., d, d] is orthogonal (to 1e-4)."""
    if isinstance(t, jax.core.Tracer):
        return False
    a = np.asarray(t, np.float64)
    return bool(np.allclose(a @ np.swapaxes(a, -1, -2), np.eye(a.shape[-1]), atol=1e-4))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key", "value", *_TRANSFORMS, "key_pair_order"],
                   meta_fields=["granularity", "stages", "rope_inv_freq", "key_norms", "value_norms",
                                "unit_codes", "key_parts"])
@dataclasses.dataclass(frozen=True)
class PQCodebooks:
    """key / value: Codebooks with centroids float32[L, G, S * M, K, dsub] ([G, S * M, K, dsub] per
    layer, S = ``stages``, 1 for plain PQ); the four transforms None or float32[L, Gt, d, d]
    ([Gt, d, d] per layer)."""

    key: Codebooks
    value: Codebooks
    granularity: str = "layer_head"
    key_transform: jax.Array | None = None
    query_transform: jax.Array | None = None
    value_transform: jax.Array | None = None
    output_transform: jax.Array | None = None
    stages: int = 1
    rope_inv_freq: tuple[float, ...] | None = None  # static: the model's d/2 RoPE frequencies
    key_norms: bool = False  # static: a per-token norm scale stored beside the key codes
    value_norms: bool = False  # ... and beside the value codes
    unit_codes: bool = False  # static: the sides with norms are encoded as unit vectors
    key_parts: Parts | None = None  # static: key codes of several widths (module docstring)
    key_pair_order: jax.Array | None = None  # int32[L, G, d/2]: the RoPE pair of each key sub-space

    @classmethod
    def from_centroids(cls, key, value, granularity: str = "layer_head", num_layers: int | None = None,
                       stages: int = 1) -> "PQCodebooks":
        """Codebooks in their fitted form (see the module docstring) -> the per-layer form.

        ``num_layers`` is required for ``shared`` codebooks and checked for the others;
        ``stages``: residual stages stacked along M (both key and value M must split into them).
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        k = per_layer_centroids(key, granularity, num_layers)
        v = per_layer_centroids(value, granularity, num_layers)
        if k.shape[:2] != v.shape[:2] or k.shape[2] * k.shape[4] != v.shape[2] * v.shape[4]:
            raise ValueError(f"key and value codebooks do not fit one model: {k.shape} vs {v.shape} "
                             "([L, G, M, K, dsub] with the same L, G and M * dsub)")
        for name, c in (("key", k), ("value", v)):
            try:
                check_stages(c.shape[2], stages)
            except ValueError as e:
                raise ValueError(f"{name} codebooks: {e}") from None
        books = cls(Codebooks(k), Codebooks(v), granularity, stages=int(stages))
        books.key.validate()
        books.value.validate()
        return books

    def with_transforms(self, key_transform=None, value_transform=None) -> "PQCodebooks":
        """These codebooks with key / value transforms float[L, Gt, d, d] (None: identity)."""
        kw = {}
        if key_transform is not None and self.rope_inv_freq is not None:
            check_pre_rope_keys(self.head_dim, self.key_M // self.stages, True)
        if key_transform is not None:
            a = check_transform(key_transform, self.num_layers, self.head_dim, "key_transform")
            kw.update(key_transform=a, query_transform=jnp.asarray(inverse_transpose(a)))
        if value_transform is not None:
            b = check_transform(value_transform, self.num_layers, self.head_dim, "value_transform")
            kw.update(value_transform=b, output_transform=jnp.asarray(inverse(b)))
        return dataclasses.replace(self, **kw)

    def with_pre_rope_keys(self, rope_inv_freq) -> "PQCodebooks":
        """These codebooks with keys marked as quantized before RoPE in RoPE-pair layout.

        rope_inv_freq: float[d/2], the model's frequencies (``million_jax.rope.rope_inv_freq``).
        The key sub-spaces must be whole RoPE pairs (dsub = 2P, ``million_jax.rope.to_pair_layout``
        with P pairs).
        """
        check_pre_rope_keys(self.head_dim, self.key_M // self.stages, self.key_transform is not None)
        inv = np.asarray(rope_inv_freq, np.float32)
        d = self.head_dim
        if inv.shape != (d // 2,) or not np.isfinite(inv).all() or (inv <= 0).any():
            raise ValueError(f"rope_inv_freq must be finite positive float[{d // 2}] (head_dim {d} / 2), "
                             f"got shape {list(inv.shape)}")
        return dataclasses.replace(self, rope_inv_freq=tuple(float(x) for x in inv))

    def with_explicit_norms(self, keys: bool = True, values: bool = True, unit: bool = False) -> "PQCodebooks":
        """These codebooks with (or without) a per-token norm scale stored beside the key / value
        codes (norm-explicit PQ, module docstring); ``unit``: they were fitted on unit vectors, so
        the sides with norms are encoded as x / |x|."""
        for name, x in (("keys", keys), ("values", values), ("unit", unit)):
            if not isinstance(x, (bool, np.bool_)):
                raise ValueError(f"with_explicit_norms: {name} must be a bool, got {x!r}")
        if unit and not (keys or values):
            raise ValueError("with_explicit_norms: unit codes need the norms stored (keys or values True)")
        return dataclasses.replace(self, key_norms=bool(keys), value_norms=bool(values), unit_codes=bool(unit))

    def with_key_parts(self, parts: Parts | None) -> "PQCodebooks":
        """These codebooks with key codes stored in the layout ``parts`` (module docstring; None: one
        width). ValueError unless the counts sum to key_M, the widest part is the codebook's
        key_nbits and each narrower sub-space's rows past 2**bits repeat its centroid 0."""
        if parts is None:
            return dataclasses.replace(self, key_parts=None)
        if self.stages != 1:
            raise ValueError(f"key_parts: codes of several widths are for one stage, these codebooks have {self.stages}")
        parts = check_layout(parts, self.key_M, self.key_nbits)
        c = np.asarray(self.key.centroids)  # [L, G, M, K, dsub]
        m0 = 0
        for n, b in parts:
            tail = c[:, :, m0:m0 + n, 2 ** b:]
            if tail.size and not np.array_equal(tail, np.broadcast_to(c[:, :, m0:m0 + n, :1], tail.shape)):
                raise ValueError(f"key_parts {parts}: sub-spaces {m0}..{m0 + n - 1} have {b}-bit codes but their "
                                 f"centroid rows past {2 ** b} are not copies of centroid 0 (pad them so)")
            m0 += n
        return dataclasses.replace(self, key_parts=parts)

    def with_key_pair_order(self, order) -> "PQCodebooks":
        """These codebooks with key sub-space s of head group g in layer l coding RoPE pair
        ``order[l, g, s]`` (module docstring; None: the natural order). ``order``: int[L, G, d/2],
        G the key codebooks' groups, every row a permutation of 0 .. d/2 - 1; the key centroids
        must already be in that order. Only for pre-RoPE keys with one pair per sub-space, one stage."""
        if order is None:
            return dataclasses.replace(self, key_pair_order=None)
        o = np.asarray(order)
        self._check_key_pair_order(o)
        return dataclasses.replace(self, key_pair_order=jnp.asarray(o, jnp.int32))

    def _check_key_pair_order(self, order) -> None:
        """ValueError unless ``order`` can be these codebooks' key_pair_order: pre-RoPE keys with one
        RoPE pair per sub-space and one stage; int[L, G, M] of the key codebooks' layers and groups,
        every row a permutation of the M RoPE pairs, the same in every layer for ``"shared"``
        codebooks (whose file keeps one layer's centroids). Values are checked only when the array
        is concrete."""
        if self.rope_inv_freq is None or self.key_rope_pairs != 1 or self.stages != 1:
            raise ValueError(f"key_pair_order is for pre-RoPE keys with one RoPE pair per sub-space and one stage, "
                             f"these codebooks are {self.recipe}")
        m = self.key_M
        want = tuple(self.key.centroids.shape[:2]) + (m,)
        shape, dtype = tuple(getattr(order, "shape", ())), getattr(order, "dtype", None)
        if shape != want or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"key_pair_order must be int[L, G, M] = {list(want)} (the key codebooks' layers, groups "
                             f"and sub-spaces), got {dtype}{list(shape)}")
        if isinstance(order, jax.core.Tracer):
            return
        o = np.asarray(order)
        bad = np.argwhere((np.sort(o, axis=-1) != np.arange(m)).any(-1))
        if bad.size:
            raise ValueError(f"key_pair_order[{bad[0][0]}, {bad[0][1]}] is not a permutation of the {m} RoPE pairs")
        if self.granularity == "shared" and (o != o[:1]).any():
            raise ValueError("key_pair_order differs between layers but the codebooks are 'shared' (one set for "
                             "every layer): use codebooks per layer or per layer and head")

    @property
    def key_code_bits(self) -> int:
        """Bits of one token's key codes (all stages): sum n * bits over ``key_parts``, else key_M * key_nbits."""
        if self.key_parts is None:
            return self.key_M * self.key_nbits
        return sum(n * b for n, b in self.key_parts)

    def check_rope(self, rope_inv_freq) -> None:
        """ValueError unless these codebooks can serve a model whose RoPE frequencies are
        ``rope_inv_freq`` float[d/2]: pre-RoPE keys are rotated inside attention by the
        frequencies recorded at calibration, so another rope_theta or scaling would rotate every
        key by the wrong angle. Post-RoPE codebooks carry no frequencies (nothing to check)."""
        if self.rope_inv_freq is None:
            return
        want = np.asarray(rope_inv_freq, np.float64)
        have = np.asarray(self.rope_inv_freq, np.float64)
        if want.shape != have.shape or not np.allclose(have, want, rtol=1e-6, atol=0.0):
            i = 0 if want.shape != have.shape else int(np.argmax(~np.isclose(have, want, rtol=1e-6, atol=0.0)))
            detail = (f"{have.size} vs {want.size} frequencies" if want.shape != have.shape
                      else f"pair {i}: {have[i]:.6g} vs the model's {want[i]:.6g}")
            raise ValueError("these codebooks quantized keys before RoPE with other RoPE frequencies than the "
                             f"model's ({detail}; rope_theta or rope scaling differ): calibrate them for this model")

    @property
    def key_rope_pairs(self) -> int:
        """RoPE pairs per key sub-space of pre-RoPE keys (dsub / 2; 1 for post-RoPE keys)."""
        return 1 if self.rope_inv_freq is None else self.key.dsub // 2

    @property
    def key_rope(self) -> str:
        """"pre" (keys quantized before RoPE, RoPE-pair sub-spaces) or "post" (MILLION's choice)."""
        return "post" if self.rope_inv_freq is None else "pre"

    def key_subspace_freqs(self) -> jax.Array | None:
        """float32[S * M, P]: the RoPE frequency of pair p of each key sub-space as attention reads
        the stacked stages (``million_jax.rope.subspace_freqs``; None for post-RoPE keys). With
        ``key_pair_order`` (one layer's, [G, M]): float32[G, M, 1], per head group."""
        if self.rope_inv_freq is None:
            return None
        if self.key_pair_order is not None:
            return rope.ordered_freqs(self.rope_inv_freq, self.key_pair_order)
        freqs = rope.subspace_freqs(self.rope_inv_freq, self.key_rope_pairs)
        return jnp.tile(jnp.asarray(freqs), (self.stages, 1))  # a constant under jit

    def compact(self) -> tuple[Codebooks, Codebooks]:
        """(key, value) in the fitted form of the granularity (what a codebook file holds)."""

        def cut(c):
            c = np.asarray(c)
            return c[0, 0] if self.granularity == "shared" else c[:, 0] if self.granularity == "layer" else c

        return Codebooks(cut(self.key.centroids)), Codebooks(cut(self.value.centroids))

    @property
    def key_M(self) -> int:
        return self.key.num_subspaces

    @property
    def value_M(self) -> int:
        return self.value.num_subspaces

    @property
    def key_nbits(self) -> int:
        return self.key.nbits

    @property
    def value_nbits(self) -> int:
        return self.value.nbits

    @property
    def same_budget(self) -> bool:
        """Whether keys and values use the same M and nbits."""
        return (self.key_M, self.key_nbits) == (self.value_M, self.value_nbits)

    @property
    def M(self) -> int:
        """The M of keys and values (ValueError when they differ: use key_M / value_M)."""
        if self.key_M != self.value_M:
            raise ValueError(f"keys and values have different M ({self.key_M}, {self.value_M}): use key_M / value_M")
        return self.key_M

    @property
    def nbits(self) -> int:
        """The nbits of keys and values (ValueError when they differ: use key_nbits / value_nbits)."""
        if self.key_nbits != self.value_nbits:
            raise ValueError(f"keys and values have different nbits ({self.key_nbits}, {self.value_nbits}): "
                             "use key_nbits / value_nbits")
        return self.key_nbits

    @property
    def bits_per_element(self) -> float:
        """Bits stored per key/value element, keys and values together: the codes, plus 16 per
        token and head for each explicit float16 norm scale."""
        norms = NORM_SCALE_BITS * (int(self.key_norms) + int(self.value_norms))
        return (self.key_code_bits + self.value_M * self.value_nbits + norms) / (2 * self.head_dim)

    @property
    def recipe(self) -> str:
        """A short name of the budget and transforms, e.g. ``K32x8 V16x8 qa`` (value transforms: ``vr``
        orthogonal, ``ow`` any other)."""
        keys = (f"K{self.key_M}x{self.key_nbits}" if self.key_parts is None
                else "K" + "+".join(f"{n}x{b}" for n, b in self.key_parts))
        name = f"{keys} V{self.value_M}x{self.value_nbits}"
        if self.key_transform is not None:
            name += " qa"
        if self.value_transform is not None:  # vr: a rotation (e.g. value_pca_transform), ow: output-aware
            name += " vr" if _is_orthogonal(self.value_transform) else " ow"
        if self.stages > 1:
            name += f" r{self.stages}"
        if self.rope_inv_freq is not None:
            name += " pre" + (f" g{self.key_rope_pairs}" if self.key_rope_pairs > 1 else "")
        if self.key_norms or self.value_norms:
            name += " n" + "k" * self.key_norms + "v" * self.value_norms + "u" * self.unit_codes
        if self.key_pair_order is not None:
            name += " po"
        return name

    @property
    def head_dim(self) -> int:
        return self.key.dim // self.stages

    @property
    def num_layers(self) -> int:
        return self.key.centroids.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct centroids (the fitted form; what a file or a device shard needs)."""
        layers = 1 if self.granularity == "shared" else self.num_layers
        total = 0
        for c in (self.key.centroids, self.value.centroids):  # [L, G, M, K, dsub]
            total += layers * int(np.prod(c.shape[1:])) * jnp.dtype(c.dtype).itemsize
        if self.rope_inv_freq is not None:
            total += 4 * len(self.rope_inv_freq)
        for name in ("key_transform", "value_transform", "key_pair_order"):  # stored; inverses derived on load
            t = getattr(self, name)
            if t is not None:
                total += int(np.prod(t.shape)) * jnp.dtype(t.dtype).itemsize
        return total

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> "PQCodebooks":
        """Raise a clear ValueError unless these codebooks fit the given model shape."""
        l, g = self.key.centroids.shape[:2]
        if l != num_layers:
            raise ValueError(f"codebooks are for {l} layers, the model has {num_layers}")
        if g not in (1, num_kv_heads):
            raise ValueError(f"codebooks have {g} head groups, the model has {num_kv_heads} KV heads")
        if self.head_dim != head_dim:
            raise ValueError(f"codebooks are for head_dim {self.head_dim}, the model has {head_dim}")
        for name in _TRANSFORMS:
            t = getattr(self, name)
            if t is not None and (t.shape[0] != l or t.shape[1] not in (1, num_kv_heads)
                                  or t.shape[2:] != (head_dim, head_dim)):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [L={l}, 1 or Hkv={num_kv_heads}, "
                                 f"{head_dim}, {head_dim}]")
        o = self.key_pair_order
        if o is not None:  # set by with_key_pair_order, unless replaced since (dataclasses.replace, a tree map)
            self._check_key_pair_order(o)
        return self

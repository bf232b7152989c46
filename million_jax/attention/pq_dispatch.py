"""The one place that decides whether attention over PQ codes (and TurboQuant codes, read by the
same kernel as PQ with one-dim sub-spaces: :func:`turboquant_code_attention`) runs the Pallas kernel.

    pq_code_attention(q, k_codes, v_codes, k_books, v_books, lo, hi, impl=..., mesh=...)

goes to the fused Pallas decode kernel (:func:`pallas_kernels.pq_decode_attention_planned`) when

* the call is a decode step (one query token per sequence: T == 1), and
* ``impl == "pallas"`` (interpret mode off GPU: tests), or ``impl == "auto"`` on a GPU, and
* the kernel takes the shapes and dtypes (uint8 codes, one per byte or packed at their real
  width; one M for keys and values; power-of-two d / M / dsub, ...:
  :func:`pallas_kernels.plan_pq_kernel`);

and otherwise to the pure-jnp tiled path (:func:`million_jax.attention.pq_xla.pq_attention_xla`).
``impl == "pallas"`` on a call the kernel cannot take is an error naming why.

The tests run cheapest first (:func:`kernel_plan`): the query length and the backend before
any shape, so ``impl="auto"`` off GPU never plans a launch. The launch is planned once per call
and handed to the kernel, which does not check or plan again. The codes' fit to their codebooks
is not checked here: the cache checks it once, where its constants are built
(:meth:`million_jax.cache.pq_cache.PQCache.layer_consts`); a user calling the kernel directly
goes through the checked :func:`pallas_kernels.pq_decode_attention`.

On a device mesh (``mesh``: a :class:`KernelMesh`, recorded in the cache by
``million_jax.sharding.shard_cache``) the kernel runs per shard under ``shard_map`` (planned
for one shard's shapes): batch over the mesh axes that split the cache's batch, KV heads (and
their GQA query heads and per-head codebooks) over those that split its KV heads, so a sharded
cache is never gathered. Caches call this module; they never import the kernel themselves.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from million_jax.attention.layer_slice import ArrayOrSlice, as_array
from million_jax.attention.pq_xla import check_code_fit, pq_attention_xla
from million_jax.attention.turboquant_xla import turboquant_attention_xla
from million_jax.quant.turboquant import Part, level_table
from pallas_kernels import KernelPlan, plan_pq_kernel, pq_decode_attention_planned, pq_dims
from pallas_kernels.code_packing import Parts
from pallas_kernels.pq_math import check_rope_inv_freq

__all__ = ["IMPLS", "KernelMesh", "check_impl", "kernel_plan", "pq_code_attention", "turboquant_code_attention"]

IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class KernelMesh:
    """How a PQ cache's codes are split over a mesh: codes [B, Hkv, T, M] sharded
    ``PartitionSpec(batch_axes, kv_axes)`` (empty tuples: not split along that dim)."""

    mesh: Mesh
    batch_axes: tuple[str, ...] = ()
    kv_axes: tuple[str, ...] = ()


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _spec(*axes: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*(a if a else None for a in axes))


def _in_specs(k_books, v_books, mesh: KernelMesh) -> tuple[PartitionSpec, ...]:
    """shard_map in_specs of (q, k_codes, v_codes, k_books, v_books, lo, hi)."""
    b, h = mesh.batch_axes, mesh.kv_axes
    books = lambda c: _spec(h) if c.shape[0] > 1 else _spec()  # noqa: E731
    return (_spec(b, h), _spec(b, h), _spec(b, h), books(k_books), books(v_books), _spec(b), _spec(b))


def _shard_shape(x, spec: PartitionSpec, mesh: KernelMesh) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one shard of ``x`` (arrays, LayerSlices or ShapeDtypeStructs)."""
    shape = list(x.shape)
    for dim, axes in enumerate(spec):
        for a in (axes,) if isinstance(axes, str) else axes or ():
            shape[dim] //= mesh.mesh.shape[a]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def kernel_plan(impl: str, q: jax.Array, k_codes, v_codes, k_books, v_books,
                mesh: KernelMesh | None = None, *, rope: bool = False, k_parts: Parts | None = None,
                v_parts: Parts | None = None, k_scales=None, v_scales=None) -> KernelPlan | None:
    """The kernel's launch for this call, or None for the xla path (see the module docstring).

    q float[B, T, H, d]; codes [B, Hkv, N, width] (arrays or LayerSlices); books
    float[G, M, K, dsub]. The kernel is a decode kernel (T == 1) and ``impl="auto"`` uses it on
    a GPU only: both are tested before any shape is looked at. The launch is then planned once,
    for one shard's shapes when ``mesh`` is given. ``impl="pallas"`` and a call the kernel
    cannot take: ValueError naming why. ``rope``: keys quantized before RoPE; ``k_parts`` /
    ``v_parts``: codes in a layout of several parts; ``k_scales`` / ``v_scales`` (shapes only):
    per-token scales come (:func:`pallas_kernels.pq_decode_attention`).
    """
    check_impl(impl)
    if impl == "xla" or q.shape[1] != 1 or (impl == "auto" and not _on_gpu()):
        return None
    q1 = jax.ShapeDtypeStruct((q.shape[0],) + tuple(q.shape[2:]), q.dtype)  # the kernel's q [B, H, d]
    if mesh is not None:
        args = (q1, k_codes, v_codes, k_books, v_books)
        q1, k_codes, v_codes, k_books, v_books = (
            _shard_shape(x, s, mesh) for x, s in zip(args, _in_specs(k_books, v_books, mesh)))
    try:
        dims = pq_dims(q1, k_codes, v_codes, k_books, v_books, k_parts=k_parts, v_parts=v_parts, k_scales=k_scales,
                       v_scales=v_scales)
        return plan_pq_kernel(dims, k_codes, v_codes, rope=rope)
    except ValueError as e:
        if impl == "pallas":
            raise ValueError(f"impl='pallas' cannot run: {e}") from None
        return None


def _kernel(plan: KernelPlan, q, k_codes, v_codes, k_books, v_books, lo, hi, mesh: KernelMesh | None,
            scale: float | None, rope_inv_freq: jax.Array | None = None, k_scales: jax.Array | None = None,
            v_scales: jax.Array | None = None):
    """(out f32[B, H, d], lse f32[B, H]) of the planned kernel, per shard when ``mesh`` is given.

    rope_inv_freq (pre-RoPE keys) is per key sub-space, so every shard gets all of it, or per KV
    head ([Hkv, M, P], split like the codebooks); the per-token scales [B, Hkv, N] are split like
    the codes."""
    base = functools.partial(pq_decode_attention_planned, plan, interpret=not _on_gpu(), scale=scale)
    extras = {name: x for name, x in (("rope_inv_freq", rope_inv_freq), ("k_scales", k_scales),
                                      ("v_scales", v_scales)) if x is not None}
    names = tuple(extras)

    def run(*a):
        return base(*a[:7], **dict(zip(names, a[7:])))

    args = (q, k_codes, v_codes, k_books, v_books, lo, hi) + tuple(extras.values())
    if mesh is None:
        return run(*args)
    b, h = mesh.batch_axes, mesh.kv_axes
    per_head = rope_inv_freq is not None and rope_inv_freq.ndim == 3 and rope_inv_freq.shape[0] > 1
    extra_specs = tuple((_spec(h) if per_head else _spec()) if n == "rope_inv_freq" else _spec(b, h) for n in names)
    sharded = jax.shard_map(
        run,
        mesh=mesh.mesh,
        in_specs=_in_specs(k_books, v_books, mesh) + extra_specs,
        out_specs=(_spec(b, h), _spec(b, h)),
        check_vma=False,
    )
    return sharded(*args)


def pq_code_attention(
    q: jax.Array,
    k_codes: ArrayOrSlice,
    v_codes: ArrayOrSlice,
    k_books: jax.Array,
    v_books: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    impl: str = "auto",
    mesh: KernelMesh | None = None,
    scale: float | None = None,
    rope_inv_freq: jax.Array | None = None,
    check_codes: bool = True,
    k_scales: ArrayOrSlice | None = None,
    v_scales: ArrayOrSlice | None = None,
    k_parts: Parts | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of q float[B, T, H, d] over codes uint[B, Hkv, N, M] for lo <= s < hi.

    k_codes / v_codes: arrays or :class:`~million_jax.attention.layer_slice.LayerSlice` views of a
    stacked cache (the xla path reads its tiles in place; the kernel gets the layer as an array).
    k_books / v_books: float[G, M, K, dsub], G in {1, Hkv}; lo, hi: int32[B, T]. The codes
    must fit their codebooks (width M, or M packed codes of log2 K bits): ValueError otherwise;
    ``check_codes=False`` skips that check for callers that made it once (the PQ cache, in
    ``layer_consts``).
    scale: score scale (default 1 / sqrt(d)).
    rope_inv_freq: float32[M] or [M, P] (per KV head [G, M, P]), or None: keys quantized before RoPE
      (sub-space m = P whole RoPE pairs, code row s = absolute position s;
      :func:`million_jax.attention.pq_xla.pq_attention_xla`).
    k_scales, v_scales: float[B, Hkv, N, 1] (arrays or LayerSlices) or None: per-token factors of
      each stored key's score / value (norm-explicit PQ); the kernel takes them as its per-token scales.
    k_parts: key codes of several widths in this layout (``PQCodebooks.key_parts``), or None.
    Returns (out f32[B, T, H, d], lse f32[B, T, H]), 0 / -inf for a query that sees nothing.
    """
    if check_codes:
        check_code_fit(q.shape[-1], k_codes, v_codes, k_books, v_books, k_parts)
    shapes = [None if x is None else jax.ShapeDtypeStruct(tuple(x.shape[:-1]), x.dtype) for x in (k_scales, v_scales)]
    plan = kernel_plan(impl, q, k_codes, v_codes, k_books, v_books, mesh, rope=rope_inv_freq is not None,
                       k_scales=shapes[0], v_scales=shapes[1], k_parts=k_parts)
    if plan is not None:
        if rope_inv_freq is not None:  # the kernel's planned entry does not check it (the xla path does)
            check_rope_inv_freq(rope_inv_freq, k_books.shape[1], k_books.shape[3], k_codes.shape[1])
        k_codes, v_codes = as_array(k_codes), as_array(v_codes)
        ks, vs = (None if x is None else as_array(x)[..., 0] for x in (k_scales, v_scales))
        out, lse = _kernel(plan, q[:, 0], k_codes, v_codes, k_books, v_books, lo[:, 0],
                           jnp.maximum(hi[:, 0], lo[:, 0]), mesh, scale, rope_inv_freq, k_scales=ks, v_scales=vs)
        return out[:, None], lse[:, None]
    return pq_attention_xla(q, k_codes, v_codes, k_books, v_books, lo, hi, scale=scale, rope_inv_freq=rope_inv_freq,
                            check_codes=False, k_scales=k_scales, v_scales=v_scales, k_parts=k_parts)


def turboquant_code_attention(
    qr: jax.Array,
    k_codes: ArrayOrSlice,
    k_norms: ArrayOrSlice,
    v_codes: ArrayOrSlice,
    v_norms: ArrayOrSlice,
    lo: jax.Array,
    hi: jax.Array,
    *,
    key_parts: tuple[Part, ...],
    value_parts: tuple[Part, ...],
    impl: str = "auto",
    mesh: KernelMesh | None = None,
    scale: float | None = None,
    qs: jax.Array | None = None,
    k_qjl: ArrayOrSlice | None = None,
    k_rnorms: ArrayOrSlice | None = None,
    tile: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Attention of the rotated query qr float[B, T, H, d] over TurboQuant codes, lo <= s < hi.

    The kernel reads TurboQuant codes as PQ: d one-dim sub-spaces whose codebooks are the
    Lloyd-Max levels (:func:`million_jax.quant.turboquant.level_table`, shared by every KV head),
    the packed parts as the codes' layout, each token's norm as its per-token scale. Decode steps
    go to it as PQ codes do (``impl``, ``mesh``: :func:`kernel_plan`); prefill, the QJL key
    residual (``qs``, ``k_qjl``, ``k_rnorms``: :func:`turboquant_attention_xla`, the kernel has no
    second key table) and ``impl="xla"`` take the pure-jnp path. Shapes as
    :func:`~million_jax.attention.turboquant_xla.turboquant_attention_xla`; returns (out f32[B, T, H, d]
    in rotated coordinates, lse f32[B, T, H]).
    """
    d = qr.shape[-1]
    if qs is not None and impl == "pallas" and qr.shape[1] == 1:
        raise ValueError("impl='pallas' cannot run: the QJL key residual is read on the xla path only")
    if qs is None:
        k_books = level_table(key_parts, d)[None, :, :, None]  # [1, d, K, 1]
        v_books = level_table(value_parts, d)[None, :, :, None]
        scales = [jax.ShapeDtypeStruct(tuple(x.shape[:-1]), x.dtype) for x in (k_norms, v_norms)]
        plan = kernel_plan(impl, qr, k_codes, v_codes, k_books, v_books, mesh, k_parts=tuple(key_parts),
                           v_parts=tuple(value_parts), k_scales=scales[0], v_scales=scales[1])
        if plan is not None:
            kc, vc, kn, vn = (as_array(x) for x in (k_codes, v_codes, k_norms, v_norms))
            out, lse = _kernel(plan, qr[:, 0], kc, vc, k_books, v_books, lo[:, 0], jnp.maximum(hi[:, 0], lo[:, 0]),
                               mesh, scale, k_scales=kn[..., 0], v_scales=vn[..., 0])
            return out[:, None], lse[:, None]
    return turboquant_attention_xla(qr, qs, k_codes, k_norms, k_qjl, k_rnorms, v_codes, v_norms, lo, hi,
                                    key_parts=key_parts, value_parts=value_parts, tile=tile, scale=scale)

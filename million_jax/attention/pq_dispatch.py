"""The one place that decides whether attention over PQ codes runs the Pallas kernel.

    pq_code_attention(q, k_codes, v_codes, k_books, v_books, lo, hi, impl=..., mesh=...)

goes to the fused Pallas decode kernel (:func:`pallas_kernels.pq_decode_attention`) when

* the call is a decode step (one query token per sequence: T == 1), and
* the kernel supports the shapes and dtypes (uint8 codes, one per byte or packed at their
  real width; power-of-two d / M / dsub, ...: :func:`pallas_kernels.pq_kernel_unsupported_reason`;
  not: keys and values with different M, :func:`dispatch_blocker`), and
* ``impl == "pallas"`` (interpret mode off GPU: tests), or ``impl == "auto"`` on a GPU;

and otherwise to the pure-jnp tiled path (:func:`million_jax.attention.pq_xla.pq_attention_xla`).
``impl == "pallas"`` on a call the kernel cannot take is an error naming why.

On a device mesh (``mesh``: a :class:`KernelMesh`, recorded in the cache by
``million_jax.sharding.shard_cache``) the kernel runs per shard under ``shard_map``: batch
over the mesh axes that split the cache's batch, KV heads (and their GQA query heads and
per-head codebooks) over those that split its KV heads, so a sharded cache is never gathered.
Caches call this module; they never import the kernel themselves.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from million_jax.attention.layer_slice import ArrayOrSlice, as_array
from million_jax.attention.pq_xla import pq_attention_xla
from pallas_kernels import pq_decode_attention, pq_kernel_unsupported_reason

__all__ = ["IMPLS", "KernelMesh", "check_impl", "dispatch_blocker", "pq_code_attention", "use_kernel"]

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


def dispatch_blocker(k_codes, v_codes, k_books, v_books) -> str | None:
    """Why the kernel cannot read these codes as stored (None: nothing here stops it).

    The kernel reads codes one per byte or packed at their real width, but takes one M for
    keys and values; different key / value M take the xla path, which handles both.
    """
    if k_books.shape[1] != v_books.shape[1]:
        return (f"keys and values have different M ({k_books.shape[1]} vs {v_books.shape[1]}); the kernel "
                "takes one M for both")
    return None


def use_kernel(impl: str, q: jax.Array, k_codes, v_codes, k_books, v_books, lo, hi,
               rope_inv_freq: jax.Array | None = None) -> bool:
    """Whether this call goes to the Pallas kernel (see the module docstring)."""
    check_impl(impl)
    if impl == "xla" or q.shape[1] != 1:
        return False  # the kernel is a decode kernel: prefill always takes the xla path
    blocker = dispatch_blocker(k_codes, v_codes, k_books, v_books) or pq_kernel_unsupported_reason(
        q[:, 0], k_codes, v_codes, k_books, v_books, lo[:, 0], hi[:, 0], rope_inv_freq=rope_inv_freq)
    if impl == "pallas" and blocker:
        raise ValueError(f"impl='pallas' cannot run: {blocker}")
    return blocker is None and (impl == "pallas" or _on_gpu())


def _spec(*axes: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*(a if a else None for a in axes))


def _kernel(q, k_codes, v_codes, k_books, v_books, lo, hi, mesh: KernelMesh | None, scale: float | None,
            rope_inv_freq: jax.Array | None = None):
    """(out f32[B, H, d], lse f32[B, H]) of the kernel, per shard when ``mesh`` is given.

    rope_inv_freq (pre-RoPE keys) is per key sub-space, so every shard gets all of it."""
    run = functools.partial(pq_decode_attention, interpret=not _on_gpu(), scale=scale)
    args = (q, k_codes, v_codes, k_books, v_books, lo, hi)
    if rope_inv_freq is not None:
        run = lambda *a, run=run: run(*a[:-1], rope_inv_freq=a[-1])  # noqa: E731
        args += (rope_inv_freq,)
    if mesh is None:
        return run(*args)
    b, h = mesh.batch_axes, mesh.kv_axes
    books = lambda c: _spec(h) if c.shape[0] > 1 else _spec()  # noqa: E731
    in_specs = (_spec(b, h), _spec(b, h), _spec(b, h), books(k_books), books(v_books), _spec(b), _spec(b))
    sharded = jax.shard_map(
        run,
        mesh=mesh.mesh,
        in_specs=in_specs + ((_spec(),) if rope_inv_freq is not None else ()),
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
) -> tuple[jax.Array, jax.Array]:
    """Attention of q float[B, T, H, d] over codes uint[B, Hkv, N, M] for lo <= s < hi.

    k_codes / v_codes: arrays or :class:`~million_jax.attention.layer_slice.LayerSlice` views of a
    stacked cache (the xla path reads its tiles in place; the kernel gets the layer as an array).
    k_books / v_books: float[G, M, K, dsub], G in {1, Hkv}; lo, hi: int32[B, T].
    scale: score scale (default 1 / sqrt(d)).
    rope_inv_freq: float32[M] or None: keys quantized before RoPE (sub-space m = RoPE pair m,
      code row s = absolute position s; :func:`million_jax.attention.pq_xla.pq_attention_xla`).
    Returns (out f32[B, T, H, d], lse f32[B, T, H]), 0 / -inf for a query that sees nothing.
    """
    if use_kernel(impl, q, k_codes, v_codes, k_books, v_books, lo, hi, rope_inv_freq):
        k_codes, v_codes = as_array(k_codes), as_array(v_codes)
        out, lse = _kernel(q[:, 0], k_codes, v_codes, k_books, v_books, lo[:, 0],
                           jnp.maximum(hi[:, 0], lo[:, 0]), mesh, scale, rope_inv_freq)
        return out[:, None], lse[:, None]
    return pq_attention_xla(q, k_codes, v_codes, k_books, v_books, lo, hi, scale=scale, rope_inv_freq=rope_inv_freq)

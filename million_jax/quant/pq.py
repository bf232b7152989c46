"""Product quantization: fit codebooks, encode, decode, bit accounting.

A vector x of dimension d is split into M contiguous sub-vectors of
``dsub = d // M`` dims; sub-vector m is replaced by the index of its nearest
centroid in codebook m (K = 2**nbits centroids). Codebooks carry arbitrary
leading "group" axes (e.g. [L, Hkv] for per-layer-per-head codebooks):

    centroids: float32[*G, M, K, dsub]
    x:         float[*G, N, d]      ->  codes: uint8|uint16[*G, N, M]

Leading axes of x and codes broadcast against the group axes of the codebook
(a shared codebook has G = ()).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from million_jax.quant.kmeans import assign, batched_chunk, kmeans
from pallas_kernels.pq_math import gather_centroids

MIN_NBITS = 1
MAX_NBITS = 12


def code_dtype(nbits: int) -> jnp.dtype:
    """The narrowest unsigned integer dtype that holds codes of ``nbits`` bits."""
    check_nbits(nbits)
    return jnp.dtype(jnp.uint8) if nbits <= 8 else jnp.dtype(jnp.uint16)


def check_nbits(nbits: int) -> None:
    if nbits is None:
        raise ValueError(f"nbits not given: choose an int in [{MIN_NBITS}, {MAX_NBITS}]")
    if not isinstance(nbits, (int, np.integer)) or not MIN_NBITS <= nbits <= MAX_NBITS:
        raise ValueError(f"nbits must be an int in [{MIN_NBITS}, {MAX_NBITS}], got {nbits!r}")


def check_subspaces(d: int, M: int) -> None:
    if not isinstance(M, (int, np.integer)) or M < 1:
        raise ValueError(f"M (number of subspaces) must be a positive int, got {M!r}")
    if d % M:
        raise ValueError(f"head dim d={d} is not divisible by M={M} subspaces")


def bits_per_element(d: int, M: int, nbits: int) -> float:
    """Bits of information per vector element: M codes of nbits bits for d elements.

    What a cache really stores per element is its ``bits_per_element`` (``PQCache`` packs codes
    at their real width, ``pallas_kernels.code_packing.stored_width``, so the two differ only
    when M * nbits is not a whole number of bytes, or for unpacked codes).
    """
    check_subspaces(d, M)
    check_nbits(nbits)
    return M * nbits / d


@functools.partial(jax.tree_util.register_dataclass, data_fields=["centroids"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Codebooks:
    """PQ codebooks. centroids: float32[*G, M, K, dsub]."""

    centroids: jax.Array

    @property
    def num_subspaces(self) -> int:
        return self.centroids.shape[-3]

    @property
    def num_centroids(self) -> int:
        return self.centroids.shape[-2]

    @property
    def nbits(self) -> int:
        return int(self.num_centroids).bit_length() - 1

    @property
    def dsub(self) -> int:
        return self.centroids.shape[-1]

    @property
    def dim(self) -> int:
        return self.num_subspaces * self.dsub

    @property
    def group_shape(self) -> tuple[int, ...]:
        return tuple(self.centroids.shape[:-3])

    @property
    def code_dtype(self) -> jnp.dtype:
        return code_dtype(self.nbits)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.centroids.shape)) * self.centroids.dtype.itemsize

    def validate(self) -> "Codebooks":
        c = self.centroids
        if c.ndim < 3:
            raise ValueError(f"codebook centroids must be [*G, M, K, dsub], got shape {c.shape}")
        k = c.shape[-2]
        if k < 2 or k & (k - 1):
            raise ValueError(f"codebook size K={k} is not a power of two >= 2")
        check_nbits(self.nbits)
        if not jnp.issubdtype(c.dtype, jnp.floating):
            raise ValueError(f"codebook centroids must be floating point, got {c.dtype}")
        return self


def _split(x: jax.Array, M: int) -> jax.Array:
    """float[..., N, d] -> float[..., M, N, dsub]."""
    *lead, n, d = x.shape
    return jnp.moveaxis(x.reshape(*lead, n, M, d // M), -2, -3)


def fit_codebooks(x: jax.Array, M: int, nbits: int, *, key: jax.Array, weights: jax.Array | None = None,
                  **kmeans_options: Any) -> Codebooks:
    """Fit one PQ codebook per leading group of ``x``.

    x: float[*G, N, d] -> Codebooks with centroids float32[*G, M, 2**nbits, d // M].
    All G * M k-means problems are fitted at once (one jitted, vmapped program).
    weights: optional float[*G, N]. ``kmeans_options`` go to :func:`million_jax.quant.kmeans.kmeans`
    (iters, tol, chunk_size, init_sample).
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"fit_codebooks: x must be [..., N, d], got shape {x.shape}")
    check_nbits(nbits)
    check_subspaces(x.shape[-1], M)
    k = 2**nbits
    if x.shape[-2] < k:
        raise ValueError(
            f"fit_codebooks: {x.shape[-2]} vectors per group is fewer than the "
            f"K=2**{nbits}={k} centroids; calibrate on more tokens or use fewer bits"
        )
    xs = _split(x, M)  # [*G, M, N, dsub]
    w = None
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != x.shape[:-1]:
            raise ValueError(f"fit_codebooks: weights must have shape {x.shape[:-1]}, got {weights.shape}")
        w = jnp.broadcast_to(weights[..., None, :], xs.shape[:-1])
    res = kmeans(xs, k, key=key, weights=w, **kmeans_options)
    return Codebooks(centroids=res.centroids)


def _check_codebook_input(cb: Codebooks, x_dim: int, what: str) -> None:
    if x_dim != cb.dim:
        raise ValueError(
            f"{what}: vector dim {x_dim} does not match the codebook "
            f"(M={cb.num_subspaces} x dsub={cb.dsub} = {cb.dim})"
        )


def _check_groups(cb: Codebooks, lead: tuple[int, ...], what: str, name: str) -> None:
    """ValueError unless the leading axes ``lead`` of x/codes broadcast with the groups."""
    try:
        np.broadcast_shapes(lead, cb.group_shape)
    except ValueError:
        raise ValueError(
            f"{what}: {name} leading axes {lead} do not broadcast against the codebook's "
            f"group axes {cb.group_shape} (centroids {tuple(cb.centroids.shape)})"
        ) from None


def _concrete(a: jax.Array) -> bool:
    """Whether ``a`` holds values this host can read (not a tracer, not spread over hosts)."""
    return not isinstance(a, jax.core.Tracer) and getattr(a, "is_fully_addressable", True)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _encode(centroids: jax.Array, x: jax.Array, chunk_size: int) -> jax.Array:
    M, K, dsub = centroids.shape[-3:]
    xs = _split(x.astype(jnp.float32), M)  # [*lead, M, N, dsub]
    lead = jnp.broadcast_shapes(xs.shape[:-3], centroids.shape[:-3])
    xs = jnp.broadcast_to(xs, lead + xs.shape[-3:])
    c = jnp.broadcast_to(centroids, lead + centroids.shape[-3:])
    chunk = batched_chunk(chunk_size, math.prod(lead) * M, K)
    # vmapped over every lead axis and M, never flattened: merging a device-sharded axis (the KV
    # heads of a sharded cache) into one batch axis made the partitioner all-gather the codebooks
    find = lambda a, b: assign(a, b.astype(jnp.float32), chunk)[0]  # noqa: E731
    for _ in range(len(lead) + 1):
        find = jax.vmap(find)
    idx = find(xs, c)  # [*lead, M, n]
    return jnp.swapaxes(idx, -1, -2).astype(code_dtype(int(K).bit_length() - 1))


def encode(codebooks: Codebooks, x: jax.Array, *, chunk_size: int = 16384) -> jax.Array:
    """Nearest centroid per subspace.

    x: float[*G', N, d] (broadcasting against the codebook's group axes) ->
    codes uint8 (nbits <= 8) or uint16 [*broadcast(G', G), N, M].
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"encode: x must be [..., N, d], got shape {x.shape}")
    _check_codebook_input(codebooks, x.shape[-1], "encode")
    _check_groups(codebooks, x.shape[:-2], "encode", "x")
    return _encode(codebooks.centroids, x, chunk_size)


def encode_parts(codebooks: Codebooks, x: jax.Array, parts: tuple[tuple[int, int], ...], *,
                 chunk_size: int = 16384) -> jax.Array:
    """:func:`encode` for codes of several widths: sub-spaces of the run (n, bits) of ``parts`` search
    only their first 2**bits centroids (``PQCodebooks.key_parts``; the rest are padding). The same
    codes as :func:`encode` on codebooks padded with copies of centroid 0, with less work.

    x: float[*G', N, d] -> codes [*broadcast(G', G), N, M], the dtype of the widest part."""
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"encode_parts: x must be [..., N, d], got shape {x.shape}")
    _check_codebook_input(codebooks, x.shape[-1], "encode_parts")
    _check_groups(codebooks, x.shape[:-2], "encode_parts", "x")
    if sum(n for n, _ in parts) != codebooks.num_subspaces or max(b for _, b in parts) > codebooks.nbits:
        raise ValueError(f"encode_parts: parts {parts} do not fit M={codebooks.num_subspaces} sub-spaces of "
                         f"{codebooks.nbits}-bit codebooks")
    c, ds = codebooks.centroids, codebooks.dsub
    out, m0 = [], 0
    for n, b in parts:
        out.append(_encode(c[..., m0:m0 + n, :2 ** b, :], x[..., m0 * ds:(m0 + n) * ds], chunk_size))
        m0 += n
    dtype = code_dtype(max(b for _, b in parts))
    return jnp.concatenate([o.astype(dtype) for o in out], axis=-1)


def decode(codebooks: Codebooks, codes: jax.Array) -> jax.Array:
    """codes uint[*G', N, M] -> float32[*broadcast(G', G), N, d].

    Codes outside [0, K) are a ValueError when their values are known (outside jit).
    """
    codes = jnp.asarray(codes)
    if codes.ndim < 2 or codes.shape[-1] != codebooks.num_subspaces:
        raise ValueError(
            f"decode: codes must be [..., N, M={codebooks.num_subspaces}], got shape {codes.shape}"
        )
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"decode: codes must be integers, got {codes.dtype}")
    _check_groups(codebooks, codes.shape[:-2], "decode", "codes")
    k = codebooks.num_centroids
    if _concrete(codes) and codes.size:
        lo, hi = int(jnp.min(codes)), int(jnp.max(codes))
        if lo < 0 or hi >= k:
            raise ValueError(f"decode: codes must be in [0, {k}) for K={k} centroids, got values "
                             f"in [{lo}, {hi}]")
    return gather_centroids(codebooks.centroids, codes)


def reconstruction_mse(codebooks: Codebooks, x: jax.Array) -> jax.Array:
    """Mean squared error of encode->decode over all elements of x."""
    xhat = decode(codebooks, encode(codebooks, x))
    return jnp.mean((jnp.asarray(x, jnp.float32) - xhat) ** 2)

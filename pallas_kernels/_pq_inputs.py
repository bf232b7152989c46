"""Shape / dtype validation shared by the PQ decode-attention kernel and its reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PQDims", "check_pq_inputs", "is_power_of_two"]

_CODE_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class PQDims:
    """Static sizes of one PQ decode-attention call."""

    batch: int  # B
    num_heads: int  # H (query heads)
    num_kv_heads: int  # Hkv
    group: int  # H // Hkv: query heads per KV head
    head_dim: int  # d
    seq_len: int  # T (code array length, >= every end[b] that matters)
    num_subspaces: int  # M
    sub_dim: int  # dsub = d // M
    k_centroids: int  # K of the key codebook
    v_centroids: int  # K of the value codebook
    k_groups: int  # G of the key codebook (1 = shared by all KV heads, or Hkv)
    v_groups: int  # G of the value codebook


def _shape_dtype(x: object, name: str) -> tuple[tuple[int, ...], np.dtype]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape), np.dtype(x.dtype)  # type: ignore[attr-defined]


def check_pq_inputs(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
) -> PQDims:
    """Validates the public inputs and returns their sizes; raises ValueError naming the problem.

    Expected: q float[B, H, d]; k_codes, v_codes uint8|uint16[B, Hkv, T, M] (same shape and
    dtype); k_codebooks, v_codebooks float[G, M, K, dsub] with G in {1, Hkv}, M * dsub = d,
    K <= 2**(8 * code itemsize); start, end integer[B]; H a multiple of Hkv.
    """
    q_shape, q_dtype = _shape_dtype(q, "q")
    kc_shape, kc_dtype = _shape_dtype(k_codes, "k_codes")
    vc_shape, vc_dtype = _shape_dtype(v_codes, "v_codes")
    kb_shape, kb_dtype = _shape_dtype(k_codebooks, "k_codebooks")
    vb_shape, vb_dtype = _shape_dtype(v_codebooks, "v_codebooks")
    s_shape, s_dtype = _shape_dtype(start, "start")
    e_shape, e_dtype = _shape_dtype(end, "end")

    if len(q_shape) != 3:
        raise ValueError(f"q must be float[B, H, d], got shape {q_shape}")
    if not jnp.issubdtype(q_dtype, jnp.floating):
        raise ValueError(f"q must be a float array, got dtype {q_dtype}")
    batch, num_heads, head_dim = q_shape

    if len(kc_shape) != 4:
        raise ValueError(f"k_codes must be uint8[B, Hkv, T, M], got shape {kc_shape}")
    if vc_shape != kc_shape:
        raise ValueError(f"v_codes shape {vc_shape} must equal k_codes shape {kc_shape}")
    for name, dt in (("k_codes", kc_dtype), ("v_codes", vc_dtype)):
        if dt not in _CODE_DTYPES:
            raise ValueError(f"{name} must be uint8 or uint16 codes, got dtype {dt}")
    if kc_dtype != vc_dtype:
        raise ValueError(f"k_codes dtype {kc_dtype} differs from v_codes dtype {vc_dtype}")
    c_batch, num_kv_heads, seq_len, num_subspaces = kc_shape
    if c_batch != batch:
        raise ValueError(f"codes batch {c_batch} != q batch {batch} (q {q_shape}, codes {kc_shape})")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads H={num_heads} must be a multiple of the codes' KV heads Hkv={num_kv_heads}"
        )
    if num_subspaces < 1 or head_dim % num_subspaces:
        raise ValueError(f"head_dim d={head_dim} must be a multiple of the codes' M={num_subspaces}")
    sub_dim = head_dim // num_subspaces

    max_k = 1 << (8 * kc_dtype.itemsize)
    centroids = []
    groups = []
    for name, shape, dt in (("k_codebooks", kb_shape, kb_dtype), ("v_codebooks", vb_shape, vb_dtype)):
        if len(shape) != 4:
            raise ValueError(f"{name} must be float[G, M, K, dsub], got shape {shape}")
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {dt}")
        g, m, k, ds = shape
        if g not in (1, num_kv_heads):
            raise ValueError(f"{name} G={g} must be 1 (shared) or Hkv={num_kv_heads} (per KV head)")
        if (m, ds) != (num_subspaces, sub_dim):
            raise ValueError(
                f"{name} shape {shape}: expected M={num_subspaces} and dsub=d/M={sub_dim}"
                f" (codes M, q head_dim {head_dim})"
            )
        if not 1 <= k <= max_k:
            raise ValueError(f"{name} K={k} does not fit {kc_dtype} codes (1 <= K <= {max_k})")
        centroids.append(k)
        groups.append(g)

    for name, shape, dt in (("start", s_shape, s_dtype), ("end", e_shape, e_dtype)):
        if shape != (batch,):
            raise ValueError(f"{name} must be int32[B={batch}], got shape {shape}")
        if not jnp.issubdtype(dt, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {dt}")

    return PQDims(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        seq_len=seq_len,
        num_subspaces=num_subspaces,
        sub_dim=sub_dim,
        k_centroids=centroids[0],
        v_centroids=centroids[1],
        k_groups=groups[0],
        v_groups=groups[1],
    )

"""Sizes of a PQ decode-attention call, and the validation of its public inputs.

``check_pq_inputs`` validates what a user passes to the kernel or its reference (every shape,
dtype and codes-vs-codebook fit) and returns the sizes; ``pq_dims`` only reads the sizes, for
callers whose inputs were checked where they were built (the PQ cache checks its codes
against its codebooks once, in ``layer_consts``; the dispatcher then plans from ``pq_dims``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.code_packing import Parts, check_layout_codes, check_parts, codebook_nbits, is_packed

__all__ = ["PQDims", "check_pq_inputs", "is_power_of_two", "pq_dims"]

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
    k_packed_bits: int = 0  # > 0: key codes packed at that many bits (pallas_kernels.code_packing)
    v_packed_bits: int = 0  # > 0: value codes packed alike
    k_parts: Parts | None = None  # key codes in a layout of several parts (code_packing.Parts)
    v_parts: Parts | None = None  # value codes alike
    k_scaled: bool = False  # a per-token key scale multiplies each score (k_scales [B, Hkv, T])
    v_scaled: bool = False  # a per-token value scale multiplies each value (v_scales [B, Hkv, T])

    def layout(self, which: str) -> Parts | None:
        """The code layout of "k" or "v": its parts, ((M, nbits),) for packed codes, None for one
        code per uint8."""
        parts, bits = (self.k_parts, self.k_packed_bits) if which == "k" else (self.v_parts, self.v_packed_bits)
        if parts is not None:
            return parts
        return ((self.num_subspaces, bits),) if bits else None


def _shape_dtype(x: object, name: str) -> tuple[tuple[int, ...], np.dtype]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape), np.dtype(x.dtype)  # type: ignore[attr-defined]


def pq_dims(q, k_codes, v_codes, k_codebooks, v_codebooks, *, k_parts: Parts | None = None,
            v_parts: Parts | None = None, k_scales=None, v_scales=None) -> PQDims:
    """The sizes of q float[B, H, d] over codes [B, Hkv, T, width] with codebooks [G, M, K, dsub].

    Reads shapes only (arrays or ShapeDtypeStructs) and checks nothing but what ``PQDims``
    cannot hold: keys and values with different M (ValueError). The fit of the codes to their
    codebooks is the caller's: :func:`check_pq_inputs`, or the cache that built them. Codes
    whose width is not M are read as packed at log2 K bits (:mod:`pallas_kernels.code_packing`),
    unless ``k_parts`` / ``v_parts`` give their layout of several parts. ``k_scales`` /
    ``v_scales`` (arrays, ShapeDtypeStructs or None) only say whether per-token scales come.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, seq_len = k_codes.shape[1:3]
    (kg, km, kk, _), (vg, vm, vk, _) = k_codebooks.shape, v_codebooks.shape
    if km != vm:
        raise ValueError(f"keys and values have different M ({km} vs {vm}); the PQ kernel and its reference "
                         "take one M for both")
    packed = lambda codes, k: codebook_nbits(k) if codes.shape[-1] != km else 0  # noqa: E731
    return PQDims(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        seq_len=seq_len,
        num_subspaces=km,
        sub_dim=head_dim // km,
        k_centroids=kk,
        v_centroids=vk,
        k_groups=kg,
        v_groups=vg,
        k_packed_bits=packed(k_codes, kk) if k_parts is None else 0,
        v_packed_bits=packed(v_codes, vk) if v_parts is None else 0,
        k_parts=None if k_parts is None else check_parts(k_parts),
        v_parts=None if v_parts is None else check_parts(v_parts),
        k_scaled=k_scales is not None,
        v_scaled=v_scales is not None,
    )


def check_pq_inputs(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    k_parts: Parts | None = None, v_parts: Parts | None = None, k_scales=None, v_scales=None,
) -> PQDims:
    """Validates the public inputs and returns their sizes; raises ValueError naming the problem.

    Expected: q float[B, H, d]; k_codes, v_codes uint8|uint16[B, Hkv, T, M], or packed
    uint8[B, Hkv, T, ceil(M * nbits / 8)] (nbits = log2 K of their codebook; keys and values
    each either way); k_codebooks, v_codebooks float[G, M, K, dsub] with G in {1, Hkv},
    M * dsub = d (one M for both), K <= 2**(code bits); start, end integer[B]; H a multiple of Hkv.
    Optional: ``k_parts`` / ``v_parts`` (code_packing.Parts, counts summing to M): the codes are
    uint8[..., parts_width(parts)] in that layout and K >= 2**(widest part's bits); ``k_scales`` /
    ``v_scales`` float[B, Hkv, T], a per-token factor of each key (score) / value.
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
    if len(vc_shape) != 4 or vc_shape[:3] != kc_shape[:3]:
        raise ValueError(f"v_codes shape {vc_shape} must equal k_codes shape {kc_shape} in [B, Hkv, T]")
    for name, dt in (("k_codes", kc_dtype), ("v_codes", vc_dtype)):
        if dt not in _CODE_DTYPES:
            raise ValueError(f"{name} must be uint8 or uint16 codes, got dtype {dt}")
    c_batch, num_kv_heads, seq_len = kc_shape[:3]
    if c_batch != batch:
        raise ValueError(f"codes batch {c_batch} != q batch {batch} (q {q_shape}, codes {kc_shape})")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads H={num_heads} must be a multiple of the codes' KV heads Hkv={num_kv_heads}"
        )

    for name, shape, dt, codes_name, c_shape, c_dtype in (
        ("k_codebooks", kb_shape, kb_dtype, "k_codes", kc_shape, kc_dtype),
        ("v_codebooks", vb_shape, vb_dtype, "v_codes", vc_shape, vc_dtype),
    ):
        if len(shape) != 4:
            raise ValueError(f"{name} must be float[G, M, K, dsub], got shape {shape}")
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {dt}")
        g, m, k, ds = shape
        if g not in (1, num_kv_heads):
            raise ValueError(f"{name} G={g} must be 1 (shared) or Hkv={num_kv_heads} (per KV head)")
        if m * ds != head_dim:
            raise ValueError(f"{name} shape {shape}: M * dsub must be the q head_dim {head_dim}")
        nbits = codebook_nbits(k)
        width = c_shape[3]
        parts = k_parts if name == "k_codebooks" else v_parts
        if parts is not None:
            _check_parts_fit(name, parts, m, k, codes_name, width, c_dtype)
            continue
        try:
            is_packed_codes = is_packed(width, m, nbits)
        except ValueError as e:
            raise ValueError(f"{name} shape {shape} does not fit {codes_name} [..., {width}]: {e}") from None
        if is_packed_codes and c_dtype != np.uint8:
            raise ValueError(f"packed {codes_name} must be uint8, got dtype {c_dtype}")
        max_k = 1 << (8 * c_dtype.itemsize) if not is_packed_codes else 1 << nbits
        if not 1 <= k <= max_k:
            raise ValueError(f"{name} K={k} does not fit {c_dtype} codes (1 <= K <= {max_k})")

    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x is None:
            continue
        shape, dt = _shape_dtype(x, name)
        if shape != (batch, num_kv_heads, seq_len):
            raise ValueError(f"{name} must be float[B, Hkv, T] = [{batch}, {num_kv_heads}, {seq_len}], got shape {shape}")
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {dt}")

    for name, shape, dt in (("start", s_shape, s_dtype), ("end", e_shape, e_dtype)):
        if shape != (batch,):
            raise ValueError(f"{name} must be int32[B={batch}], got shape {shape}")
        if not jnp.issubdtype(dt, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {dt}")

    # raises for keys / values of different M
    return pq_dims(q, k_codes, v_codes, k_codebooks, v_codebooks, k_parts=k_parts, v_parts=v_parts,
                   k_scales=k_scales, v_scales=v_scales)


def _check_parts_fit(name: str, parts: Parts, m: int, k: int, codes_name: str, width: int, dtype: np.dtype) -> None:
    """ValueError unless codes [..., width] of ``dtype`` hold M codes in the layout ``parts``."""
    parts = check_layout_codes(parts, m, width, dtype, codes_name, name)
    widest = max(b for _, b in parts)
    if k < 1 << widest:
        raise ValueError(f"{name} K={k} is smaller than the {1 << widest} codes a {widest}-bit part can name")

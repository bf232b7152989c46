"""Fused LUT-and-gather split-K decode attention over product-quantised (PQ) KV codes.

One decode query per sequence attends to a KV cache stored as PQ codes: each key / value
head vector (head_dim d) is M sub-vectors of dsub = d / M dims, each stored as the index of
its nearest centroid among K = 2**nbits in that subspace's codebook. For query head h of
KV head g = h // group:

    LUT[m, j] = q_m . Ck_m[j]                         (q_m: sub-vector m of q)
    score_t   = scale * sum_m LUT[m, ck_tm]           (= scale * q . dequant(k_t))
    out       = sum_t softmax(score)_t * concat_m Cv_m[cv_tm]
    lse       = log sum_t exp(score_t)                 (natural log)

over the tokens start[b] <= t < end[b]. The file holds the Pallas kernel (GPU, Triton
backend; `interpret=True` runs it anywhere) and its pure-jnp reference.

Kernel design (grid = (B, Hkv, num_splits)):
  * one program per (sequence, KV head, split of the token range); all query heads of the
    GQA group are the rows of one [block_h, d] tile (block_h = group padded to a power of
    two >= 16, the minimum M of `tl.dot`; padded rows are zero queries, never stored);
  * the split's tokens [lo, hi) are walked in tiles of block_t with an online softmax, fp32
    accumulators; the token range of each sequence is split evenly (ragged batches give
    every split of a row the same work);
  * keys, key_path="centroid" (default): the key centroids are gathered by integer-array
    indexing of the codebook ref, `cb_ref[m, codes[t, m], s]` (lowered to pointer loads),
    and scored with one [block_h, d] x [d, block_t] dot. This is the LUT sum evaluated
    lazily: sum_m LUT[m, c_m] = sum_m q_m . Ck_m[c_m] = q . k_hat. Unlike a materialised
    LUT it needs M (not group * M) lookups per token, from a table shared by every program
    of the KV head (G = Hkv) or of the whole grid (G = 1) that stays resident in L1/L2.
  * keys, key_path="lut" (MILLION's formulation): LUT[h, m, j] is built once per call (a
    small einsum, fp32) and the kernel sums LUT entries gathered by the key codes,
    `lut_ref[h, m, codes[t, m]]`. Pallas' Triton backend has no scratch memory for a
    per-program LUT, so building it in the kernel would mean a global-memory scratch per
    split; the einsum is the cheap form of the same step.
  * packed codes (nbits other than 8 stored at their real width, `code_packing`): each
    code's one to three bytes are read by pointer loads (`codes_ref[rows, byte_m + j]`) and
    shifted / masked in registers (`code_packing.assemble_codes`, the same arithmetic as the
    jnp unpack), so the kernel reads exactly the stored bytes and no unpacked copy exists;
  * values: value centroids gathered the same way by the value codes and weighted by the
    probabilities with a [block_h, block_t] x [block_t, d] dot;
  * every program writes a partial (out, lse) for its split (empty split: out 0, lse -inf);
    a second step (plain jnp, `softmax.merge_stacked`) combines the splits by log-sum-exp.
  * precision="bf16" (default): dot operands in bf16 with fp32 accumulation, the same
    arithmetic as a bf16 dense decode; "fp32": exact fp32 dots (slower, for validation).
  * keys quantized before RoPE (``rope_inv_freq``; dsub = 2, sub-space m = RoPE pair m, code
    row t = position t), centroid path only: score_t = q . R(t f) c_t is computed as
    (R(-b) q) . (R(o) c_t) with t = t0 + o, b = t0 f the tile's base angle and o f the
    in-tile offset. The base cos / sin [M] are computed once per tile, the offset cos / sin
    [block_t, M] once per program (the same for every tile), both with the exact fixed-point
    angles of `pq_math.rope_phase` (integer ops + one cos / sin, float32, never stored); per
    token and pair the kernel then does one 2 x 2 rotation of the gathered centroid. q comes
    split into its even / odd pair components ([2, block_h, M]) and the score is two dots
    (even and odd halves), since Triton cannot interleave or slice loaded values. The LUT
    path is refused: it would gather two tables per query head and token instead of one
    centroid per token.

Why not plain `take_along_axis` in the kernel: the Triton lowering has no gather or slice
on loaded values; integer-array indexing of a ref (pointer arithmetic) is what lowers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import pl, plgpu, triton_compiler_params, triton_dot
from pallas_kernels._pq_inputs import PQDims, check_pq_inputs, is_power_of_two, pq_dims
from pallas_kernels.code_packing import assemble_codes, code_bytes, unpack_codes
from pallas_kernels.launch import DEFAULT_BLOCK_T_ROPE, LaunchConfig, default_launch_config
from pallas_kernels.pq_math import (
    build_lut,
    check_rope_inv_freq,
    gather_centroids,
    lut_scores,
    phase_cos_sin,
    quarter_turn,
    rope_cos_sin,
    rope_lut_scores,
    rope_phase,
    rope_turns,
)
from pallas_kernels.softmax import merge_stacked, softmax_attention

__all__ = [
    "KernelPlan",
    "plan_pq_kernel",
    "pq_decode_attention",
    "pq_decode_attention_planned",
    "pq_dims",
    "pq_kernel_unsupported_reason",
    "pq_decode_attention_reference",
    "KeyPath",
    "Precision",
    "MIN_BLOCK_H",
]

KeyPath = Literal["centroid", "lut"]
Precision = Literal["bf16", "fp32"]
MIN_BLOCK_H = 16  # tl.dot needs M >= 16
MIN_BLOCK_T = 16  # tl.dot needs N, K >= 16


# --------------------------------------------------------------------------- kernel


def _split_range(
    start: jax.Array, end: jax.Array, split: jax.Array, num_splits: int, block_t: int
) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of `split` when [start, end) is cut into num_splits block_t-aligned pieces."""
    n = jnp.maximum(end - start, 0)
    per_split = pl.cdiv(pl.cdiv(n, num_splits), block_t) * block_t
    lo = start + split * per_split
    hi = jnp.minimum(lo + per_split, end)
    return lo, hi


def _pq_attention_kernel(
    start_ref,  # int32[B]
    end_ref,  # int32[B]
    q_ref,  # f32[block_h, d] (pre-scaled); pre-RoPE: f32[2, block_h, M] (even / odd pair components)
    kc_ref,  # uint8[T, M], or packed uint8[T, ceil(M * k_packed_bits / 8)]
    vc_ref,  # alike for values
    ktab_ref,  # centroid: [M, Kk, dsub] key codebook; lut: f32[group, M, Kk]
    vcb_ref,  # [M, Kv, dsub] value codebook
    *refs,  # pre-RoPE: turns_ref uint32[2, M] (`pq_math.rope_turns`); then o_ref f32[block_h, d], lse_ref f32[block_h]
    rope: bool,
    block_t: int,
    num_splits: int,
    group: int,
    key_path: KeyPath,
    precision: Precision,
    k_centroids: int,
    v_centroids: int,
    k_packed_bits: int,
    v_packed_bits: int,
) -> None:
    turns_ref, o_ref, lse_ref = refs if rope else (None, *refs)
    block_h, head_dim = o_ref.shape
    num_sub, _, sub_dim = vcb_ref.shape
    b = pl.program_id(0)
    lo, hi = _split_range(start_ref[b], end_ref[b], pl.program_id(2), num_splits, block_t)
    num_tiles = pl.cdiv(jnp.maximum(hi - lo, 0), block_t)

    lut_rows = pl.next_power_of_2(group)
    dot_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    dot_precision = None if precision == "bf16" else lax.Precision.HIGHEST
    t_idx = jnp.arange(block_t, dtype=jnp.int32)
    if rope:
        q_even, q_odd = q_ref[0], q_ref[1]  # f32[block_h, M]
        turns_hi, turns_lo = turns_ref[0], turns_ref[1]  # uint32[M]
        # in-tile offsets o: cos / sin of o * f, the same for every tile of the program
        off_cos, off_sin = phase_cos_sin(rope_phase(t_idx[:, None], turns_hi[None, :], turns_lo[None, :]))
    else:
        q = q_ref[...].astype(dot_dtype)
    m_idx3 = jnp.arange(num_sub, dtype=jnp.int32)[None, :, None]
    s_idx3 = jnp.arange(sub_dim, dtype=jnp.int32)[None, None, :]

    def load_codes(ref, t0: jax.Array, valid: jax.Array, num_centroids: int, packed_bits: int) -> jax.Array:
        if packed_bits:
            # Packed codes: code m's bytes are read by pointer loads (integer-array indexing of
            # the ref; rows past `hi` re-read row hi - 1, scored -inf below) and assembled with
            # the shared bit arithmetic of pallas_kernels.code_packing. First byte and shift are
            # code_bytes' layout, computed from an iota (array constants do not lower).
            width = ref.shape[1]
            _, _, window = code_bytes(num_sub, packed_bits)
            rows = jnp.broadcast_to(jnp.minimum(t0 + t_idx, hi - 1)[:, None], (block_t, num_sub))
            bit = jnp.broadcast_to(jnp.arange(num_sub, dtype=jnp.int32)[None, :] * packed_bits, (block_t, num_sub))
            first = bit >> 3
            taken = [ref[rows, jnp.minimum(first + j, width - 1)] for j in range(window)]
            codes = assemble_codes(taken, bit & 7, packed_bits)
            bits_read = packed_bits
        else:
            # Rows past `hi` are masked (never read out of bounds) and scored -inf below.
            codes = plgpu.load(ref.at[pl.ds(t0, block_t), :], mask=valid[:, None], other=0)
            codes = codes.astype(jnp.int32)
            bits_read = 8
        if num_centroids < (1 << bits_read):  # keep stray codes inside the table (memory safety)
            codes = jnp.minimum(codes, num_centroids - 1)
        return codes  # int32[block_t, M]

    def dequantise(cb_ref, codes: jax.Array) -> jax.Array:
        shape = (block_t, num_sub, sub_dim)
        idx_m = jnp.broadcast_to(m_idx3, shape)
        idx_c = jnp.broadcast_to(codes[:, :, None], shape)
        idx_s = jnp.broadcast_to(s_idx3, shape)
        cent = cb_ref[idx_m, idx_c, idx_s]  # [block_t, M, dsub], pointer gather
        return cent.reshape(block_t, head_dim)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        t0 = lo + i * block_t
        valid = t0 + t_idx < hi  # [block_t]; >= 1 valid row in every iterated tile
        kc = load_codes(kc_ref, t0, valid, k_centroids, k_packed_bits)
        if rope:
            # score = (R(-b) q) . (R(o) c): q turned back by the tile's base angle b = t0 f,
            # each gathered centroid pair turned by its in-tile offset (see the module docstring)
            base_cos, base_sin = phase_cos_sin(rope_phase(t0, turns_hi, turns_lo))  # [M]
            bc, bs = base_cos[None, :], base_sin[None, :]
            u_even = (q_even * bc + q_odd * bs).astype(dot_dtype)
            u_odd = (q_odd * bc - q_even * bs).astype(dot_dtype)
            shape = (block_t, num_sub)
            idx_m = jnp.broadcast_to(jnp.arange(num_sub, dtype=jnp.int32)[None, :], shape)
            c_even = ktab_ref[idx_m, kc, jnp.zeros(shape, jnp.int32)].astype(jnp.float32)  # [block_t, M]
            c_odd = ktab_ref[idx_m, kc, jnp.ones(shape, jnp.int32)].astype(jnp.float32)
            k_even = (off_cos * c_even - off_sin * c_odd).astype(dot_dtype)
            k_odd = (off_cos * c_odd + off_sin * c_even).astype(dot_dtype)
            scores = triton_dot(u_even, k_even, trans_b=True, precision=dot_precision) + triton_dot(
                u_odd, k_odd, trans_b=True, precision=dot_precision)  # [block_h, block_t]
        elif key_path == "centroid":
            k_hat = dequantise(ktab_ref, kc).astype(dot_dtype)
            scores = triton_dot(q, k_hat, trans_b=True, precision=dot_precision)  # [block_h, block_t]
        else:
            # Gather LUT entries for the group's heads only (rows padded to a power of two,
            # clamped to real heads), then tile the [lut_rows, block_t] scores to block_h
            # rows: row r holds head r % lut_rows, so rows < group are the real heads.
            shape = (lut_rows, block_t, num_sub)
            h_rows = jnp.minimum(jnp.arange(lut_rows, dtype=jnp.int32), group - 1)
            idx_h = jnp.broadcast_to(h_rows[:, None, None], shape)
            idx_m = jnp.broadcast_to(jnp.arange(num_sub, dtype=jnp.int32)[None, None, :], shape)
            idx_c = jnp.broadcast_to(kc[None, :, :], shape)
            scores = jnp.sum(ktab_ref[idx_h, idx_m, idx_c].astype(jnp.float32), axis=2)
            if lut_rows < block_h:
                reps = block_h // lut_rows
                scores = jnp.broadcast_to(scores[None], (reps, lut_rows, block_t))
                scores = scores.reshape(block_h, block_t)
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        correction = jnp.exp(m_prev - m_new)  # 0 on the first tile (m_prev = -inf)
        p = jnp.exp(scores - m_new[:, None])
        l_new = correction * l_prev + jnp.sum(p, axis=1)
        vc = load_codes(vc_ref, t0, valid, v_centroids, v_packed_bits)
        v_hat = dequantise(vcb_ref, vc).astype(dot_dtype)
        pv = triton_dot(p.astype(dot_dtype), v_hat, precision=dot_precision)  # [block_h, d]
        return correction[:, None] * acc + pv, m_new, l_new

    init = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    acc, m_i, l_i = lax.fori_loop(0, num_tiles, body, init)
    nonempty = l_i != 0  # a NaN score makes l NaN: kept (NaN lse), not taken for an empty split
    l_safe = jnp.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = jnp.where(nonempty, m_i + jnp.log(l_safe), -jnp.inf)
    if group == block_h:
        o_ref[...] = out
        lse_ref[...] = lse
    else:  # padded query rows are not written (the wrapper drops them)
        rows = jnp.arange(block_h) < group
        plgpu.store(o_ref.at[pl.ds(0, block_h), :], out, mask=rows[:, None])
        plgpu.store(lse_ref.at[pl.ds(0, block_h)], lse, mask=rows)


# --------------------------------------------------------------------------- wrapper


# jax's Pallas Triton lowering switches to 64-bit pointer offsets only above 2**32 *bytes*
# but adds 32-bit offsets with sign extension, so an array of 2**31 < elements <= 2**32
# would be addressed with negative offsets (verified in the PTX). Such code arrays are
# refused (the caller takes the XLA path); smaller and larger ones are fine.
_UNSAFE_NUMEL = (2**31, 2**32)


def _check_kernel_support(dims: PQDims, codes: tuple[Any, Any], cfg: LaunchConfig) -> None:
    numel = max(math.prod(c.shape) for c in codes)
    if _UNSAFE_NUMEL[0] < numel <= _UNSAFE_NUMEL[1]:
        raise ValueError(
            f"codes arrays of {numel} elements (2**31 < n <= 2**32) hit a 32-bit offset overflow"
            " in the Pallas Triton lowering; use the XLA path (or a batch / T_max outside that range)"
        )
    for name, c in zip(("k_codes", "v_codes"), codes):
        if jnp.dtype(c.dtype) != jnp.uint8:
            raise ValueError(
                f"the Pallas PQ kernel reads uint8 codes (one per byte, or packed); got {name} {c.dtype}."
                " Pack codes of 9..15 bits (pallas_kernels.code_packing) or use the XLA path"
                " (pq_decode_attention_reference)."
            )
    for name, n in (("head_dim d", dims.head_dim), ("M", dims.num_subspaces), ("dsub", dims.sub_dim)):
        if not is_power_of_two(n):
            raise ValueError(f"the Pallas PQ kernel needs a power-of-two {name}, got {n}; use the XLA path")
    if not is_power_of_two(cfg.block_t) or cfg.block_t < MIN_BLOCK_T:
        raise ValueError(f"block_t must be a power of two >= {MIN_BLOCK_T}, got {cfg.block_t}")
    if cfg.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {cfg.num_splits}")
    if cfg.num_warps < 1 or not is_power_of_two(cfg.num_warps):
        raise ValueError(f"num_warps must be a power of two >= 1, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {cfg.num_stages}")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One checked launch of the kernel: the call's sizes, the launch config, the two modes.

    Made by :func:`plan_pq_kernel`; :func:`pq_decode_attention_planned` launches it.
    """

    dims: PQDims
    launch: LaunchConfig
    key_path: KeyPath = "centroid"
    precision: Precision = "bf16"
    rope: bool = False  # keys quantized before RoPE (the launch takes rope_inv_freq)


def plan_pq_kernel(
    dims: PQDims, k_codes: Any, v_codes: Any,
    *,
    block_t: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_path: KeyPath = "centroid",
    precision: Precision = "bf16",
    rope: bool = False,
) -> KernelPlan:
    """The kernel's launch for a call of sizes ``dims``, or ValueError naming what it cannot take.

    dims: from :func:`check_pq_inputs` (a user's inputs) or :func:`pq_dims` (inputs checked
    where they were built, e.g. by the PQ cache). k_codes / v_codes: arrays or
    ShapeDtypeStructs (only their dtype and size are read). ``rope``: keys quantized before
    RoPE (see `pq_decode_attention`'s ``rope_inv_freq``). Unset launch options get the
    defaults of :mod:`pallas_kernels.launch`. Works at trace time.
    """
    if key_path not in ("centroid", "lut"):
        raise ValueError(f"key_path must be 'centroid' or 'lut', got {key_path!r}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if rope and block_t is None:
        block_t = DEFAULT_BLOCK_T_ROPE
    cfg = default_launch_config(dims.batch, dims.num_kv_heads, dims.seq_len, key_path=key_path, block_t=block_t,
                                num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    _check_kernel_support(dims, (k_codes, v_codes), cfg)
    if rope:
        _check_rope_support(dims, key_path)
    return KernelPlan(dims, cfg, key_path, precision, rope)


def pq_kernel_unsupported_reason(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    rope_inv_freq: jax.Array | None = None,
    **launch: Any,
) -> str | None:
    """None when `pq_decode_attention` takes these inputs (arrays or ShapeDtypeStructs), else why not.

    ``launch``: the keyword options of `pq_decode_attention` (block_t, num_splits, num_warps,
    num_stages, key_path, precision; another name is a TypeError); ``rope_inv_freq``: as there
    (pre-RoPE keys). A non-None answer means "use the XLA reference path". Only shapes / dtypes
    are inspected (works at trace time).
    """
    try:
        dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end)
        plan_pq_kernel(dims, k_codes, v_codes, rope=rope_inv_freq is not None, **launch)
        if rope_inv_freq is not None:
            check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim)
    except ValueError as e:
        return str(e)
    return None


def _check_rope_support(dims: PQDims, key_path: str) -> None:
    """ValueError unless the kernel takes pre-RoPE keys of these sizes on ``key_path``."""
    if key_path != "centroid":
        raise ValueError("pre-RoPE keys (rope_inv_freq) run on key_path='centroid' only: the LUT path would "
                         "gather two tables per query head and token (use the XLA path for the LUT form)")
    if dims.sub_dim != 2:
        raise ValueError(f"pre-RoPE keys need one sub-space per RoPE pair (dsub = 2), got dsub {dims.sub_dim}")
    if dims.num_subspaces < MIN_BLOCK_T:
        raise ValueError(f"pre-RoPE keys need M = head_dim / 2 >= {MIN_BLOCK_T} in the kernel (tl.dot over the "
                         f"pair halves), got M={dims.num_subspaces}; use the XLA path")


def _codebook_spec(cb: jax.Array) -> pl.BlockSpec:
    g, m, k, ds = cb.shape
    if g == 1:
        return pl.BlockSpec((None, m, k, ds), lambda b, h, s: (0, 0, 0, 0))
    return pl.BlockSpec((None, m, k, ds), lambda b, h, s: (h, 0, 0, 0))


def pq_decode_attention(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    scale: float | None = None,
    block_t: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_path: KeyPath = "centroid",
    precision: Precision = "bf16",
    interpret: bool = False,
    rope_inv_freq: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention of one query per sequence over PQ-coded keys and values (Pallas).

    Args:
      q: float[B, H, d] queries; query head h reads KV head h // (H // Hkv).
      k_codes: uint8[B, Hkv, T, M] key codes (keys quantised after RoPE), or packed at their
        real width, uint8[B, Hkv, T, ceil(M * nbits / 8)] with nbits = log2 K
        (`pallas_kernels.code_packing`; 1..15 bits, not 8).
      v_codes: value codes alike (packed or not independently of the keys; same M).
      k_codebooks: float32|bf16[G, M, K, dsub] key centroids, G = 1 (shared) or Hkv.
      v_codebooks: float32|bf16[G, M, K, dsub] value centroids, G = 1 or Hkv.
      start: int32[B]; end: int32[B]: tokens start[b] <= t < end[b] are attended (clipped
        to [0, T]; an empty range gives out 0 and lse -inf).
      scale: score scale, default 1 / sqrt(d).
      block_t: tokens per tile (power of two >= 16); default 64 (centroid) / 32 (lut) / 32
        (pre-RoPE keys, `launch.DEFAULT_BLOCK_T_ROPE`).
      num_splits: split-K factor; default from `launch.default_num_splits` (~512 programs).
      num_warps: Triton warps per program, default 4.  num_stages: default 2.
      key_path: "centroid" (gather key centroids, one dot per tile; default) or "lut"
        (MILLION's LUT sum; see the module docstring).
      precision: "bf16" (bf16 dot operands, fp32 accumulation; default) or "fp32".
      interpret: run the kernel in Pallas interpret mode (CPU, tests).
      rope_inv_freq: float32[M] or None (default: keys quantized after RoPE). Keys quantized
        before RoPE: key sub-space m is RoPE pair m (dsub = 2, head dims in pair layout, q
        rotated at its own position already), code row t is the key of position t, rotated
        here by t * rope_inv_freq[m] (rotate-half convention; exact fixed-point angles,
        `pq_math.rope_phase`). key_path="centroid" only, M >= 16.

    Returns:
      (out float32[B, H, d], lse float32[B, H]) as `pq_decode_attention_reference`.

    Raises:
      ValueError: bad shapes / dtypes, or inputs this kernel does not take (unpacked uint16
        codes, non-power-of-two d / M / dsub): the caller then uses the XLA reference path.
    """
    dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end)
    plan = plan_pq_kernel(dims, k_codes, v_codes, block_t=block_t, num_splits=num_splits, num_warps=num_warps,
                          num_stages=num_stages, key_path=key_path, precision=precision,
                          rope=rope_inv_freq is not None)
    if rope_inv_freq is not None:
        check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim)
    return pq_decode_attention_planned(plan, q, k_codes, v_codes, k_codebooks, v_codebooks, start, end,
                                       scale=scale, interpret=interpret, rope_inv_freq=rope_inv_freq)


def pq_decode_attention_planned(
    plan: KernelPlan,
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    rope_inv_freq: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`pq_decode_attention` with its inputs already checked and its launch already planned.

    For callers that plan once (:func:`plan_pq_kernel`; the dispatcher of ``million_jax``):
    the inputs are not validated again, only compared with the plan's sizes. Args / returns
    as `pq_decode_attention`; ``rope_inv_freq`` is given exactly when the plan says ``rope``.
    """
    dims, cfg, key_path, precision = plan.dims, plan.launch, plan.key_path, plan.precision
    rope = plan.rope
    if rope != (rope_inv_freq is not None):
        raise ValueError(f"the kernel plan is for {'pre' if rope else 'post'}-RoPE keys; rope_inv_freq "
                         f"{'missing' if rope else 'given'}")
    batch, num_heads, head_dim = dims.batch, dims.num_heads, dims.head_dim
    if tuple(q.shape) != (batch, num_heads, head_dim) or tuple(k_codes.shape[:3]) != (
            batch, dims.num_kv_heads, dims.seq_len):
        raise ValueError(f"the kernel plan is for q [{batch}, {num_heads}, {head_dim}] and codes "
                         f"[{batch}, {dims.num_kv_heads}, {dims.seq_len}, ...], got q {tuple(q.shape)} and "
                         f"codes {tuple(k_codes.shape)}")
    hkv, group = dims.num_kv_heads, dims.group
    if dims.seq_len == 0:
        return (
            jnp.zeros((batch, num_heads, head_dim), jnp.float32),
            jnp.full((batch, num_heads), -jnp.inf, jnp.float32),
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    block_h = max(MIN_BLOCK_H, pl.next_power_of_2(group))

    q_grouped = (q.astype(jnp.float32) * scale).reshape(batch, hkv, group, head_dim)
    q_padded = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    if rope:  # [B, Hkv, 2, block_h, M]: pair components apart (the kernel cannot slice loaded values)
        q_padded = jnp.moveaxis(q_padded.reshape(batch, hkv, block_h, head_dim // 2, 2), -1, 2)
        q_spec = pl.BlockSpec((None, None, 2, block_h, head_dim // 2), lambda b, h, s: (b, h, 0, 0, 0))
    else:
        q_spec = pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0))
    start = jnp.clip(start.astype(jnp.int32), 0, dims.seq_len)
    end = jnp.clip(end.astype(jnp.int32), 0, dims.seq_len)

    t_len, n_sub = dims.seq_len, dims.num_subspaces
    if key_path == "lut":
        key_table = build_lut(q_grouped, k_codebooks)
        key_spec = pl.BlockSpec(
            (None, None, group, n_sub, dims.k_centroids), lambda b, h, s: (b, h, 0, 0, 0)
        )
    else:
        key_table = k_codebooks
        key_spec = _codebook_spec(k_codebooks)

    s_count = cfg.num_splits
    kernel = functools.partial(
        _pq_attention_kernel,
        rope=rope,
        block_t=cfg.block_t,
        num_splits=s_count,
        group=group,
        key_path=key_path,
        precision=precision,
        k_centroids=dims.k_centroids,
        v_centroids=dims.v_centroids,
        k_packed_bits=dims.k_packed_bits,
        v_packed_bits=dims.v_packed_bits,
    )
    codes_spec = lambda c: pl.BlockSpec((None, None, t_len, c.shape[-1]), lambda b, h, s: (b, h, 0, 0))  # noqa: E731
    full_b = pl.BlockSpec((batch,), lambda b, h, s: (0,))
    extra_in, extra_specs = (), []
    if rope:
        extra_in = (jnp.stack(rope_turns(rope_inv_freq)),)  # uint32[2, M]
        extra_specs = [pl.BlockSpec((2, n_sub), lambda b, h, s: (0, 0))]
    out_p, lse_p = pl.pallas_call(
        kernel,
        grid=(batch, hkv, s_count),
        in_specs=[
            full_b,
            full_b,
            q_spec,
            codes_spec(k_codes),
            codes_spec(v_codes),
            key_spec,
            _codebook_spec(v_codebooks),
            *extra_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, hkv, s_count, block_h, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, hkv, s_count, block_h), jnp.float32),
        ],
        compiler_params=triton_compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="pq_decode_attention",
    )(start, end, q_padded, k_codes, v_codes, key_table, v_codebooks, *extra_in)

    out, lse = merge_stacked(out_p[:, :, :, :group], lse_p[:, :, :, :group], axis=2)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


# --------------------------------------------------------------------------- reference


def pq_decode_attention_reference(
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    scale: float | None = None,
    rope_inv_freq: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp fp32 reference of `pq_decode_attention` (any backend, uint8 / uint16 / packed codes).

    Written with the shared math: LUT[b, g, h, m, j] = q_m . Ck_m[j] (`pq_math.build_lut`),
    score = scale * sum_m LUT[m, code_m] (`pq_math.lut_scores`), values = the value centroids
    the codes name (`pq_math.gather_centroids`), masked softmax over start[b] <= t < end[b]
    (`softmax.softmax_attention`). Pre-RoPE keys (``rope_inv_freq``): the two tables q.c and
    q.Jc and score = scale * sum_m cos_tm LUT + sin_tm LUTJ (`pq_math.rope_lut_scores`), the
    angles of row t from `pq_math.rope_cos_sin`.

    Args / returns: as `pq_decode_attention` (codes may also be uint16[B, Hkv, T, M]).
    Memory: O(B * H * T * M) for the gathered LUT entries.
    """
    dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end)
    batch, num_heads, head_dim = dims.batch, dims.num_heads, dims.head_dim
    hkv, group, t_len = dims.num_kv_heads, dims.group, dims.seq_len
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    q_grouped = q.astype(jnp.float32).reshape(batch, hkv, group, head_dim)
    lut = build_lut(q_grouped, k_codebooks)  # [B, Hkv, group, M, Kk]
    k_codes = unpack_codes(k_codes, dims.num_subspaces, dims.k_packed_bits) if dims.k_packed_bits else k_codes
    v_codes = unpack_codes(v_codes, dims.num_subspaces, dims.v_packed_bits) if dims.v_packed_bits else v_codes
    if rope_inv_freq is None:
        scores = scale * lut_scores(lut, k_codes)  # [B, Hkv, group, T]
    else:
        check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim)
        lut_j = build_lut(q_grouped, quarter_turn(k_codebooks))
        cos, sin = rope_cos_sin(jnp.arange(t_len, dtype=jnp.int32), rope_inv_freq)  # [T, M]
        scores = scale * rope_lut_scores(lut, lut_j, k_codes, cos, sin)
    t = jnp.arange(t_len)
    valid = (t[None, :] >= start.astype(jnp.int32)[:, None]) & (t[None, :] < end.astype(jnp.int32)[:, None])
    v_hat = gather_centroids(v_codebooks, v_codes)  # [B, Hkv, T, d]
    out, lse = softmax_attention(scores[:, :, :, None], valid[:, None, None, None, :], v_hat)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)

"""The body of the fused LUT-and-gather split-K decode kernel over product-quantised (PQ) KV codes.

One decode query per sequence attends to a KV cache stored as PQ codes: each key / value
head vector (head_dim d) is M sub-vectors of dsub = d / M dims, each stored as the index of
its nearest centroid among K = 2**nbits in that subspace's codebook. For query head h of
KV head g = h // group:

    LUT[m, j] = q_m . Ck_m[j]                         (q_m: sub-vector m of q)
    score_t   = scale * sum_m LUT[m, ck_tm]           (= scale * q . dequant(k_t))
    out       = sum_t softmax(score)_t * concat_m Cv_m[cv_tm]
    lse       = log sum_t exp(score_t)                 (natural log)

over the tokens start[b] <= t < end[b]. This file holds the Pallas kernel body (GPU, Triton
backend; `interpret=True` runs it anywhere): one program's work. Its launch (grid, block
specs, the split merge) is `pq_decode_attention.py`, its plan and the shapes it takes
`pq_plan.py` / `pq_support.py`, its pure-jnp reference `pq_reference.py`.

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
  * per-token scales (optional, ``k_scaled`` / ``v_scaled``): a factor per stored token
    multiplies its score (keys) and its probability inside the value dot (values; the softmax
    denominator keeps the plain probabilities). TurboQuant's codes are this kernel's case of
    d one-dim sub-spaces (the Lloyd-Max levels as codebooks) with each vector's norm as the
    scale, their fractional budgets a layout of two parts of different widths;
  * values: value centroids gathered the same way by the value codes and weighted by the
    probabilities with a [block_h, block_t] x [block_t, d] dot;
  * every program writes a partial (out, lse) for its split (empty split: out 0, lse -inf);
    a second step (plain jnp, `softmax.merge_stacked`) combines the splits by log-sum-exp.
  * precision="bf16" (default): dot operands in bf16 with fp32 accumulation, the same
    arithmetic as a bf16 dense decode; "fp32": exact fp32 dots (slower, for validation).
  * keys quantized before RoPE (``rope_inv_freq``; sub-space m = P = dsub / 2 whole RoPE
    pairs, code row t = position t), centroid path only: score_t = q . R(t f) c_t is computed
    as (R(-b) q) . (R(o) c_t) with t = t0 + o, b = t0 f the tile's base angle and o f the
    in-tile offset. The base cos / sin [M] are computed once per tile, the offset cos / sin
    [block_t, M] once per program (the same for every tile), both per pair slot p and with
    the exact fixed-point angles of `pq_math.rope_phase` (integer ops + one cos / sin,
    float32, never stored); per token and pair the kernel then does one 2 x 2 rotation of the
    gathered centroid pair. q comes split into its even / odd pair components and pair slots
    ([2, P, block_h, M]) and the score is two dots (even and odd halves) per pair slot, since
    Triton cannot interleave or slice loaded values. The LUT path is refused: it would gather
    two tables per query head and token instead of one centroid per token.

Why not plain `take_along_axis` in the kernel: the Triton lowering has no gather or slice
on loaded values; integer-array indexing of a ref (pointer arithmetic) is what lowers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import pl, plgpu, triton_dot
from pallas_kernels.code_packing import Parts, assemble_codes, part_bit_layout, parts_window
from pallas_kernels.pq_math import phase_cos_sin, rope_phase
from pallas_kernels.pq_support import KeyPath, Precision

__all__ = ["pq_attention_kernel", "split_range"]


def split_range(
    start: jax.Array, end: jax.Array, split: jax.Array, num_splits: int, block_t: int
) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of `split` when [start, end) is cut into num_splits block_t-aligned pieces."""
    n = jnp.maximum(end - start, 0)
    per_split = pl.cdiv(pl.cdiv(n, num_splits), block_t) * block_t
    lo = start + split * per_split
    hi = jnp.minimum(lo + per_split, end)
    return lo, hi


def pq_attention_kernel(
    start_ref,  # int32[B]
    end_ref,  # int32[B]
    q_ref,  # f32[block_h, d] (pre-scaled); pre-RoPE: f32[2, P, block_h, M] (even / odd pair components)
    kc_ref,  # uint8[T, M], or packed uint8[T, ceil(M * k_packed_bits / 8)]
    vc_ref,  # alike for values
    ktab_ref,  # centroid: [M, Kk, dsub] key codebook; lut: f32[group, M, Kk]
    vcb_ref,  # [M, Kv, dsub] value codebook
    *refs,  # pre-RoPE: turns_ref uint32[2, P, M] (`pq_math.rope_turns`); k_scaled: ks_ref f32|bf16[T];
    # v_scaled: vs_ref alike; then o_ref f32[block_h, d], lse_ref f32[block_h]
    rope: bool,
    block_t: int,
    num_splits: int,
    group: int,
    key_path: KeyPath,
    precision: Precision,
    k_centroids: int,
    v_centroids: int,
    k_layout: Parts | None,
    v_layout: Parts | None,
    k_scaled: bool = False,
    v_scaled: bool = False,
) -> None:
    """One program (sequence b, KV head g, split s) of the grid (B, Hkv, num_splits).

    Walks the split's tokens [lo, hi) of [start[b], end[b]) in tiles of block_t with an online
    softmax and writes the split's partial out f32[block_h, d] (rows >= group are padding, not
    written) and lse f32[block_h]; an empty split writes out 0, lse -inf. The refs' shapes are
    the block shapes given by `pq_decode_attention_planned` (commented above).
    """
    refs = list(refs)
    turns_ref = refs.pop(0) if rope else None
    ks_ref = refs.pop(0) if k_scaled else None
    vs_ref = refs.pop(0) if v_scaled else None
    o_ref, lse_ref = refs
    block_h, head_dim = o_ref.shape
    num_sub, _, sub_dim = vcb_ref.shape
    b = pl.program_id(0)
    lo, hi = split_range(start_ref[b], end_ref[b], pl.program_id(2), num_splits, block_t)
    num_tiles = pl.cdiv(jnp.maximum(hi - lo, 0), block_t)

    lut_rows = pl.next_power_of_2(group)
    dot_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    dot_precision = None if precision == "bf16" else lax.Precision.HIGHEST
    t_idx = jnp.arange(block_t, dtype=jnp.int32)
    if rope:
        pairs = q_ref.shape[1]  # RoPE pairs per key sub-space (dsub = 2 * pairs)
        q_even = [q_ref[0, p] for p in range(pairs)]  # f32[block_h, M] per pair slot
        q_odd = [q_ref[1, p] for p in range(pairs)]
        turns = [(turns_ref[0, p], turns_ref[1, p]) for p in range(pairs)]  # uint32[M] (hi, lo)
        # in-tile offsets o: cos / sin of o * f, the same for every tile of the program
        offsets = [phase_cos_sin(rope_phase(t_idx[:, None], hi_[None, :], lo_[None, :])) for hi_, lo_ in turns]
    else:
        q = q_ref[...].astype(dot_dtype)
    m_idx3 = jnp.arange(num_sub, dtype=jnp.int32)[None, :, None]
    s_idx3 = jnp.arange(sub_dim, dtype=jnp.int32)[None, None, :]

    def load_codes(ref, t0: jax.Array, valid: jax.Array, num_centroids: int, layout: Parts | None) -> jax.Array:
        if layout is not None:
            # Packed codes: code m's bytes are read by pointer loads (integer-array indexing of
            # the ref; rows past `hi` re-read row hi - 1, scored -inf below) and assembled with
            # the shared bit arithmetic of pallas_kernels.code_packing. First bit and width are
            # the layout's (`part_bit_layout`: m * nbits for one part; parts of several widths
            # side by side), computed from an iota (array constants do not lower).
            width = ref.shape[1]
            rows = jnp.broadcast_to(jnp.minimum(t0 + t_idx, hi - 1)[:, None], (block_t, num_sub))
            m_row = jnp.broadcast_to(jnp.arange(num_sub, dtype=jnp.int32)[None, :], (block_t, num_sub))
            bit, nbits = part_bit_layout(m_row, layout)
            if len(layout) == 1:
                nbits = layout[0][1]  # one width: a constant mask
            first = bit >> 3
            taken = [ref[rows, jnp.minimum(first + j, width - 1)] for j in range(parts_window(layout))]
            codes = assemble_codes(taken, bit & 7, nbits)
            bits_read = max(b for _, b in layout)
        else:
            # Rows past `hi` are masked (never read out of bounds) and scored -inf below.
            codes = plgpu.load(ref.at[pl.ds(t0, block_t), :], mask=valid[:, None], other=0)
            codes = codes.astype(jnp.int32)
            bits_read = 8
        if num_centroids < (1 << bits_read):  # keep stray codes inside the table (memory safety)
            codes = jnp.minimum(codes, num_centroids - 1)
        return codes  # int32[block_t, M]

    def load_scales(ref, t0: jax.Array, valid: jax.Array) -> jax.Array:
        # rows past `hi` are masked (never read out of bounds); their scores are -inf anyway
        return plgpu.load(ref.at[pl.ds(t0, block_t)], mask=valid, other=0).astype(jnp.float32)  # [block_t]

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
        kc = load_codes(kc_ref, t0, valid, k_centroids, k_layout)
        if rope:
            # score = (R(-b) q) . (R(o) c): q turned back by the tile's base angle b = t0 f,
            # each gathered centroid pair turned by its in-tile offset (see the module docstring)
            shape = (block_t, num_sub)
            idx_m = jnp.broadcast_to(jnp.arange(num_sub, dtype=jnp.int32)[None, :], shape)
            scores = None
            for p in range(pairs):  # pair slot p of every sub-space: dims 2p, 2p + 1 of its centroid
                base_cos, base_sin = phase_cos_sin(rope_phase(t0, *turns[p]))  # [M]
                bc, bs = base_cos[None, :], base_sin[None, :]
                u_even = (q_even[p] * bc + q_odd[p] * bs).astype(dot_dtype)
                u_odd = (q_odd[p] * bc - q_even[p] * bs).astype(dot_dtype)
                c_even = ktab_ref[idx_m, kc, jnp.full(shape, 2 * p, jnp.int32)].astype(jnp.float32)  # [block_t, M]
                c_odd = ktab_ref[idx_m, kc, jnp.full(shape, 2 * p + 1, jnp.int32)].astype(jnp.float32)
                off_cos, off_sin = offsets[p]
                k_even = (off_cos * c_even - off_sin * c_odd).astype(dot_dtype)
                k_odd = (off_cos * c_odd + off_sin * c_even).astype(dot_dtype)
                part = triton_dot(u_even, k_even, trans_b=True, precision=dot_precision) + triton_dot(
                    u_odd, k_odd, trans_b=True, precision=dot_precision)  # [block_h, block_t]
                scores = part if scores is None else scores + part
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
        if k_scaled:  # per-token key scale (TurboQuant's norm): score_t = s_t * (q . unit k_t)
            scores = scores * load_scales(ks_ref, t0, valid)[None, :]
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        correction = jnp.exp(m_prev - m_new)  # 0 on the first tile (m_prev = -inf)
        p = jnp.exp(scores - m_new[:, None])
        l_new = correction * l_prev + jnp.sum(p, axis=1)
        vc = load_codes(vc_ref, t0, valid, v_centroids, v_layout)
        v_hat = dequantise(vcb_ref, vc).astype(dot_dtype)
        # per-token value scale: sum_t p_t s_t v_t, folded into the probabilities (l keeps p)
        pw = p * load_scales(vs_ref, t0, valid)[None, :] if v_scaled else p
        pv = triton_dot(pw.astype(dot_dtype), v_hat, precision=dot_precision)  # [block_h, d]
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

"""Fused LUT-and-gather split-K decode attention over product-quantised (PQ) KV codes: the
public entry point and the launch.

    pq_decode_attention(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end)
        -> (out f32[B, H, d], lse f32[B, H])

checks a user's inputs (`_pq_inputs.check_pq_inputs`), plans a launch (`pq_plan.plan_pq_kernel`)
and runs it; `pq_decode_attention_planned` runs an already planned launch unchecked (the
dispatcher of ``million_jax`` plans once per call). The launch is one `pallas_call` over the
grid (B, Hkv, num_splits) of the kernel body (`pq_kernel.py`, whose docstring has the kernel
design), then the log-sum-exp merge of the splits' partials (`softmax.merge_stacked`). The
pure-jnp reference is `pq_reference.py`.

The names below are also re-exported here from the files they moved to when this module was
split (plan, support checks, reference), so ``pallas_kernels.pq_decode_attention.X`` keeps working.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._compat import pl, triton_compiler_params
from pallas_kernels._pq_inputs import check_pq_inputs, pq_dims
from pallas_kernels.code_packing import Parts
from pallas_kernels.pq_kernel import pq_attention_kernel
from pallas_kernels.pq_math import build_lut, check_rope_inv_freq, pair_freqs, rope_turns
from pallas_kernels.pq_plan import KernelPlan, plan_pq_kernel, pq_kernel_unsupported_reason
from pallas_kernels.pq_reference import pq_decode_attention_reference
from pallas_kernels.pq_support import MIN_BLOCK_H, KeyPath, Precision
from pallas_kernels.softmax import merge_stacked

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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    k_parts: Parts | None = None,
    v_parts: Parts | None = None,
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
        (pre-RoPE keys) for d <= 128, 32 / 16 / 16 for d = 256 (`launch.default_block_t`).
      num_splits: split-K factor; default from `launch.default_num_splits` (~512 programs).
      num_warps: Triton warps per program, default 4.  num_stages: default 2. (Pre-RoPE keys
        at d >= 256: 8 warps, 1 stage; `launch.default_warps_stages`.)
      key_path: "centroid" (gather key centroids, one dot per tile; default) or "lut"
        (MILLION's LUT sum; see `pq_kernel`'s docstring).
      precision: "bf16" (bf16 dot operands, fp32 accumulation; default) or "fp32".
      interpret: run the kernel in Pallas interpret mode (CPU, tests).
      rope_inv_freq: float32[M] or [M, P] (per KV head: [G, M, P], G in {1, Hkv}), or None (default:
        keys quantized after RoPE). Keys
        quantized before RoPE: key sub-space m is P = dsub / 2 whole RoPE pairs (head dims in
        pair layout, `million_jax.rope.to_pair_layout`; q rotated at its own position already),
        code row t is the key of position t, pair p of sub-space m rotated here by
        t * rope_inv_freq[m, p] (rotate-half convention; exact fixed-point angles,
        `pq_math.rope_phase`). key_path="centroid" only, M >= 16.
      k_scales, v_scales: float[B, Hkv, T] or None: a per-token factor of each stored key (it
        multiplies the token's score) / value (TurboQuant's norms; keys and values each or not).
      k_parts, v_parts: codes in a layout of several parts of different widths
        (`code_packing.Parts`, e.g. ((64, 3), (64, 2)): TurboQuant's 2.5 b), or None.

    Returns:
      (out float32[B, H, d], lse float32[B, H]) as `pq_decode_attention_reference`.

    Raises:
      ValueError: bad shapes / dtypes, or inputs this kernel does not take (unpacked uint16
        codes, non-power-of-two d / M / dsub): the caller then uses the XLA reference path.
    """
    dims = check_pq_inputs(q, k_codes, v_codes, k_codebooks, v_codebooks, start, end, k_parts=k_parts,
                           v_parts=v_parts, k_scales=k_scales, v_scales=v_scales)
    plan = plan_pq_kernel(dims, k_codes, v_codes, block_t=block_t, num_splits=num_splits, num_warps=num_warps,
                          num_stages=num_stages, key_path=key_path, precision=precision,
                          rope=rope_inv_freq is not None)
    if rope_inv_freq is not None:
        check_rope_inv_freq(rope_inv_freq, dims.num_subspaces, dims.sub_dim, dims.num_kv_heads)
    return pq_decode_attention_planned(plan, q, k_codes, v_codes, k_codebooks, v_codebooks, start, end,
                                       scale=scale, interpret=interpret, rope_inv_freq=rope_inv_freq,
                                       k_scales=k_scales, v_scales=v_scales)


def pq_decode_attention_planned(
    plan: KernelPlan,
    q: jax.Array, k_codes: jax.Array, v_codes: jax.Array, k_codebooks: jax.Array, v_codebooks: jax.Array,
    start: jax.Array, end: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    rope_inv_freq: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`pq_decode_attention` with its inputs already checked and its launch already planned.

    For callers that plan once (:func:`plan_pq_kernel`; the dispatcher of ``million_jax``):
    the inputs are not validated again, only compared with the plan's sizes. Args / returns
    as `pq_decode_attention`; ``rope_inv_freq`` is given exactly when the plan says ``rope``, the
    scales exactly when its dims say ``k_scaled`` / ``v_scaled`` (the code layouts are the plan's).
    """
    dims, cfg, key_path, precision = plan.dims, plan.launch, plan.key_path, plan.precision
    rope = plan.rope
    if rope != (rope_inv_freq is not None):
        raise ValueError(f"the kernel plan is for {'pre' if rope else 'post'}-RoPE keys; rope_inv_freq "
                         f"{'missing' if rope else 'given'}")
    for name, x, want in (("k_scales", k_scales, dims.k_scaled), ("v_scales", v_scales, dims.v_scaled)):
        if (x is not None) != want:
            raise ValueError(f"the kernel plan {'takes' if want else 'has no'} {name}; {name} "
                             f"{'missing' if want else 'given'}")
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
    pairs = dims.sub_dim // 2 if rope else 1  # RoPE pairs per key sub-space
    if rope:  # [B, Hkv, 2, P, block_h, M]: pair components and pairs apart (the kernel cannot slice loaded values)
        n_sub = dims.num_subspaces
        q_padded = q_padded.reshape(batch, hkv, block_h, n_sub, pairs, 2).transpose(0, 1, 5, 4, 2, 3)
        q_spec = pl.BlockSpec((None, None, 2, pairs, block_h, n_sub), lambda b, h, s: (b, h, 0, 0, 0, 0))
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
        pq_attention_kernel,
        rope=rope,
        block_t=cfg.block_t,
        num_splits=s_count,
        group=group,
        key_path=key_path,
        precision=precision,
        k_centroids=dims.k_centroids,
        v_centroids=dims.v_centroids,
        k_layout=dims.layout("k"),
        v_layout=dims.layout("v"),
        k_scaled=dims.k_scaled,
        v_scaled=dims.v_scaled,
    )
    codes_spec = lambda c: pl.BlockSpec((None, None, t_len, c.shape[-1]), lambda b, h, s: (b, h, 0, 0))  # noqa: E731
    full_b = pl.BlockSpec((batch,), lambda b, h, s: (0,))
    extra_in, extra_specs = [], []
    if rope:  # uint32[G, 2, P, M]: (hi, lo) turns of pair p of each sub-space (G = 1: every KV head's)
        freqs = pair_freqs(rope_inv_freq).reshape(-1, n_sub, pairs)
        extra_in.append(jnp.stack([jnp.swapaxes(x, -1, -2) for x in rope_turns(freqs)], axis=1))
        head = (lambda h: h) if freqs.shape[0] > 1 else (lambda h: 0)
        extra_specs.append(pl.BlockSpec((None, 2, pairs, n_sub), lambda b, h, s: (head(h), 0, 0, 0)))
    for x in (k_scales, v_scales):  # [B, Hkv, T] -> one row [T] per program
        if x is not None:
            extra_in.append(x)
            extra_specs.append(pl.BlockSpec((None, None, t_len), lambda b, h, s: (b, h, 0)))
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

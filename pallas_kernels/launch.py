"""Launch configuration of the PQ decode-attention kernel, with the reasoning for the defaults.

The kernel is a decode (one query token per sequence) attention that streams uint8 codes:
per token and KV head it reads 2 * M bytes (M = 64 at d = 128: 128 B, against 512 B for a
bf16 K/V pair) and does 2 * M small gathers from a codebook (or LUT) that stays in L1/L2.
It is memory / load-issue bound, never FLOP bound; the defaults are chosen for that, for a
Hopper-class GPU (H100 / H200, 132 SMs). They are starting points for tuning on the real
GPU (benchmarks/gpu_attention.py exposes every knob), not measured optima.

* block_t (tokens per tile; power of two, >= 16 because the tiles feed `tl.dot`):
  64 for the centroid path: a tile is 64 tokens x M codes = 4 KB of key codes + 4 KB of
  value codes (whole 128-B lines, 16-B vector loads), and the dequantised [64, d] fp32 tile
  is 64 registers per thread at 4 warps, leaving room for the [16, d] accumulator without
  spilling. 32 for the LUT path, whose score step materialises a [next_pow2(group),
  block_t, M] gather of fp32 LUT entries.
* num_warps = 4: one warp group; the per-tile dots are tiny ([16, d] x [d, block_t]), so
  more warps only add synchronisation, while 4 warps x 32 lanes give enough independent
  gathers in flight per program; occupancy comes from several programs per SM instead.
* num_stages = 2: lets Triton prefetch the next tile's codes while the current tile's
  gathers run, without the shared memory of deeper pipelines.
* Static check (tests/pallas_kernels/triton_compile_check.py: pip `triton` 3.9 compiling the TTIR
  for sm_90a on CPU; LLaMA-3 heads, GQA 4, d 128, M 64): the default uses 128-132
  registers, no spills, 40 KB shared memory with bf16 codebooks (72 KB with fp32), i.e.
  3-4 programs per SM. block_t=32 / num_stages=3 uses 80 registers and 25-42 KB (5-6
  programs per SM, deeper pipeline); block_t=128 needs num_warps=8 (4 warps: 189-224
  registers, 143 KB shared). precision="fp32" spills (a validation mode, not for speed).
  Pass bf16 codebooks with precision="bf16": identical results (operands are rounded to
  bf16 anyway), half the gather bytes and shared memory.
* Wide heads (d = 256: Gemma 3's global layers, 4 query heads on 1 KV head, M 128 or 64).
  Every per-thread tile grows with d, so the tile shrinks to keep the registers of d = 128:
  the centroid path keeps block_t * d = 8192 (block_t 32 at d 256), the LUT path and
  pre-RoPE keys take block_t 16, and pre-RoPE keys also take 8 warps and 1 stage. Measured
  (triton 3.9, sm_90a, fp32 codebooks unless said; registers / spill bytes / shared memory):
    centroid, M 128:  block_t 64: 188 regs, 0, 144 KB (6-bit codes: 255 regs, 4 B spills);
                      block_t 32 (default): 168 regs, 0, 76 KB (44 KB with bf16 codebooks);
                      4-bit codes 128 regs, 6-bit 168, M 64 (dsub 4) 168, all 0 spills, 73-76 KB.
    lut, M 128:       block_t 32: 255 regs (4-bit codes: 40 B spills, 6-bit: 8 B), 100 KB;
                      block_t 16 (default): 168 regs, 0, 50 KB (4-bit 143, 6-bit 166, M 64 128).
    pre-RoPE, M 128:  4 warps spill at every block_t (16: 112-212 B, 32: 124-576 B); 8 warps,
                      2 stages, block_t 16: 175 regs, 0 for 8-bit codes but 8 B for 4 / 6-bit;
                      8 warps, 1 stage, block_t 16 (default): 170 / 171 / 205 regs (8 / 4 /
                      6-bit codes), 0 spills, no stack, 16 KB (block_t 32: 214-246 regs).
  The d <= 128 defaults are unchanged; d = 256 is the widest measured (wider heads get the
  d = 256 rules, block_t = 8192 / d >= 16 on the centroid path).
* num_splits (split-K over the sequence): enough programs to fill the GPU several times over
  (target ~512 = B * Hkv * splits, about 4 per SM of a 132-SM H200: hides gather latency
  and the tail of the last wave), but never splits shorter than 4 tiles of the array length
  T (each split costs one partial [group, d] write + merge), and at most 64.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "LaunchConfig",
    "default_block_t",
    "default_launch_config",
    "default_warps_stages",
    "TARGET_PROGRAMS",
    "MIN_TILES_PER_SPLIT",
    "DEFAULT_BLOCK_T_ROPE",
    "WIDE_HEAD_DIM",
]

TARGET_PROGRAMS = 512
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
DEFAULT_BLOCK_T = {"centroid": 64, "lut": 32}  # head_dim <= 128
# Pre-RoPE keys (rope_inv_freq): the in-tile offset cos / sin [block_t, M] stay in registers
# for the whole program; at block_t=64 / 4 warps that hits the 255-register cap, at 32 it is
# 168 registers, no spills (3 programs per SM, as the post-RoPE default). head_dim <= 128.
DEFAULT_BLOCK_T_ROPE = 32
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
# Heads wider than this take the wide-head defaults (module docstring: measured at d = 256).
WIDE_HEAD_DIM = 256
CENTROID_TILE_ELEMS = 64 * 128  # block_t * d of the centroid path's dequantised tile
WIDE_BLOCK_T = {"centroid": CENTROID_TILE_ELEMS // WIDE_HEAD_DIM, "lut": 16}
WIDE_ROPE = (16, 8, 1)  # pre-RoPE keys at d >= 256: block_t, num_warps, num_stages


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Kernel launch parameters (see the module docstring for the defaults)."""

    block_t: int
    num_splits: int
    num_warps: int
    num_stages: int


def default_num_splits(batch: int, num_kv_heads: int, seq_len: int, block_t: int) -> int:
    """Split-K factor: ~TARGET_PROGRAMS programs, splits of >= MIN_TILES_PER_SPLIT tiles."""
    want = -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    cap = max(1, seq_len // (MIN_TILES_PER_SPLIT * block_t))
    return max(1, min(want, cap, MAX_SPLITS))


def default_block_t(key_path: str = "centroid", head_dim: int = 128, rope: bool = False) -> int:
    """Tokens per tile by default for this key path, head_dim d and key mode (module docstring)."""
    if head_dim < WIDE_HEAD_DIM:
        return DEFAULT_BLOCK_T_ROPE if rope else DEFAULT_BLOCK_T[key_path]
    if rope:
        return WIDE_ROPE[0]
    if key_path == "centroid":
        return max(16, CENTROID_TILE_ELEMS // head_dim)
    return WIDE_BLOCK_T[key_path]


def default_warps_stages(head_dim: int = 128, rope: bool = False) -> tuple[int, int]:
    """(num_warps, num_stages) by default: 4 / 2, but 8 / 1 for pre-RoPE keys at d >= 256."""
    if rope and head_dim >= WIDE_HEAD_DIM:
        return WIDE_ROPE[1], WIDE_ROPE[2]
    return DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES


def default_launch_config(
    batch: int,
    num_kv_heads: int,
    seq_len: int,
    *,
    key_path: str = "centroid",
    head_dim: int = 128,
    rope: bool = False,
    block_t: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> LaunchConfig:
    """Fills the unset knobs with the defaults for this shape (head_dim d, pre-RoPE keys or not)."""
    bt = default_block_t(key_path, head_dim, rope) if block_t is None else block_t
    warps, stages = default_warps_stages(head_dim, rope)
    return LaunchConfig(
        block_t=bt,
        num_splits=default_num_splits(batch, num_kv_heads, seq_len, bt)
        if num_splits is None
        else num_splits,
        num_warps=warps if num_warps is None else num_warps,
        num_stages=stages if num_stages is None else num_stages,
    )

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
* num_splits (split-K over the sequence): enough programs to fill the GPU several times over
  (target ~512 = B * Hkv * splits, about 4 per SM of a 132-SM H200: hides gather latency
  and the tail of the last wave), but never splits shorter than 4 tiles of the array length
  T (each split costs one partial [group, d] write + merge), and at most 64.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LaunchConfig", "default_block_t", "default_launch_config", "TARGET_PROGRAMS", "MIN_TILES_PER_SPLIT", "DEFAULT_BLOCK_T_ROPE"]

TARGET_PROGRAMS = 512
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
DEFAULT_BLOCK_T = {"centroid": 64, "lut": 32}
# Pre-RoPE keys (rope_inv_freq): the in-tile offset cos / sin [block_t, M] stay in registers
# for the whole program; at block_t=64 / 4 warps that hits the 255-register cap, at 32 it is
# 168 registers, no spills (3 programs per SM, as the post-RoPE default).
DEFAULT_BLOCK_T_ROPE = 32
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


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
    """Tokens per tile by default for this key path, head_dim and key mode (module docstring)."""
    return DEFAULT_BLOCK_T_ROPE if rope else DEFAULT_BLOCK_T[key_path]


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
    return LaunchConfig(
        block_t=bt,
        num_splits=default_num_splits(batch, num_kv_heads, seq_len, bt)
        if num_splits is None
        else num_splits,
        num_warps=DEFAULT_NUM_WARPS if num_warps is None else num_warps,
        num_stages=DEFAULT_NUM_STAGES if num_stages is None else num_stages,
    )

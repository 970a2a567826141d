"""Block sizes for the Pallas kernels: one rule per kernel family, overridable per call.

The attention kernels are memory-bound (a few FLOPs per KV byte), so the rule aims at
(1) enough programs in flight to cover every SM of an H100/H200 (132 SMs; we aim for two
waves), splitting the context across programs when batch x heads x query tiles is small, and
(2) KV tiles of ~64-128 tokens per loop step so each step issues large, coalesced loads.
"""

from __future__ import annotations

import dataclasses

# Two waves of one program per SM on a 132-SM Hopper part.
TARGET_PROGRAMS = 264
# Never split the context finer than this many KV tiles per program.
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """block_t: query tokens per program (rows = block_t * group); pages_per_block: pages per
    online-softmax step; num_splits: context partitions per (sequence, head, query tile)."""

    block_t: int
    pages_per_block: int
    num_splits: int
    num_warps: int
    num_stages: int


def attention_blocks(*, q_len: int, group: int, head_dim: int, page_size: int,
                     pages_per_seq: int, batch: int, kv_heads: int,
                     block_t: int | None = None, pages_per_block: int | None = None,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> AttentionBlocks:
    """Pick the blocks for paged verify/draft attention; any argument given wins over the rule.

    Rows per program are padded to at least 16 (the smallest tensor-core tile); the KV tile is
    ~128 tokens at head_dim <= 128 (64 above) and never under 16 tokens.
    """
    max_rows = 128 if head_dim <= 128 else 64
    if block_t is None:
        rows = min(max(16, next_power_of_2(q_len * group)), max(max_rows, group))
        block_t = max(1, rows // group)
    if pages_per_block is None:
        kv_tile = 128 if head_dim <= 128 else 64
        pages_per_block = max(1, kv_tile // page_size, 16 // page_size)
    if num_splits is None:
        programs = batch * kv_heads * -(-q_len // block_t)
        tiles = -(-pages_per_seq // pages_per_block)
        num_splits = max(1, min(-(-TARGET_PROGRAMS // programs), tiles // MIN_TILES_PER_SPLIT,
                                MAX_SPLITS))
    if num_warps is None:
        num_warps = 8 if block_t * group >= 128 else 4
    if num_stages is None:
        num_stages = 2
    return AttentionBlocks(block_t, pages_per_block, num_splits, num_warps, num_stages)


def row_block(rows: int, *, max_rows: int = 64) -> int:
    """Rows per program for the row-wise norm/RoPE kernels (power of two, at most max_rows)."""
    return min(max_rows, next_power_of_2(rows))

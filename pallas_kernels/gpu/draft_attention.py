"""DFlash draft attention on GPUs: a block of queries over paged context K/V plus the block's own
K/V, the kernel behind ``paged_draft_attention_reference`` (``pallas_kernels.attention``, where the
semantics and the argument checks live).

The kernel is verify_attention's paged online softmax (same grid, page loop and context split)
followed, in the last split, by one more softmax step over the block's own K/V tile, so context
and block keys are merged in one pass without writing the block to the cache.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import check_paged_args, check_sliding_window
from pallas_kernels.gpu.verify_attention import (TUNING_ARGS, attend_pages, choose_blocks, init_carry,
                                                 load_query_tile, paged_attention_call, softmax_scale,
                                                 softmax_step, store_output)
from pallas_kernels.sizes import next_power_of_2

# The block's own keys are one tile of up to this many tokens.
MAX_BLOCK = 128


def block_tile(block: int) -> int:
    """Rows in which the kernel loads the block's own K and V: the block padded to a power of
    two, at least 16 (Triton's smallest dot)."""
    return max(16, next_power_of_2(block))


def _draft_kernel(ctx_ref, blen_ref, pt_ref, q_ref, k_ref, v_ref, bk_ref, bv_ref, o_ref, *lse_refs,
                  q_len: int, block_t: int, pages_per_block: int, num_splits: int,
                  sliding_window: int | None, causal: bool):
    split, tile, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, group, head_dim = q_ref.shape
    rows = block_t * group
    t0 = tile * block_t
    context = ctx_ref[b]
    t = t0 + lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    q = load_query_tile(q_ref, t0, block_t, q_len)
    scale = softmax_scale(head_dim)
    capacity = pt_ref.shape[0] * k_ref.shape[1]
    if sliding_window is None:
        kv_begin, row_lo = 0, None
    else:
        kv_begin = jnp.maximum(context + t0 - sliding_window + 1, 0)
        row_lo = context + t - sliding_window
    carry = attend_pages(q, k_ref, v_ref, pt_ref, init_carry(rows, head_dim), kv_begin=kv_begin,
                         kv_end=jnp.minimum(context, capacity), row_end=None, row_lo=row_lo,
                         split=split, num_splits=num_splits, pages_per_block=pages_per_block,
                         scale=scale)

    # The block's own keys belong to the last split. Every program runs the step, the others with
    # no key visible and their loads masked off: cheaper than branching on the split (H100,
    # 2026-11-26: the 134 MB draft cells 0.6-0.8 µs faster per call than with lax.cond).
    block = bk_ref.shape[0]
    tile_k = block_tile(block)
    j = lax.broadcasted_iota(jnp.int32, (tile_k,), 0)
    real = (j < jnp.minimum(blen_ref[b], block)) & (split == num_splits - 1)
    mask = jnp.broadcast_to(real[:, None], (tile_k, head_dim))
    k = plgpu.load(bk_ref.at[pl.ds(0, tile_k)], mask=mask, other=0)
    v = plgpu.load(bv_ref.at[pl.ds(0, tile_k)], mask=mask, other=0)
    visible = real[None, :]
    distance = t[:, None] - j[None, :]
    if causal:
        visible = visible & (distance >= 0)
    if sliding_window is not None:
        visible = visible & (distance < sliding_window)
        if not causal:
            visible = visible & (-distance < sliding_window)
    carry = softmax_step(carry, q, k, v, visible, scale)
    store_output(o_ref, lse_refs, carry, t0, block_t, q_len)


@functools.partial(jax.jit, static_argnames=("sliding_window", "causal", "interpret",
                                             *TUNING_ARGS))
def paged_draft_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                          page_table: jax.Array, context_lens: jax.Array, block_k: jax.Array,
                          block_v: jax.Array, block_lens: jax.Array | None = None, *,
                          sliding_window: int | None = None, causal: bool = False,
                          sinks: jax.Array | None = None, interpret: bool = False, block_t: int | None = None,
                          pages_per_block: int | None = None, num_splits: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          pallas_merge: bool | None = None) -> jax.Array:
    """Pallas version of ``paged_draft_attention_reference`` (same arguments and result).

    One kernel: paged context and the block's own K/V (cast to the pages' dtype) share one
    online softmax. Tuning keywords as in ``paged_verify_attention``.
    """
    check_paged_args(q, k_pages, v_pages, page_table, context_lens, "context_lens")
    batch, block = q.shape[:2]
    kv_shape = (batch, block, k_pages.shape[2], q.shape[3])
    for name, x in (("block_k", block_k), ("block_v", block_v)):
        if x.shape != kv_shape:
            raise ValueError(f"{name} must be [batch, T, kv_heads, head_dim] = {kv_shape}, "
                             f"got {x.shape}")
    if block > MAX_BLOCK:
        raise ValueError(f"q block length T must be <= {MAX_BLOCK}, got {block}")
    if block_lens is None:
        block_lens = jnp.full((batch,), block, jnp.int32)
    elif block_lens.shape != (batch,) or not jnp.issubdtype(block_lens.dtype, jnp.integer):
        raise ValueError(f"block_lens must be an integer [batch={batch}] array, got "
                         f"{block_lens.dtype} {block_lens.shape}")
    check_sliding_window(sliding_window)
    # the block's own K and V of one KV head stay in shared memory beside the query tile, as
    # the tile the kernel loads them in
    block_kv_bytes = 2 * block_tile(block) * q.shape[3] * k_pages.dtype.itemsize
    blocks = choose_blocks(q, k_pages, page_table, block_kv_bytes, block_t=block_t,
                           pages_per_block=pages_per_block, num_splits=num_splits,
                           num_warps=num_warps, num_stages=num_stages, pallas_merge=pallas_merge)
    kernel = functools.partial(_draft_kernel, q_len=block, block_t=blocks.block_t,
                               pages_per_block=blocks.pages_per_block,
                               num_splits=blocks.num_splits, sliding_window=sliding_window,
                               causal=causal)
    return paged_attention_call(
        kernel, q, k_pages, v_pages, page_table, [context_lens, block_lens],
        [block_k.astype(k_pages.dtype), block_v.astype(v_pages.dtype)], blocks,
        interpret=interpret, name="paged_draft_attention", sinks=sinks)

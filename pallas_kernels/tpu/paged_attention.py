"""Paged attention on TPUs (Mosaic): the target's causal verify/decode/prefill attention and the
draft's non-causal block attention, one kernel for both.

Same semantics and arguments as ``paged_verify_attention_reference`` and
``paged_draft_attention_reference`` (``pallas_kernels.attention``: the references and argument
checks both backends share). Pages keep the one layout ``[num_pages, page_size, kv_heads, head_dim]``.

One program per (sequence, query tile). Its rows are ``block_t`` query tokens times every query
head (row ``r``: token ``r // Hq``, head ``r % Hq``). A loop runs over the pages its rows can see
(ragged lengths, sliding window), ``pages_per_block`` pages a step, each page copied whole (every
KV head) from HBM into a double-buffered VMEM block by its own DMA while the previous block is in
the online softmax. The block is viewed as ``[pages * page_size * kv_heads, head_dim]`` key rows
(key ``c``: position ``c // kv_heads``, head ``c % kv_heads``) and each query row keeps the keys
of its own KV head by a mask: no strided loads (Mosaic has none for 16-bit data), at the price
of ``kv_heads`` times the score FLOPs, which leaves memory-bound decode and verify steps
memory-bound (docs/tpu.md counts it). The draft's own block K/V (never written to the pages)
join as one more step. jax's ``ragged_paged_attention`` was not used: it needs K and V
interleaved in one pool and has neither gpt-oss sinks nor the non-causal block.

Keys a row cannot see are masked to -inf and their values zeroed, so unused or NaN-poisoned
pages never reach the output; page ids outside the pool are never copied.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention import check_paged_args, check_sliding_window
from pallas_kernels.tpu.dma import guarded

# Target rows (query tokens x query heads) per program and keys (tokens x KV heads) per step.
ROWS_PER_TILE = 256
KEYS_PER_STEP = 1024


def choose_blocks(q_len: int, q_heads: int, page_size: int, kv_heads: int, pages_per_seq: int,
                  dtype) -> tuple[int, int]:
    """(block_t, pages_per_block): query tokens per program (all of them when they fit
    ROWS_PER_TILE rows; otherwise a tile whose rows fill whole (16, 128) bf16 tiles) and pages
    per softmax step (about KEYS_PER_STEP key rows)."""
    if q_len * q_heads <= ROWS_PER_TILE:
        block_t = q_len
    else:
        sublanes = 16 if jnp.dtype(dtype).itemsize < 4 else 8
        step = sublanes // math.gcd(sublanes, q_heads)
        block_t = max(step, (ROWS_PER_TILE // q_heads) // step * step)
    pages_per_block = max(1, min(pages_per_seq, KEYS_PER_STEP // (page_size * kv_heads)))
    return block_t, pages_per_block


def vmem_capacity() -> int | None:
    """VMEM bytes of one TensorCore of the TPU being compiled for (``jax.default_device`` or the
    first device); None off TPUs (interpret mode)."""
    try:
        return pltpu.get_tpu_info().vmem_capacity_bytes
    except ValueError:
        return None


def vmem_estimate(rows: int, head_dim: int, keys_per_step: int, block_keys: int, itemsize: int) -> int:
    """Bytes of VMEM a program holds: the double-buffered K/V page blocks, the query and output
    tiles (double-buffered by the pipeline), the draft block's K/V, the f32 scores with their
    masks and weights (about three of them live at once) and the accumulator."""
    pages = 2 * 2 * keys_per_step * head_dim * itemsize
    tiles = 2 * 2 * rows * head_dim * itemsize + 2 * 2 * block_keys * head_dim * itemsize
    return pages + tiles + 3 * rows * max(keys_per_step, block_keys) * 4 + 2 * rows * head_dim * 4


def _paged_kernel(start_ref, kv_len_ref, block_len_ref, pt_ref,  # scalar prefetch (SMEM)
                  q_ref, sink_ref, *refs, q_len: int, block_t: int, q_heads: int, kv_heads: int,
                  page_size: int, pages_per_block: int, num_pages: int, sliding_window: int | None,
                  with_block: bool, causal_block: bool):
    if with_block:
        bk_ref, bv_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems = refs
    else:
        k_hbm, v_hbm, o_ref, k_buf, v_buf, sems = refs
    b, tile = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    group = q_heads // kv_heads
    pages_per_seq = pt_ref.shape[1]
    step_tokens = pages_per_block * page_size
    scale = head_dim ** -0.5

    start = start_ref[b]          # position of query token 0
    kv_len = kv_len_ref[b]        # paged keys at positions [0, kv_len) exist
    first_t = tile * block_t
    last_t = jnp.minimum(first_t + block_t, q_len) - 1
    hi = jnp.minimum(kv_len, start + last_t + 1)  # past the tile's last visible key
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(0, start + first_t - sliding_window + 1)
    step_lo = lo // step_tokens
    step_hi = jnp.where(hi > lo, (hi + step_tokens - 1) // step_tokens, step_lo)

    def page_wanted(step, i):
        """Whether page i of a step is copied (one the rows can see, with an id in the pool) and its id."""
        page = step * pages_per_block + i
        page_id = pt_ref[b, jnp.minimum(page, pages_per_seq - 1)]
        wanted = ((page < pages_per_seq) & (page * page_size < hi) & ((page + 1) * page_size > lo)
                  & (page_id >= 0) & (page_id < num_pages))
        return wanted, jnp.clip(page_id, 0, num_pages - 1)

    def page_copies(step, slot):
        for i in range(pages_per_block):
            wanted, page_id = page_wanted(step, i)
            yield wanted, [pltpu.make_async_copy(hbm.at[page_id], buf.at[slot, i], sems.at[kv, slot, i])
                           for kv, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def start_step(step, slot):
        for wanted, copies in page_copies(step, slot):
            guarded(wanted, copies, "start")

    def wait_step(step, slot):
        for wanted, copies in page_copies(step, slot):
            guarded(wanted, copies, "wait")

    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    row_t = first_t + row // q_heads
    row_head = (row % q_heads) // group
    q_pos = start + row_t
    q = q_ref[...]

    # Explicit precision: f32 exactly; 16-bit inputs in one MXU pass whatever jax's default
    # matmul precision says (Mosaic refuses HIGHEST for bf16 operands).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    def softmax_step(carry, k, v, key_head, visible, key_real):
        acc, m, l = carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale
        visible &= key_head == row_head
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        v = jnp.where(key_real, v, jnp.zeros_like(v))
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return alpha * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True)

    keys_per_step = step_tokens * kv_heads

    def body(step, carry):
        slot = (step - step_lo) % 2

        @pl.when(step + 1 < step_hi)
        def _():
            start_step(step + 1, 1 - slot)

        wait_step(step, slot)
        k = k_buf[slot].reshape(keys_per_step, head_dim)
        v = v_buf[slot].reshape(keys_per_step, head_dim)
        col = lax.broadcasted_iota(jnp.int32, (1, keys_per_step), 1)
        key_pos = step * step_tokens + col // kv_heads
        visible = (key_pos <= q_pos) & (key_pos < kv_len)
        if sliding_window is not None:
            visible &= q_pos - key_pos < sliding_window
        # Keys of pages not copied (a padded query's page past the table, an id outside the pool)
        # hold whatever the buffer held: their values are zeroed so that p = 0 cannot meet a NaN.
        key_page = lax.broadcasted_iota(jnp.int32, (keys_per_step, 1), 0) // (page_size * kv_heads)
        key_real = functools.reduce(jnp.logical_or, [(key_page == i) & page_wanted(step, i)[0]
                                                     for i in range(pages_per_block)])
        return softmax_step(carry, k, v, col % kv_heads, visible, key_real)

    sink = sink_ref[...]
    carry = (jnp.zeros((rows, head_dim), jnp.float32), sink,
             jnp.where(sink == -jnp.inf, 0.0, 1.0).astype(jnp.float32))

    @pl.when(step_hi > step_lo)
    def _():
        start_step(step_lo, 0)

    carry = lax.fori_loop(step_lo, step_hi, body, carry)

    if with_block:  # the draft block's own keys at positions kv_len + t'
        block_keys = bk_ref.shape[0]
        col = lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
        t_key = col // kv_heads
        visible = t_key < block_len_ref[b]
        if causal_block:
            visible &= t_key <= row_t
        if sliding_window is not None:
            visible &= row_t - t_key < sliding_window
            if not causal_block:
                visible &= t_key - row_t < sliding_window
        t_real = lax.broadcasted_iota(jnp.int32, (block_keys, 1), 0) // kv_heads
        carry = softmax_step(carry, bk_ref[...], bv_ref[...], col % kv_heads, visible,
                             t_real < block_len_ref[b])

    acc, _, l = carry
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _paged_call(q, k_pages, v_pages, page_table, start, kv_len, block_lens, block_k, block_v, *,
                sliding_window, causal_block, sinks, interpret, block_t, pages_per_block, name):
    batch, q_len, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    auto_t, auto_ppb = choose_blocks(q_len, q_heads, page_size, kv_heads, pages_per_seq, q.dtype)
    block_t = block_t or auto_t
    pages_per_block = pages_per_block or auto_ppb
    tiles = -(-q_len // block_t)
    padded = tiles * block_t
    if padded != q_len:
        q = jnp.pad(q, ((0, 0), (0, padded - q_len), (0, 0), (0, 0)))
    rows = block_t * q_heads
    q_rows = q.reshape(batch, padded * q_heads, head_dim)
    if sinks is None:
        sink_rows = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    else:
        sink_rows = jnp.tile(sinks.astype(jnp.float32), block_t).reshape(rows, 1)
    with_block = block_k is not None
    in_specs = [pl.BlockSpec((None, rows, head_dim), lambda b, i, *_: (b, i, 0)),
                pl.BlockSpec((rows, 1), lambda b, i, *_: (0, 0))]
    operands = [q_rows, sink_rows]
    if with_block:
        block_rows = block_k.shape[1] * kv_heads
        for x in (block_k, block_v):
            in_specs.append(pl.BlockSpec((None, block_rows, head_dim), lambda b, i, *_: (b, 0, 0)))
            operands.append(x.astype(k_pages.dtype).reshape(batch, block_rows, head_dim))
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
    operands += [k_pages, v_pages]
    buf = pltpu.VMEM((2, pages_per_block, page_size, kv_heads, head_dim), k_pages.dtype)
    kernel = functools.partial(
        _paged_kernel, q_len=q_len, block_t=block_t, q_heads=q_heads, kv_heads=kv_heads, page_size=page_size,
        pages_per_block=pages_per_block, num_pages=num_pages, sliding_window=sliding_window,
        with_block=with_block, causal_block=causal_block)
    if block_lens is None:
        block_lens = jnp.zeros((batch,), jnp.int32)
    needed = vmem_estimate(rows, head_dim, pages_per_block * page_size * kv_heads,
                           block_k.shape[1] * kv_heads if with_block else 0, jnp.dtype(k_pages.dtype).itemsize)
    capacity = None if interpret else vmem_capacity()
    if capacity is not None and needed > capacity * 3 // 4:
        raise ValueError(f"{name}: block_t={block_t} query tokens x {q_heads} heads and pages_per_block="
                         f"{pages_per_block} pages of {page_size} tokens x {kv_heads} KV heads need about "
                         f"{needed / 2**20:.0f} MiB of VMEM, more than 3/4 of the {capacity / 2**20:.0f} MiB "
                         "this TPU has: take smaller blocks")
    limit = None if capacity is None else min(capacity * 3 // 4, max(32 * 2**20, 2 * needed))
    kv_bytes = 2 * batch * page_table.shape[1] * page_size * kv_heads * head_dim * jnp.dtype(k_pages.dtype).itemsize
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(batch, tiles), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, rows, head_dim), lambda b, i, *_: (b, i, 0)),
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2, pages_per_block))]),
        out_shape=jax.ShapeDtypeStruct((batch, padded * q_heads, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=limit),
        # Bytes: every page the table can name, read once (an upper bound: the pages past a
        # sequence's length are skipped), the queries and the output. FLOPs: the masked scores
        # and weighted values over those keys, every KV head's (the GQA mask).
        cost_estimate=pl.CostEstimate(
            flops=4 * batch * padded * q_heads * page_table.shape[1] * page_size * kv_heads * head_dim,
            transcendentals=batch * padded * q_heads * page_table.shape[1] * page_size * kv_heads,
            bytes_accessed=kv_bytes + 2 * q.size * q.dtype.itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(start.astype(jnp.int32), kv_len.astype(jnp.int32), block_lens.astype(jnp.int32),
      page_table.astype(jnp.int32), *operands)
    return out.reshape(batch, padded, q_heads, head_dim)[:, :q_len]


@functools.partial(jax.jit, static_argnames=("sliding_window", "interpret", "block_t", "pages_per_block"))
def paged_verify_attention(q, k_pages, v_pages, page_table, start, *, sliding_window=None, sinks=None,
                           interpret=False, block_t=None, pages_per_block=None):
    """TPU version of ``paged_verify_attention_reference`` (same arguments and result)."""
    check_paged_args(q, k_pages, v_pages, page_table, start, "start")
    check_sliding_window(sliding_window)
    return _paged_call(q, k_pages, v_pages, page_table, start, start + q.shape[1], None, None, None,
                       sliding_window=sliding_window, causal_block=False, sinks=sinks, interpret=interpret,
                       block_t=block_t, pages_per_block=pages_per_block, name="tpu_paged_verify_attention")


@functools.partial(jax.jit, static_argnames=("sliding_window", "causal", "interpret", "block_t",
                                             "pages_per_block"))
def paged_draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v, block_lens=None, *,
                          sliding_window=None, causal=False, sinks=None, interpret=False, block_t=None,
                          pages_per_block=None):
    """TPU version of ``paged_draft_attention_reference`` (same arguments and result)."""
    check_paged_args(q, k_pages, v_pages, page_table, context_lens, "context_lens")
    check_sliding_window(sliding_window)
    if block_k.shape[:2] != q.shape[:2] or block_k.shape != block_v.shape:
        raise ValueError(f"block_k/block_v {block_k.shape}/{block_v.shape} must be [batch, T, kv_heads, head_dim] "
                         f"with q's batch and T {q.shape[:2]}")
    if block_lens is None:
        block_lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    return _paged_call(q, k_pages, v_pages, page_table, context_lens, context_lens, block_lens, block_k, block_v,
                       sliding_window=sliding_window, causal_block=causal, sinks=sinks, interpret=interpret,
                       block_t=block_t, pages_per_block=pages_per_block, name="tpu_paged_draft_attention")

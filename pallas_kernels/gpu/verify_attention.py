"""Causal attention of 1..T new query tokens per sequence over its paged KV (verify, decode, prefill)
on GPUs: the kernel behind ``paged_verify_attention_reference`` (``pallas_kernels.attention``, where
the semantics and the argument checks live).

The kernel (Pallas, Triton lowering) runs one program per (context split, query tile, sequence,
KV head). A program holds the rows of every query head of its KV head for ``block_t`` query
tokens (``rows = block_t * group``, GQA shares each K/V tile across the group; a group that is not
a power of two rides padded with zero queries, ``padded_group``) and streams the
sequence's pages through an online softmax, ``pages_per_block`` pages per step, reading only the
pages its rows can see (ragged lengths, sliding window). When batch x heads is too small to fill
the GPU the context is split over ``num_splits`` programs whose partial results are merged by
log-sum-exp (``split_merge``: a Pallas kernel, or plain XLA for small merges). The page loop and
the softmax step here are shared with ``draft_attention``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import check_paged_args, check_sliding_window
from pallas_kernels.gpu.split_merge import combine_splits
from pallas_kernels.gpu.tuning import AttentionBlocks, attention_blocks
from pallas_kernels.sizes import is_power_of_2, next_power_of_2
from pallas_kernels.split_merge import combine_splits_reference

TUNING_ARGS = ("block_t", "pages_per_block", "num_splits", "num_warps", "num_stages", "pallas_merge")


# ---------------------------------------------------------------------------------------------
# Kernel pieces shared with draft_attention.


def _iota(shape: int | tuple[int, ...], dim: int = 0) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (shape,) if isinstance(shape, int) else shape, dim)


def softmax_step(carry, q, k, v, visible, scale):
    """One online-softmax update of (acc [R, D], m [R], l [R]) by keys k, v [N, D].

    Statistics live in the log2 domain (``scale`` includes log2(e)); masked scores are -inf and
    a row that has seen nothing keeps m = -inf, l = 0 (it comes out as zeros, like the reference).
    ``visible`` None: every row sees every key. f32 inputs use full-precision dots (Triton would
    otherwise use TF32).
    """
    acc, m, l = carry
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_safe[:, None])
    alpha = jnp.exp2(m - m_safe)
    rounded = p.astype(v.dtype)
    pv = lax.dot_general(rounded, v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    # In f16 (largest value 65504) the normalizer sums the weights as the product used them, so
    # the output is a convex combination of v and cannot round past its largest value to inf.
    # bf16 keeps the f32 sum: the rounded one cost the 64-row kernels 5% on an H200 (2026-11-26).
    weights = rounded.astype(jnp.float32) if v.dtype == jnp.float16 else p
    return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(weights, axis=1)


def attend_pages(q, k_ref, v_ref, pt_ref, carry, *, kv_begin, kv_end, row_end, row_lo, split,
                 num_splits, pages_per_block, scale):
    """Run the online softmax over the paged keys at positions [kv_begin, kv_end).

    k_ref, v_ref: [num_pages, page_size, D] (one KV head); pt_ref: [pages_per_seq] (one
    sequence). Steps cover ``pages_per_block`` pages starting at the page holding kv_begin; the
    steps are divided evenly among ``num_splits`` programs and this one runs part ``split``.
    Nothing outside [kv_begin, kv_end) or past the page table is read (the edge steps mask their
    loads per token). Row r sees key position p iff row_lo[r] < p < row_end[r] (either bound may
    be None; ``kv_begin`` is the Python int 0 when there is no window).

    Steps whose keys every row sees run in a loop of their own with no masks: no per-token
    bounds, no score masking (H200: verify and draft 8-20% faster on long contexts). Only the
    steps at the edges (the causal diagonal, a sliding window's start, a ragged end) are masked.
    """
    num_pages, page_size, head_dim = k_ref.shape
    block_k = pages_per_block * page_size
    base = kv_begin // page_size * page_size  # first position of the first step
    num_steps = jnp.maximum(kv_end - base + block_k - 1, 0) // block_k
    per_split = (num_steps + num_splits - 1) // num_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_steps)
    offsets = _iota(block_k)
    d = _iota((1, head_dim), 1)

    def positions(step):
        pos = base + step * block_k + offsets
        return pos, (pos >= kv_begin) & (pos < kv_end)

    def page_ids(step):
        pos, in_range = positions(step)
        return plgpu.load(pt_ref.at[pos // page_size], mask=in_range, other=0)

    def loop_body(masked: bool):
        def body(step, state):
            carry, ids = state
            # The next step's page ids are read a step ahead: the K/V addresses of a step then
            # never wait on a page-table read (H200: 2-10% faster, most at full batch).
            next_ids = page_ids(step + 1)
            pos, in_range = positions(step)
            if masked:
                ok = in_range & (ids >= 0) & (ids < num_pages)
                mask = jnp.broadcast_to(ok[:, None], (block_k, head_dim))
                visible = ok[None, :]
                if row_end is not None:
                    visible = visible & (pos[None, :] < row_end[:, None])
                if row_lo is not None:
                    visible = visible & (pos[None, :] > row_lo[:, None])
            else:  # in bounds by construction; a corrupt page table cannot send a read outside
                ids, mask, visible = jnp.clip(ids, 0, num_pages - 1), None, None
            index = (ids[:, None], (pos % page_size)[:, None], d)
            k = plgpu.load(k_ref.at[index], mask=mask, other=None if mask is None else 0)
            v = plgpu.load(v_ref.at[index], mask=mask, other=None if mask is None else 0)
            return softmax_step(carry, q, k, v, visible, scale), next_ids
        return body

    # Steps [first_clean, end_clean) are visible to every row in full.
    clean_begin = kv_begin if row_lo is None else jnp.maximum(kv_begin, jnp.max(row_lo) + 1)
    clean_end = kv_end if row_end is None else jnp.minimum(kv_end, jnp.min(row_end))
    first_clean = jnp.clip((clean_begin - base + block_k - 1) // block_k, lo, hi)
    end_clean = jnp.clip((clean_end - base) // block_k, first_clean, hi)
    state = (carry, page_ids(lo))
    if not (isinstance(kv_begin, int) and kv_begin == 0 and row_lo is None):  # else first_clean == lo
        state = lax.fori_loop(lo, first_clean, loop_body(masked=True), state)
    state = lax.fori_loop(first_clean, end_clean, loop_body(masked=False), state)
    state = lax.fori_loop(end_clean, hi, loop_body(masked=True), state)
    return state[0]


def init_carry(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def load_query_tile(q_ref, t0, block_t: int, q_len: int) -> jax.Array:
    """Rows (t, g) -> t * group + g of the query tile [t0, t0 + block_t): [block_t * group, D]."""
    _, group, head_dim = q_ref.shape
    t_ok = t0 + _iota(block_t) < q_len
    mask = jnp.broadcast_to(t_ok[:, None, None], (block_t, group, head_dim))
    q = plgpu.load(q_ref.at[pl.ds(t0, block_t)], mask=mask, other=0)
    return q.reshape(block_t * group, head_dim)


def store_output(o_ref, lse_refs, carry, t0, block_t: int, q_len: int) -> None:
    """Write the normalized rows (and, when the context is split, their log2-sum-exp)."""
    acc, m, l = carry
    rows, head_dim = acc.shape
    group = rows // block_t
    t_ok = t0 + _iota(block_t) < q_len
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).reshape(block_t, group, head_dim)
    plgpu.store(o_ref.at[pl.ds(t0, block_t)], out.astype(o_ref.dtype),
                mask=jnp.broadcast_to(t_ok[:, None, None], out.shape))
    for lse_ref in lse_refs:
        lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        plgpu.store(lse_ref.at[pl.ds(t0, block_t)], lse.reshape(block_t, group),
                    mask=jnp.broadcast_to(t_ok[:, None], (block_t, group)))


def softmax_scale(head_dim: int) -> float:
    return head_dim ** -0.5 * math.log2(math.e)


def padded_group(q_heads: int, kv_heads: int) -> int:
    """Query heads per KV head as the kernels hold them: a group that is not a power of two
    (Qwen3-14B: 40 over 8) is padded with zero queries up to one, whose rows are dropped."""
    return next_power_of_2(q_heads // kv_heads)


def choose_blocks(q, k_pages, page_table, extra_smem_bytes: int = 0, **tuning) -> AttentionBlocks:
    """The tuning rule's blocks (overridden by any tuning keyword given), validated."""
    batch, q_len, q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1:3]
    group = padded_group(q_heads, kv_heads)
    blocks = attention_blocks(q_len=q_len, group=group, head_dim=head_dim, page_size=page_size,
                              pages_per_seq=page_table.shape[1], batch=batch, kv_heads=kv_heads,
                              itemsize=q.dtype.itemsize, extra_smem_bytes=extra_smem_bytes, **tuning)
    rows = blocks.block_t * group
    if not is_power_of_2(rows) or rows < 16:
        raise ValueError(f"block_t * group must be a power of two >= 16, got "
                         f"{blocks.block_t} * {group}")
    block_k = blocks.pages_per_block * page_size
    if not is_power_of_2(block_k) or block_k < 16:
        raise ValueError(f"pages_per_block * page_size must be a power of two >= 16, got "
                         f"{blocks.pages_per_block} * {page_size}")
    if blocks.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {blocks.num_splits}")
    return blocks


def paged_attention_call(kernel, q, k_pages, v_pages, page_table, seq_scalars, block_kv,
                         blocks: AttentionBlocks, *, interpret: bool, name: str,
                         sinks: jax.Array | None = None) -> jax.Array:
    """Launch a paged attention kernel over grid (split, query tile, sequence, KV head).

    Kernel refs, in order: one [batch] ref per ``seq_scalars`` array, the page table row
    [pages_per_seq], the query tile source [T, group, D], k/v pages [P, S, D] of one head, one
    [T_kv, D] ref per ``block_kv`` array ([B, T_kv, Hkv, D]), the output [T, group, D] and, when
    the context is split or there are ``sinks`` [Hq], the log2-sum-exp [T, group]. Sinks enter
    in the merge, as one more split of weight 2^(sink log2 e) and no value (XLA's merge).
    """
    batch, q_len, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = padded_group(q_heads, kv_heads)
    splits = blocks.num_splits
    grid = (splits, pl.cdiv(q_len, blocks.block_t), batch, kv_heads)
    q5 = q.reshape(batch, q_len, kv_heads, q_heads // kv_heads, head_dim)
    q5 = jnp.pad(q5, ((0, 0), (0, 0), (0, 0), (0, group - q5.shape[3]), (0, 0)))

    seq_spec = pl.BlockSpec((batch,), lambda s, i, b, h: (0,))
    pt_spec = pl.BlockSpec((None, page_table.shape[1]), lambda s, i, b, h: (b, 0))
    q_spec = pl.BlockSpec((None, q_len, None, group, head_dim), lambda s, i, b, h: (b, 0, h, 0, 0))
    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda s, i, b, h: (0, 0, h, 0))
    block_specs = [pl.BlockSpec((None, x.shape[1], None, head_dim), lambda s, i, b, h: (b, 0, h, 0))
                   for x in block_kv]
    if splits == 1 and sinks is None:
        out_shape = [jax.ShapeDtypeStruct(q5.shape, q.dtype)]
        out_specs = [q_spec]
    else:
        # Partial outputs in q's dtype (normalized, so bf16 costs one extra rounding) halve the
        # traffic of the merge; the log-sum-exp stays f32.
        out_shape = [jax.ShapeDtypeStruct((splits, *q5.shape), q.dtype),
                     jax.ShapeDtypeStruct((splits, *q5.shape[:-1]), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, q_len, None, group, head_dim),
                         lambda s, i, b, h: (s, b, 0, h, 0, 0)),
            pl.BlockSpec((None, None, q_len, None, group), lambda s, i, b, h: (s, b, 0, h, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[seq_spec] * len(seq_scalars) + [pt_spec, q_spec, kv_spec, kv_spec] + block_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*[x.astype(jnp.int32) for x in seq_scalars], page_table, q5, k_pages, v_pages, *block_kv)
    if sinks is not None:
        per_group = sinks.astype(jnp.float32).reshape(kv_heads, q_heads // kv_heads) * math.log2(math.e)
        per_group = jnp.pad(per_group, ((0, 0), (0, group - per_group.shape[1])), constant_values=-jnp.inf)
        out = combine_splits_reference(*outs, sink=per_group)
    elif splits == 1:
        out = outs[0]
    elif blocks.pallas_merge:
        out = combine_splits(*outs, interpret=interpret)
    else:
        out = combine_splits_reference(*outs)
    return out[:, :, :, :q_heads // kv_heads].reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# Verify / decode / prefill kernel.


def _verify_kernel(start_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, *lse_refs, q_len: int,
                   block_t: int, pages_per_block: int, num_splits: int,
                   sliding_window: int | None):
    split, tile, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, group, head_dim = q_ref.shape
    t0 = tile * block_t
    start = start_ref[b]
    q_pos = start + t0 + _iota(block_t * group) // group
    last_t = jnp.minimum(t0 + block_t, q_len) - 1
    capacity = pt_ref.shape[0] * k_ref.shape[1]
    if sliding_window is None:
        kv_begin, row_lo = 0, None
    else:
        kv_begin, row_lo = jnp.maximum(start + t0 - sliding_window + 1, 0), q_pos - sliding_window
    carry = attend_pages(
        load_query_tile(q_ref, t0, block_t, q_len), k_ref, v_ref, pt_ref,
        init_carry(block_t * group, head_dim),
        kv_begin=kv_begin, kv_end=jnp.minimum(start + last_t + 1, capacity), row_end=q_pos + 1,
        row_lo=row_lo, split=split, num_splits=num_splits, pages_per_block=pages_per_block,
        scale=softmax_scale(head_dim))
    store_output(o_ref, lse_refs, carry, t0, block_t, q_len)


@functools.partial(jax.jit, static_argnames=("sliding_window", "interpret", *TUNING_ARGS))
def paged_verify_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, start: jax.Array, *,
                           sliding_window: int | None = None, sinks: jax.Array | None = None,
                           interpret: bool = False, block_t: int | None = None, pages_per_block: int | None = None,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, pallas_merge: bool | None = None) -> jax.Array:
    """Pallas version of ``paged_verify_attention_reference`` (same arguments and result).

    Tuning keywords default to ``tuning.attention_blocks``: block_t query tokens per program,
    pages_per_block pages per softmax step, num_splits context partitions, Triton num_warps and
    num_stages, and whether a split context is merged by the Pallas kernel (pallas_merge).
    """
    check_paged_args(q, k_pages, v_pages, page_table, start, "start")
    check_sliding_window(sliding_window)
    blocks = choose_blocks(q, k_pages, page_table, block_t=block_t,
                           pages_per_block=pages_per_block, num_splits=num_splits,
                           num_warps=num_warps, num_stages=num_stages, pallas_merge=pallas_merge)
    kernel = functools.partial(_verify_kernel, q_len=q.shape[1], block_t=blocks.block_t,
                               pages_per_block=blocks.pages_per_block,
                               num_splits=blocks.num_splits, sliding_window=sliding_window)
    return paged_attention_call(kernel, q, k_pages, v_pages, page_table, [start], [], blocks,
                                interpret=interpret, name="paged_verify_attention", sinks=sinks)

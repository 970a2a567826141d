"""The merge of a split context (``combine_splits_reference``, in ``pallas_kernels.split_merge``,
with its math) as one Pallas kernel (Triton lowering).

The kernel is one launch whose programs each load ``block_rows`` rows of every split at once.
After an attention kernel, plain XLA needs two to four small kernels for the same sum: 3-6 µs per
call in #4's 134 MB cells, against 2-3 µs for this kernel (benchmarks/RESULTS.md, 2026-11-22 and
2026-11-26). XLA still merges small splits, which it fuses with their neighbours
(``tuning.attention_blocks`` picks).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu.tuning import check_launch, check_positive
from pallas_kernels.sizes import is_power_of_2, next_power_of_2

# Elements of o one program loads (every split of its rows at once): 128 programs, about one per
# SM, for Qwen3-8B verify and draft in the 134 MB cells (16 splits x 512 rows, 2 splits x 4096
# rows, head_dim 128); decode at bs 1 (33 splits, padded to 64, of 32 rows) gets 32 one-row
# programs. Loading 4096 or 16384 elements per program, or with 2 or 8 warps, was no faster
# (H200, 2026-11-26).
ELEMENTS_PER_PROGRAM = 8192


def merge_block_rows(splits: int, rows: int, head_dim: int) -> int:
    """Rows per program: ``ELEMENTS_PER_PROGRAM`` elements of o over every split (padded to a
    power of two), a power of two between 1 and the rows rounded up."""
    fitting = ELEMENTS_PER_PROGRAM // (next_power_of_2(splits) * head_dim)
    largest_power_of_2 = 1 << (fitting.bit_length() - 1) if fitting else 1
    return min(next_power_of_2(rows), largest_power_of_2)


def _combine_kernel(o_ref, lse_ref, out_ref, *, block_rows: int):
    splits, rows, head_dim = o_ref.shape
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (1, block_rows), 1)
    split = lax.broadcasted_iota(jnp.int32, (next_power_of_2(splits), 1), 0)
    present = (split < splits) & (row < rows)                                   # [S', R]
    lse = plgpu.load(lse_ref.at[split, row], mask=present, other=-jnp.inf)      # [S', R]
    d = lax.broadcasted_iota(jnp.int32, (1, 1, head_dim), 2)
    o = plgpu.load(o_ref.at[split[:, :, None], row[:, :, None], d],
                   mask=jnp.broadcast_to(present[:, :, None], (*present.shape, head_dim)), other=0)
    top = jnp.max(lse, axis=0)                                                  # [R]
    weights = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top)[None, :])    # 0 where lse = -inf
    denom = jnp.sum(weights, axis=0)
    out = jnp.sum(weights[:, :, None] * o.astype(jnp.float32), axis=0)         # [R, D]
    out = out / jnp.where(denom > 0, denom, 1.0)[:, None]
    plgpu.store(out_ref.at[row[0][:, None], d[0]], out.astype(out_ref.dtype),
                mask=jnp.broadcast_to(row[0][:, None] < rows, out.shape))


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows", "num_warps"))
def combine_splits(o: jax.Array, lse: jax.Array, *, interpret: bool = False,
                   block_rows: int | None = None, num_warps: int = 4) -> jax.Array:
    """Pallas version of ``combine_splits_reference`` (same arguments and result).

    block_rows: rows per program (a power of two; default ``merge_block_rows``); num_warps:
    Triton warps per program.
    """
    if o.ndim < 2 or lse.shape != o.shape[:-1]:
        raise ValueError(f"o must be [splits, ..., head_dim] and lse [splits, ...] with o's leading "
                         f"shape, got o {o.shape} and lse {lse.shape}")
    if lse.dtype != jnp.float32:
        raise ValueError(f"lse must be float32, got {lse.dtype}")
    head_dim = o.shape[-1]
    if not is_power_of_2(head_dim):
        raise ValueError(f"o head_dim must be a power of two, got {head_dim}")
    check_positive(block_rows=block_rows)
    check_launch(num_warps, 1)
    if block_rows is not None and not is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    splits, out_shape = o.shape[0], o.shape[1:]
    rows = math.prod(o.shape[1:-1])
    if splits == 0 or rows == 0:
        raise ValueError(f"o must hold at least one split and one row, got shape {o.shape}")
    block_rows = block_rows or merge_block_rows(splits, rows, head_dim)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, block_rows=block_rows),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[pl.BlockSpec((splits, rows, head_dim), lambda i: (0, 0, 0)),
                  pl.BlockSpec((splits, rows), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, head_dim), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, head_dim), o.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="combine_splits",
    )(o.reshape(splits, rows, head_dim), lse.reshape(splits, rows))
    return out.reshape(out_shape)

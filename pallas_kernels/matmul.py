"""Skinny matmul: x [M, K] @ w [K, N] for the few rows of decode, verify and draft steps.

With M up to a few dozen rows a projection does ~M multiply-adds per weight element, so it is
bound by streaming the weight once from memory. XLA's GEMMs for M = 1 reach 75-80% of the copy
bandwidth on an H200 (benchmarks/RESULTS.md) and some vector-matrix products turn into slow
reductions; this kernel streams the weight in ``[block_k, block_n]`` tiles, software-pipelined.

One program per (K split, row block, column block). Each walks its share of K, accumulating in
f32 on the tensor cores (x rows beyond M are masked to zero: tiles are at least 16 rows). When
there are too few column blocks to cover the GPU, K is split over ``num_splits`` programs and
their f32 partial sums are added by XLA (a fixed order, so results are deterministic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import NUM_SMS, next_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TUNING_ARGS = ("block_m", "block_n", "block_k", "num_splits", "num_warps", "num_stages")


def matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] in x's dtype (f32 accumulation)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int


def matmul_blocks(m: int, k: int, n: int, itemsize: int, *, block_m: int | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> MatmulBlocks:
    """The tiling rule (any argument given wins): rows padded to >= 16, 64-column tiles (128
    bytes of a bf16 weight row per load), the largest K tile <= 256 that divides K, and K split
    until about two programs per SM are running."""
    if block_m is None:
        block_m = min(64, max(16, next_power_of_2(m)))
    if block_n is None:
        block_n = 64
    if block_k is None:
        block_k = next((b for b in (256, 128, 64, 32, 16) if k % b == 0 and (itemsize <= 2 or b <= 128)),
                       16)
    steps = k // block_k
    if num_splits is None:
        programs = pl.cdiv(n, block_n) * pl.cdiv(m, block_m)
        num_splits = max(1, min(steps, (2 * NUM_SMS) // programs))
        while steps % num_splits:
            num_splits -= 1
    if num_stages is None:
        num_stages = 4 if itemsize <= 2 else 3
    return MatmulBlocks(block_m, block_n, block_k, num_splits, num_warps or 4, num_stages)


def _matmul_kernel(x_ref, w_ref, o_ref, *, block_m: int, block_n: int, block_k: int,
                   steps_per_split: int):
    """Refs are whole arrays: x [M, K], w [K, N], o [M, N] (this split's)."""
    split, row_block, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    (m, _), n = x_ref.shape, w_ref.shape[1]
    m0, n0 = row_block * block_m, col_block * block_n
    rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    cols_mask = None if n % block_n == 0 else jnp.broadcast_to(cols < n, (block_k, block_n))
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(step, acc):
        k0 = pl.multiple_of((split * steps_per_split + step) * block_k, block_k)
        x = plgpu.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)],
                       mask=jnp.broadcast_to(rows < m, (block_m, block_k)), other=0)
        w = plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)], mask=cols_mask,
                       other=None if cols_mask is None else 0)
        return acc + lax.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps_per_split, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                mask=(rows < m) & (cols < n))


def check_matmul_args(x: jax.Array, w: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [M, K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if x.dtype != w.dtype or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x and w must share a float32/bfloat16/float16 dtype, got {x.dtype} and {w.dtype}")
    if x.shape[1] % 16:
        raise ValueError(f"K (x.shape[1]) must be a multiple of 16, got {x.shape[1]}")


@functools.partial(jax.jit, static_argnames=("interpret", *TUNING_ARGS))
def matmul(x: jax.Array, w: jax.Array, *, interpret: bool = False, block_m: int | None = None,
           block_n: int | None = None, block_k: int | None = None, num_splits: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Pallas version of ``matmul_reference``. Tuning keywords default to ``matmul_blocks``."""
    check_matmul_args(x, w)
    (m, k), n = x.shape, w.shape[1]
    blocks = matmul_blocks(m, k, n, x.dtype.itemsize, block_m=block_m, block_n=block_n,
                           block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                           num_stages=num_stages)
    if k % blocks.block_k or (k // blocks.block_k) % blocks.num_splits:
        raise ValueError(f"block_k={blocks.block_k} x num_splits={blocks.num_splits} must divide K={k}")
    splits = blocks.num_splits
    kernel = functools.partial(_matmul_kernel, block_m=blocks.block_m, block_n=blocks.block_n,
                               block_k=blocks.block_k, steps_per_split=k // blocks.block_k // splits)
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        kernel,
        grid=(splits, pl.cdiv(m, blocks.block_m), pl.cdiv(n, blocks.block_n)),
        in_specs=[pl.BlockSpec((m, k), lambda s, i, j: (0, 0)),
                  pl.BlockSpec((k, n), lambda s, i, j: (0, 0))],
        out_specs=pl.BlockSpec((None, m, n), lambda s, i, j: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)
    return out[0] if splits == 1 else out.sum(axis=0).astype(x.dtype)

"""A decoder layer's projection with its glue in one GPU kernel: [RMSNorm] -> x @ w -> [SwiGLU] -> [+ residual],
the Pallas version (Triton lowering) of ``fused_matmul_reference`` (``pallas_kernels.fused_matmul``).

At decode and verify sizes (up to a few dozen rows) a projection streams its weight once and is
memory-bound; around the four projections of a layer XLA runs a dozen 1-4 µs elementwise
kernels (norm statistics, normalize, SiLU gate, residual add), about 1 ms of a 4.8 ms bs-1
decode step on the H200 (benchmarks/RESULTS.md). Here they ride along with the weight stream:

- ``norm_weight``: each program first sums its rows' squares over all of x (x is small: M x K,
  read from L2), then normalizes every x tile on the way into the product exactly as
  ``rms_norm`` does (f32 statistics, cast to x's dtype, times the weight);
- ``gated``: w is [K, 2N] (gate | up, as ``LayerParams.gate_up_proj``); a program reads the
  matching gate and up tiles and writes silu(gate) * up, [M, N];
- ``residual``: added to the f32 product before the one rounding to x's dtype.

One program per (K split, row block, column block) walks its share of K in ``[block_k,
block_n]`` weight tiles, software-pipelined, accumulating in f32 on the tensor cores (rows past M
are masked to zero: tiles have at least 16 rows). Where too few column blocks cover the GPU, K
is split over ``num_splits`` programs that write f32 partial sums; XLA adds them in a fixed
order (deterministic) and applies the gate and residual.

Measured on an H100 and H200 (benchmarks/RESULTS.md), the glue it removes is worth less than what
its weight streaming loses to XLA's autotuned GEMMs (split K, TMA loads, programmatic dependent
launch) except for single rows at hidden 2048-2880, where XLA falls back to a reduce fusion:
``impl="auto"`` runs it only there (``dflash_jax.model.ops.projection_kernel_wins``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fused_matmul import finish_projection
from pallas_kernels.gpu.tuning import GpuLimits, check_launch, check_positive, gpu_limits
from pallas_kernels.sizes import is_power_of_2, next_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TUNING_ARGS = ("block_m", "block_n", "block_k", "num_splits", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int


def matmul_blocks(m: int, k: int, n: int, itemsize: int, *, gated: bool = False,
                  block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, limits: GpuLimits | None = None) -> MatmulBlocks:
    """The tiling rule for an [m, k] x [k, n (output columns)] product on a GPU of ``limits``
    (default ``tuning.gpu_limits()``); any argument given wins.

    Rows are padded to >= 16 (the smallest tensor-core tile); 64-column weight tiles (128 bytes
    of a bf16 row per load); K tiles 256 deep (128 in f32; no deeper than K), the last one masked
    where they do not divide K (gpt-oss's 2880: 12 steps, not 45 of the 64 that divide it); K
    split only when fewer than half as many programs as SMs would run; three stages, fewer where
    the tiles would overflow shared memory. On an H100 (2026-11-22, the 36 layers' projections of
    Qwen3-8B at 1 and 16 rows) this beat 64- and 128-deep K tiles, 4 stages, 128-column tiles and
    K split in two (benchmarks/RESULTS.md).
    """
    check_positive(block_m=block_m, block_n=block_n, block_k=block_k, num_splits=num_splits)
    limits = limits or gpu_limits()
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value is not None and not is_power_of_2(value):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_m is None:
        block_m = min(64, max(16, next_power_of_2(m)))
    if block_n is None:
        block_n = 64
    if block_k is None:  # (a given num_splits must divide the K steps)
        deepest = min(256 if itemsize <= 2 else 128, max(16, next_power_of_2(k)))
        block_k = next((b for b in (256, 128, 64, 32, 16) if b <= deepest
                        and (num_splits is None or pl.cdiv(k, b) % num_splits == 0)), 16)
    steps = pl.cdiv(k, block_k)
    if num_splits is None:
        programs = pl.cdiv(n, block_n) * pl.cdiv(m, block_m)
        num_splits = 1 if 2 * programs >= limits.num_sms else max(1, min(steps, pl.cdiv(limits.num_sms, programs)))
        while steps % num_splits:
            num_splits -= 1
    stage_bytes = (block_m + (2 if gated else 1) * block_n) * block_k * itemsize
    if stage_bytes > limits.smem_budget:
        raise ValueError(f"one stage of x and weight tiles ({stage_bytes} B: block_m {block_m}, block_n {block_n}, "
                         f"block_k {block_k}) exceeds the {limits.smem_budget} B of shared memory a program may use")
    if num_stages is None:
        num_stages = max(1, min(3, limits.smem_budget // stage_bytes))
    elif num_stages * stage_bytes > limits.smem_budget:
        raise ValueError(f"num_stages={num_stages} stages of x and weight tiles ({stage_bytes} B each) exceed "
                         f"the {limits.smem_budget} B of shared memory a program may use: take fewer stages")
    num_warps = 4 if num_warps is None else num_warps
    check_launch(num_warps, num_stages)
    return MatmulBlocks(block_m, block_n, block_k, num_splits, num_warps, num_stages)


def inverse_rms(load_x, k: int, block_m: int, block_k: int, eps: float) -> jax.Array:
    """RMSNorm's 1 / rms(x) [block_m, 1] f32 of a program's rows of x [M, K], read as ``load_x(k0)``
    tiles [block_m, block_k] (x is small at decode and verify sizes: read again from L2 after; a
    last tile past K is ``load_x``'s to mask)."""
    def sum_squares(step, total):
        x = load_x(pl.multiple_of(step * block_k, block_k)).astype(jnp.float32)
        return total + jnp.sum(x * x, axis=1, keepdims=True)

    total = lax.fori_loop(0, pl.cdiv(k, block_k), sum_squares, jnp.zeros((block_m, 1), jnp.float32))
    return lax.rsqrt(total / k + eps)


def _fused_matmul_kernel(*refs, block_m: int, block_n: int, block_k: int, steps_per_split: int,
                         has_norm: bool, gated: bool, has_residual: bool, finish_here: bool, eps: float):
    """Refs are whole arrays: x [M, K], w [K, N or 2N], then norm_weight [K] and residual [M, N]
    when given, and the output: [M, N] when ``finish_here``, else this split's f32 partial sums
    [M, N or 2N]."""
    x_ref, w_ref, *rest = refs
    norm_ref = rest.pop(0) if has_norm else None
    residual_ref = rest.pop(0) if has_residual else None
    (o_ref,) = rest
    split, row_block, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    (m, k), n = x_ref.shape, w_ref.shape[1] // (2 if gated else 1)
    dtype = x_ref.dtype
    m0, n0 = row_block * block_m, col_block * block_n
    rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    ragged_k = k % block_k != 0  # the last K tile runs past K: tiles masked along K
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def inside_k(k0, shape, axis):
        """Where a tile's K index is below K, along ``axis`` of ``shape``; None where every tile is."""
        return k0 + lax.broadcasted_iota(jnp.int32, shape, axis) < k if ragged_k else None

    def tile_mask(shape, *conditions):
        """The conditions that apply (not None) and-ed, broadcast to ``shape``; None if none applies."""
        conditions = [c for c in conditions if c is not None]
        return jnp.broadcast_to(functools.reduce(jnp.logical_and, conditions), shape) if conditions else None

    def load(ref, mask):
        return plgpu.load(ref, mask=mask, other=None if mask is None else 0)

    def load_x(k0):
        mask = tile_mask((block_m, block_k), rows < m, inside_k(k0, (1, block_k), 1))
        return load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], mask)

    def load_w(k0, c0):
        mask = tile_mask((block_k, block_n), None if n % block_n == 0 else cols < n, inside_k(k0, (block_k, 1), 0))
        return load(w_ref.at[pl.ds(k0, block_k), pl.ds(c0, block_n)], mask)

    if has_norm:
        inv_rms = inverse_rms(load_x, k, block_m, block_k, eps)

    def body(step, accs):
        k0 = pl.multiple_of((split * steps_per_split + step) * block_k, block_k)
        x = load_x(k0)
        if has_norm:
            weight = load(norm_ref.at[pl.ds(k0, block_k)], inside_k(k0, (block_k,), 0)).astype(dtype)
            x = weight[None, :] * (x.astype(jnp.float32) * inv_rms).astype(dtype)
        dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)
        return tuple(acc + dot(x, load_w(k0, c0))
                     for acc, c0 in zip(accs, (n0, n + n0) if gated else (n0,)))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(0, steps_per_split, body, (zeros, zeros) if gated else (zeros,))
    out_mask = (rows < m) & (cols < n)
    if not finish_here:
        for acc, c0 in zip(accs, (n0, n + n0) if gated else (n0,)):
            plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(c0, block_n)], acc, mask=out_mask)
        return
    y = accs[0]
    if gated:
        gate, up = accs
        y = gate / (1 + jnp.exp(-gate)) * up
    if has_residual:
        y = y + plgpu.load(residual_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], mask=out_mask,
                           other=0).astype(jnp.float32)
    plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], y.astype(o_ref.dtype), mask=out_mask)


def check_fused_matmul_args(x: jax.Array, w: jax.Array, norm_weight, gated: bool, residual) -> None:
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x must be [..., K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if x.dtype != w.dtype or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x and w must share a float32/bfloat16/float16 dtype, got {x.dtype} and {w.dtype}")
    if x.shape[-1] % 16:
        raise ValueError(f"K (x.shape[-1]) must be a multiple of 16, got {x.shape[-1]}")
    if x.size == 0 or w.shape[1] == 0:
        raise ValueError(f"x must hold at least one row and w one column; got x {x.shape}, w {w.shape}")
    if gated and w.shape[1] % 2:
        raise ValueError(f"gated=True needs w [K, 2N] (gate | up), got {w.shape[1]} columns")
    if norm_weight is not None and norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm_weight must be [K] = [{x.shape[-1]}], got {norm_weight.shape}")
    n = w.shape[1] // (2 if gated else 1)
    if residual is not None and residual.shape != (*x.shape[:-1], n):
        raise ValueError(f"residual must be {(*x.shape[:-1], n)} (x's rows by the output columns), "
                         f"got {residual.shape}")


@functools.partial(jax.jit, static_argnames=("eps", "gated", "interpret", *TUNING_ARGS))
def fused_matmul(x: jax.Array, w: jax.Array, *, norm_weight: jax.Array | None = None,
                 eps: float = 1e-6, gated: bool = False, residual: jax.Array | None = None,
                 interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_splits: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Pallas version of ``fused_matmul_reference``. Tuning keywords default to ``matmul_blocks``."""
    check_fused_matmul_args(x, w, norm_weight, gated, residual)
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k)
    m, n = x.shape[0], w.shape[1] // (2 if gated else 1)
    blocks = matmul_blocks(m, k, n, x.dtype.itemsize, gated=gated, block_m=block_m, block_n=block_n,
                           block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                           num_stages=num_stages)
    steps = pl.cdiv(k, blocks.block_k)
    if steps % blocks.num_splits:
        raise ValueError(f"num_splits={blocks.num_splits} must divide the {steps} K steps of block_k={blocks.block_k} "
                         f"over K={k}")
    splits = blocks.num_splits
    finish_here = splits == 1
    residual_rows = None if residual is None else residual.reshape(-1, n)
    operands = [x, w] + [a for a in (norm_weight, residual_rows if finish_here else None) if a is not None]
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, i, j: (0,) * a.ndim)  # noqa: E731
    kernel = functools.partial(
        _fused_matmul_kernel, block_m=blocks.block_m, block_n=blocks.block_n, block_k=blocks.block_k,
        steps_per_split=steps // splits, has_norm=norm_weight is not None, gated=gated,
        has_residual=finish_here and residual is not None, finish_here=finish_here, eps=eps)
    out_shape = (m, n) if finish_here else (splits, m, w.shape[1])
    out = pl.pallas_call(
        kernel,
        grid=(splits, pl.cdiv(m, blocks.block_m), pl.cdiv(n, blocks.block_n)),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((m, n), lambda s, i, j: (0, 0)) if finish_here
        else pl.BlockSpec((None, m, w.shape[1]), lambda s, i, j: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype if finish_here else jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="fused_matmul",
    )(*operands)
    if not finish_here:
        out = finish_projection(out.sum(axis=0), residual_rows, gated, x.dtype)
    return out.reshape(*lead, n)

"""Routed SwiGLU experts of a MoE layer on TPUs (Mosaic): each token's ``top_k`` experts,
weighted and summed, reading only the routed experts' weights.

Same semantics and arguments as ``routed_experts_reference`` (``pallas_kernels.routed_experts``; it
serves both backends): per-expert biases, gpt-oss's clamped SwiGLU, expert id -1 for a pair that adds
nothing (it takes no row and reads nothing).

Layout (the GPU kernel's, ``expert_tiles``): the (token, expert) pairs are grouped by expert and
each expert's pairs padded to whole tiles of ``block_m`` rows, so that a tile belongs to one
expert. One grouped-matmul kernel (``tile_matmul``) serves both projections: its grid is
(column block, tile, reduction step) over the used tiles only (a traced grid size), and a
scalar-prefetched table of each tile's expert drives the weight BlockSpec's index map, so an
expert no pair chose is never copied from HBM. x's rows, gathered in tile order by XLA, times
gate|up [E, H, 2I] (+ bias, in the kernel); the SwiGLU (XLA, elementwise, in f32); times down
[E, I, H] (+ bias); XLA gathers each pair's row back, applies its routing weight and sums each
token's k rows in f32. Each projection is summed in f32 with its bias and rounded to x's dtype,
as the reference rounds its products.

What is read: each column block of each routed expert's weight once per call whatever the
number of tokens, when the reduction takes one step (K <= MAX_BLOCK_K, or not a multiple of
128: every model here), as consecutive tiles of one expert keep its weight block in VMEM (the
pipeline copies a block only when its index changes); a longer reduction reads it once a tile.
Up to DECODE_TOKENS tokens a tile has as many rows as tokens (a power of two, 16 at least), so
every routed expert takes one tile; beyond, about the rows an expert gets on average. The tile
table is sized for any routing (``expert_tiles``: ceil(N k / block_m) + min(E, N k) tiles):
XLA's gathers and SwiGLU run over all its rows, the kernels over the used tiles only.

Limits: the SwiGLU is not fused into the gate|up kernel, as gpt-oss's gate and up halves
(I = 2880) do not meet at a 128-lane boundary; it costs one write and read of the [rows, 2I]
products. A dimension that is not a multiple of 128 (gpt-oss's H = I = 2880) is reduced in one
step, and as output columns split into blocks of 128-lane multiples, the last one partial.
jax's megablox ``gmm`` was not used: its dots carry no precision (Mosaic refuses them for bf16
under jax_default_matmul_precision="highest") and it cannot raise the scoped VMEM limit.
``Mxfp4Weight`` experts are refused: load them dequantised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.routed_experts import Mxfp4Weight, check_routed_experts_args, expert_tiles, swiglu
from pallas_kernels.sizes import next_power_of_2
from pallas_kernels.tpu.paged_attention import vmem_capacity

DECODE_TOKENS = 32      # up to this many tokens a tile holds every pair of its expert
MAX_TILE_ROWS = 256     # rows of the largest default tile
MAX_BLOCK_K = 2048      # reduced dims per step, when the dimension splits into 128-lane blocks
WEIGHT_BLOCK_BYTES = 4 * 2**20  # the weight block the column blocks aim for


def tile_rows(tokens: int, pairs: int, num_experts: int) -> int:
    """Rows per tile, a power of two in [16, MAX_TILE_ROWS]: at least ``tokens`` up to
    DECODE_TOKENS (a token chooses an expert at most once, so each routed expert then takes one
    tile, whatever the reduction), else the pairs an expert gets on average (the padding of each
    expert's last tile costs MXU work and rows of the intermediates, not weight reads)."""
    wanted = tokens if tokens <= DECODE_TOKENS else -(-pairs // num_experts)
    return min(MAX_TILE_ROWS, max(16, next_power_of_2(wanted)))


def _divisor_block(size: int, limit: int) -> int:
    """The largest multiple of 128 that divides ``size`` (a multiple of 128) and is at most
    ``limit`` (128 at least)."""
    return max(c for c in range(128, max(128, min(size, limit)) + 1, 128) if size % c == 0)


def choose_blocks(reduced: int, columns: int, itemsize: int) -> tuple[int, int]:
    """(block_k, block_n) of a [reduced, columns] expert weight. The reduction in as few steps as
    MAX_BLOCK_K allows, whole when it is not a multiple of 128 (a row block's lanes must be). The
    columns so that a weight block is about WEIGHT_BLOCK_BYTES: a divisor when they are a multiple
    of 128, else equal blocks rounded up to 128 lanes, the last one partial (its columns past
    the end are dropped)."""
    block_k = reduced if reduced % 128 else _divisor_block(reduced, MAX_BLOCK_K)
    limit = max(128, WEIGHT_BLOCK_BYTES // (block_k * itemsize) // 128 * 128)
    if columns % 128 == 0:
        return block_k, _divisor_block(columns, limit)
    if columns <= limit:
        return block_k, columns
    return block_k, pl.cdiv(pl.cdiv(columns, pl.cdiv(columns, limit)), 128) * 128


def vmem_estimate(block_m: int, block_k: int, block_n: int, itemsize: int, accumulate: bool) -> int:
    """Bytes of VMEM a program holds: double-buffered row, weight and output blocks, and the f32
    accumulator when the reduction takes several steps."""
    blocks = 2 * (block_m * block_k + block_k * block_n + block_m * block_n) * itemsize
    return blocks + (block_m * block_n * 4 if accumulate else 0)


def _tile_matmul_kernel(tile_expert_ref, rows_ref, w_ref, *refs, steps: int, with_bias: bool, precision):
    """Program (column block, tile, reduction step): out rows [block_m, block_n] = the tile's rows
    [block_m, K] @ its expert's weight [K, block_n] (+ its bias [1, block_n]), a block_k slice of K
    a step, summed in f32 and rounded at the last step. refs: (bias,) out (, f32 accumulator)."""
    del tile_expert_ref  # read by the index maps
    bias_ref, (out_ref, *scratch) = (refs[0], refs[1:]) if with_bias else (None, refs)
    product = lax.dot(rows_ref[...], w_ref[...], precision=precision, preferred_element_type=jnp.float32)

    def finish(total):
        if bias_ref is not None:
            total = total + bias_ref[...].astype(jnp.float32)
        out_ref[...] = total.astype(out_ref.dtype)

    if steps == 1:
        finish(product)
        return
    acc_ref, = scratch
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        acc_ref[...] = product

    @pl.when((step > 0) & (step < steps - 1))
    def _():
        acc_ref[...] += product

    @pl.when(step == steps - 1)
    def _():
        finish(acc_ref[...] + product)


def tile_matmul(rows: jax.Array, w: jax.Array, bias: jax.Array | None, tile_expert: jax.Array,
                used_tiles: jax.Array, *, block_m: int, block_k: int | None, block_n: int | None,
                interpret: bool, name: str) -> jax.Array:
    """rows [T * block_m, K] @ w [E, K, N] (+ bias [E, N]) by tiles of ``block_m`` rows, tile t's
    rows times expert tile_expert[t]'s weight (int32 [T]), for the first ``used_tiles`` (a traced
    int32 scalar) tiles: [T * block_m, N] in rows' dtype, the rows of unused tiles unwritten.
    ``block_k``/``block_n``: None for ``choose_blocks``'s; ``name`` names the kernel."""
    (num_rows, reduced), (num_experts, _, columns) = rows.shape, w.shape
    itemsize = jnp.dtype(rows.dtype).itemsize
    auto_k, auto_n = choose_blocks(reduced, columns, itemsize)
    block_k, block_n = block_k or auto_k, block_n or auto_n
    if reduced % block_k or (block_k % 128 and block_k != reduced):
        raise ValueError(f"{name}: block_k must divide {reduced} and be a multiple of 128 or {reduced} itself, "
                         f"got {block_k}")
    if block_n % 128 and block_n != columns:
        raise ValueError(f"{name}: block_n must be a multiple of 128 or {columns} itself, got {block_n}")
    steps = reduced // block_k
    needed = vmem_estimate(block_m, block_k, block_n, itemsize, steps > 1)
    capacity = None if interpret else vmem_capacity()
    if capacity is not None and needed > capacity * 3 // 4:
        raise ValueError(f"{name}: block_m={block_m} rows, block_k={block_k} and block_n={block_n} need about "
                         f"{needed / 2**20:.0f} MiB of VMEM, more than 3/4 of the {capacity / 2**20:.0f} MiB "
                         "this TPU has: take smaller blocks")
    limit = None if capacity is None else min(capacity * 3 // 4, max(32 * 2**20, 2 * needed))
    num_tiles = num_rows // block_m
    column_blocks = pl.cdiv(columns, block_n)
    # Explicit precision: f32 exactly; bf16 in one MXU pass whatever jax's default matmul
    # precision says (Mosaic refuses HIGHEST for bf16 operands).
    precision = lax.Precision.HIGHEST if rows.dtype == jnp.float32 else lax.Precision.DEFAULT
    in_specs = [pl.BlockSpec((block_m, block_k), lambda n, t, k, tile_expert: (t, k)),
                pl.BlockSpec((None, block_k, block_n), lambda n, t, k, tile_expert: (tile_expert[t], k, n))]
    operands = [rows, w]
    if bias is not None:  # [E, 1, N]: a block's last two dims (1, block_n), 1 being the whole dim
        in_specs.append(pl.BlockSpec((None, 1, block_n), lambda n, t, k, tile_expert: (tile_expert[t], 0, n)))
        operands.append(bias.reshape(num_experts, 1, columns))
    return pl.pallas_call(
        functools.partial(_tile_matmul_kernel, steps=steps, with_bias=bias is not None, precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(column_blocks, used_tiles, steps), in_specs=in_specs,
            out_specs=pl.BlockSpec((block_m, block_n), lambda n, t, k, tile_expert: (t, n)),
            scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)] if steps > 1 else []),
        out_shape=jax.ShapeDtypeStruct((num_rows, columns), rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=limit),
        # Bytes (an upper bound: every tile used): the weights of each tile's expert, once an
        # expert when the reduction takes one step (consecutive tiles of an expert keep its block),
        # the tiles' rows once per column block and their output. FLOPs: every tile's rows times
        # its expert's weight.
        cost_estimate=pl.CostEstimate(
            flops=2 * num_rows * reduced * columns, transcendentals=0,
            bytes_accessed=((min(num_tiles, num_experts) if steps == 1 else num_tiles) * reduced * columns
                            + column_blocks * num_rows * reduced + num_rows * columns) * itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(tile_expert, *operands)


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "interpret", "block_m", "block_k",
                                             "block_n"))
def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                   gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
                   swiglu_limit: float | None = None, swiglu_alpha: float = 1.702, interpret: bool = False,
                   block_m: int | None = None, block_k: int | None = None, block_n: int | None = None) -> jax.Array:
    """TPU version of ``routed_experts_reference`` (same arguments and result, each projection
    summed in f32 with its bias and rounded to x's dtype once): x [N, H], experts and weights
    [N, k], gate_up [E, H, 2I], down [E, I, H], biases [E, 2I] / [E, H] or None; returns [N, H].
    ``block_m`` rows per tile (default ``tile_rows``), ``block_k`` reduced dims per step and
    ``block_n`` output columns per program for both projections (default ``choose_blocks``: a
    multiple of 128 dividing the dimension, or the whole of one that is not a multiple of 128)."""
    if isinstance(gate_up, Mxfp4Weight) or isinstance(down, Mxfp4Weight):
        raise ValueError("the TPU routed_experts kernel takes dense expert weights, not Mxfp4Weight: load the "
                         "checkpoint with --mxfp4-experts dequantize")
    check_routed_experts_args(x, experts, weights, gate_up, down)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"the TPU routed_experts kernel takes float32 or bfloat16, got {x.dtype}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (gate_up.shape[0], gate_up.shape[2])),
                              ("down_bias", down_bias, (down.shape[0], down.shape[2]))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"{name} must be [E, {'2I' if name == 'gate_up_bias' else 'H'}] = {list(shape)}, "
                             f"got {list(bias.shape)}")
    (tokens, top_k), num_experts = experts.shape, gate_up.shape[0]
    pairs = tokens * top_k
    block_m = block_m or tile_rows(tokens, pairs, num_experts)
    if block_m % 16:
        raise ValueError(f"block_m must be a multiple of 16, got {block_m}")
    experts = experts.astype(jnp.int32)
    rows, tile_expert = expert_tiles(experts, num_experts, block_m)
    used_tiles = jnp.sum(tile_expert >= 0, dtype=jnp.int32)  # the used tiles come first
    matmul = functools.partial(tile_matmul, tile_expert=tile_expert, used_tiles=used_tiles, block_m=block_m,
                               block_k=block_k, block_n=block_n, interpret=interpret)

    # padding rows (pair -1) take token 0's row: finite, and never read back
    gate_up_out = matmul(x[jnp.maximum(rows, 0) // top_k], gate_up, gate_up_bias, name="tpu_routed_experts_gate_up")
    gate, up = jnp.split(gate_up_out.astype(jnp.float32), 2, axis=-1)
    hidden = swiglu(gate, up, swiglu_limit, swiglu_alpha).astype(x.dtype)
    down_out = matmul(hidden, down, down_bias, name="tpu_routed_experts_down")

    # each pair's row (pairs of expert -1 have none: they add 0, whatever row 0 holds)
    slot = jnp.zeros((pairs,), jnp.int32).at[jnp.where(rows >= 0, rows, pairs)].set(
        jnp.arange(rows.shape[0], dtype=jnp.int32), mode="drop")
    pair_out = down_out[slot].astype(jnp.float32).reshape(tokens, top_k, -1)
    scaled = jnp.where((experts >= 0)[..., None], weights.astype(jnp.float32)[..., None] * pair_out, 0.0)
    return scaled.sum(axis=1).astype(x.dtype)

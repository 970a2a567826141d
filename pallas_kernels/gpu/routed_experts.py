"""Routed SwiGLU experts of a MoE layer on GPUs: the Pallas kernels (Triton lowering) behind
``routed_experts_reference`` (``pallas_kernels.routed_experts``, where the semantics, the MXFP4
format, the tile layout and the argument checks live).

The kernels read only the routed experts' weights, as vLLM's fused-MoE kernel does: the pairs
are grouped by expert and each expert's rows padded to whole tiles of ``block_m`` rows, so a
tile belongs to one expert (``expert_tiles``, a few fused XLA ops: no sort; for one token,
``token_tiles``: none). One kernel computes
silu(x W_gate) * (x W_up) for every tile (gathering the tile's token rows of x), written in pair
order, the other the down projection times the routing weight (gathering the tile's pairs' rows
of that), in pair order too; XLA sums each token's k rows. A tile with no rows streams nothing.
Either kernel may split its reduction into shares, each its own program, whose f32 sums XLA adds
(then biases and gates, for gate|up): how an MXFP4 weight fills the GPU at decode. At one token
(decode) the 8 routed experts are 8 tiles of one row each: the weights are read once, as a
matrix-vector product must.

An ``Mxfp4Weight`` is streamed as its packed codes and scales, a quarter of bf16's bytes: each
tile is decoded in registers (in PTX on a GPU) and each 32-row group's products scaled.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu.tuning import check_launch, gpu_limits
from pallas_kernels.routed_experts import (Mxfp4Weight, check_routed_experts_args, e2m1, e8m0,
                                           expert_tiles, swiglu, token_tiles)
from pallas_kernels.sizes import is_power_of_2, next_power_of_2

TUNING_ARGS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "gemv")
PROGRAMS_PER_SM = 8  # programs reduction_splits aims for on each SM


def _tile_pairs(rows_ref, tile, block_m: int):
    """(pairs [block_m], valid [block_m]) of a tile's rows."""
    pair = plgpu.load(rows_ref.at[pl.ds(tile * block_m, block_m)])
    return pair, pair >= 0


def _bf16_from_e2m1_asm(shift: int) -> str:
    """PTX for 4 bytes of MXFP4 codes (one register, byte i = element i) to the bf16 values of
    their low (``shift`` 6) or high (2) nibbles, two a register ($0: elements 0-1, $1: 2-3). Each
    byte is spread into a 16-bit half (prmt), each code's sign moved to bit 15 and its 2 exponent
    and 1 mantissa bits to bf16's bits 6-8: the bf16 of the value x 2^-126 (subnormal for codes
    0 and 1), which a bf16x2 multiply by 2^126 makes the value (exact: bf16 fma keeps
    subnormals). 3.5 instructions a value before ptxas folds shifts and masks; the
    integer-to-float way (``e2m1``) takes ~12, one of them a quarter-rate convert."""
    return "{\n.reg .b32 bytes, t, u, two126, minus0, zero;\nmov.b32 two126, 0x7E807E80;\n" \
        "mov.b32 minus0, 0x80008000;\nmov.b32 zero, 0;\n" + "".join(
            f"prmt.b32 bytes, $2, zero, {selector};\nshl.b32 t, bytes, {shift};\nand.b32 t, t, 0x01C001C0;\n"
            f"shl.b32 u, bytes, {shift + 6};\nand.b32 u, u, 0x80008000;\nor.b32 t, t, u;\n"
            f"fma.rn.bf16x2 ${out}, t, two126, minus0;\n" for out, selector in ((0, "0x4140"), (1, "0x4342"))) + "}"


def _decode_nibbles(packed: jax.Array, dtype, inline_asm: bool) -> tuple[jax.Array, jax.Array]:
    """The values in ``dtype`` of packed u8 codes [R, C]: (low nibbles', high nibbles'), each
    [R, C], exact. ``inline_asm`` (bf16 on a GPU): two bf16 at a time in PTX; else through f32
    (``e2m1``: what interpret mode runs)."""
    if inline_asm:
        values = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
        return tuple(plgpu.elementwise_inline_asm(_bf16_from_e2m1_asm(shift), args=[packed], constraints="=r,=r,r",
                                                  pack=4, result_shape_dtypes=[values])[0] for shift in (6, 2))
    codes = packed.astype(jnp.int32)
    return e2m1(codes & 15).astype(dtype), e2m1(codes >> 4).astype(dtype)


def _products(load_x, w_ref, e, k0, n0s, block_n: int, block_k: int, dot, inline_asm: bool) -> list[jax.Array]:
    """One reduction step: x[:, k0:k0 + block_k] @ w[e, k0:k0 + block_k, n0:n0 + block_n] for each
    n0 of n0s, f32; ``load_x(columns)`` gives x's rows at the given columns [rows, len(columns)].
    A dense w streams its tiles. An MXFP4 one, a 32-row scale group at a time: its packed bytes
    [16, block_n], decoded to values (no scale: exact in any float dtype), x's even columns times
    the low nibbles plus its odd columns times the high ones (x read at stride 2), the f32
    product times the group's scales."""
    if not isinstance(w_ref, Mxfp4Weight):
        x = load_x(k0 + lax.iota(jnp.int32, block_k))
        tiles = [plgpu.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(n0, block_n)]) for n0 in n0s]
        return [dot(x, w) for w in tiles]
    products = [None] * len(n0s)
    for group in range(block_k // 32):
        k = k0 + 32 * group
        even = k + 2 * lax.iota(jnp.int32, 16)
        x_even, x_odd = load_x(even), load_x(even + 1)
        for i, n0 in enumerate(n0s):
            packed = plgpu.load(w_ref.blocks.at[e, pl.ds(pl.multiple_of(lax.div(k, 2), 16), 16), pl.ds(n0, block_n)])
            scale = e8m0(plgpu.load(w_ref.scales.at[e, lax.div(k, 32), pl.ds(n0, block_n)]))
            low, high = _decode_nibbles(packed, x_even.dtype, inline_asm)
            product = (dot(x_even, low) + dot(x_odd, high)) * scale[None, :]
            products[i] = product if products[i] is None else products[i] + product
    return products


def _gemv_ops(tile, rows_ref, source_ref, row_of_pair, block_m: int):
    """For a tile of one row (one token's pairs, ``token_tiles``): (load(columns): the source row
    [len(columns), 1] f32 of the tile's first pair, dot(x, w): x * w [len, block_n] f32, the rows
    of the elementwise sums, 16). ``_products`` then adds up the products of each column and
    scale group elementwise, no tensor cores, and the kernel sums the 16 rows once at the end:
    at one token the codes are decoded once and multiplied once, without a 16-row dot (15 rows
    of zeros) or the move into its operand layout."""
    row = row_of_pair(jnp.maximum(rows_ref[tile * block_m], 0))

    def load(columns):
        return plgpu.load(source_ref.at[row, columns]).astype(jnp.float32)[:, None]

    return load, lambda x, w: x * w.astype(jnp.float32), 16


def _finish_gemv(acc, block_m: int):
    """The elementwise sums [16, block_n] of ``_gemv_ops`` as the tile's rows [block_m, block_n]
    (the first row's; the others are masked off)."""
    return jnp.broadcast_to(jnp.sum(acc, axis=0, keepdims=True), (block_m, acc.shape[1]))


def _split_steps(total: int, splits: int, live):
    """(first step, steps) of this program's share (program axis 2) of ``total`` reduction steps
    split as evenly as they go (``splits`` <= ``total``: no share empty); no steps where ``live``
    is false (a tile with no rows streams nothing: a product, not a select, as Triton wants an
    i32 loop bound)."""
    split = pl.program_id(2)
    first = split * total // splits
    return first, ((split + 1) * total // splits - first) * live.astype(jnp.int32)


def _gate_up_kernel(rows_ref, tile_expert_ref, x_ref, w_ref, *refs, top_k: int, block_m: int, block_n: int,
                    block_k: int, splits: int, inline_asm: bool, gemv: bool, swiglu_limit: float | None,
                    swiglu_alpha: float):
    """Program (tile, column block, split): x W_gate and x W_up of the tile's rows over the split's
    share of the hidden size. One split: swiglu(x W_gate [+ b_gate], x W_up [+ b_up]) stored at
    each row's pair (h [N * k, I]); several: the f32 sums at row split * N * k + pair of
    [splits * N * k, 2I] (gate | up), summed, biased and gated by the caller. w_ref dense or an
    Mxfp4Weight of refs; refs: (bias [E, 2I],) out."""
    *bias_ref, out_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[tile]
    hidden, width = x_ref.shape[1], w_ref.shape[2] // 2
    pairs = out_ref.shape[0] // splits
    pair, valid = _tile_pairs(rows_ref, tile, block_m)
    token = jnp.where(valid, pair // top_k, 0)
    e = jnp.maximum(expert, 0)
    n0 = col * block_n
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)

    def load_x(columns):
        return plgpu.load(x_ref.at[token[:, None], columns[None, :]], other=0,
                          mask=jnp.broadcast_to(valid[:, None], (block_m, columns.shape[0])))

    acc_rows = block_m
    if gemv:
        load_x, dot, acc_rows = _gemv_ops(tile, rows_ref, x_ref, lambda pair: pair // top_k, block_m)

    def body(step, accs):
        k0 = pl.multiple_of((first + step) * block_k, block_k)
        gate, up = _products(load_x, w_ref, e, k0, (n0, width + n0), block_n, block_k, dot, inline_asm)
        return accs[0] + gate, accs[1] + up

    zeros = jnp.zeros((acc_rows, block_n), jnp.float32)
    first, steps = _split_steps(hidden // block_k, splits, expert >= 0)
    gate, up = lax.fori_loop(0, steps, body, (zeros, zeros))
    if gemv:
        gate, up = _finish_gemv(gate, block_m), _finish_gemv(up, block_m)
    # padding rows point past the end too, so that interpret mode's scatter drops them as well
    row = jnp.where(valid, pl.program_id(2) * pairs + pair, out_ref.shape[0])[:, None]
    cols = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    mask = jnp.broadcast_to(valid[:, None], (block_m, block_n))
    if splits > 1:
        plgpu.store(out_ref.at[row, cols], gate, mask=mask)
        plgpu.store(out_ref.at[row, width + cols], up, mask=mask)
        return
    if bias_ref:
        gate = gate + plgpu.load(bias_ref[0].at[e, pl.ds(n0, block_n)]).astype(jnp.float32)[None, :]
        up = up + plgpu.load(bias_ref[0].at[e, pl.ds(width + n0, block_n)]).astype(jnp.float32)[None, :]
    plgpu.store(out_ref.at[row, cols], swiglu(gate, up, swiglu_limit, swiglu_alpha).astype(out_ref.dtype),
                mask=mask)


def _down_kernel(rows_ref, tile_expert_ref, weights_ref, h_ref, w_ref, *refs, block_m: int, block_n: int,
                 block_k: int, splits: int, inline_asm: bool, gemv: bool):
    """Program (tile, column block, split): routing weight x (h W_down [+ b_down, split 0 only]) of
    the tile's rows over the split's share of the width, f32, stored at row split * N * k + pair
    of out [splits * N * k, H] (h [N * k, I] by pair); w_ref dense or an Mxfp4Weight of refs;
    refs: (bias [E, H],) out."""
    *bias_ref, out_ref = refs
    tile, col, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = tile_expert_ref[tile]
    pairs, width = h_ref.shape
    pair, valid = _tile_pairs(rows_ref, tile, block_m)
    h_row = jnp.where(valid, pair, 0)[:, None]
    e = jnp.maximum(expert, 0)
    n0 = col * block_n
    precision = lax.Precision.HIGHEST if h_ref.dtype == jnp.float32 else None
    dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)

    def load_h(columns):
        return plgpu.load(h_ref.at[h_row, columns[None, :]], other=0,
                          mask=jnp.broadcast_to(valid[:, None], (block_m, columns.shape[0])))

    acc_rows = block_m
    if gemv:
        load_h, dot, acc_rows = _gemv_ops(tile, rows_ref, h_ref, lambda pair: pair, block_m)

    def body(step, acc):
        k0 = pl.multiple_of((first + step) * block_k, block_k)
        return acc + _products(load_h, w_ref, e, k0, (n0,), block_n, block_k, dot, inline_asm)[0]

    first, steps = _split_steps(width // block_k, splits, expert >= 0)
    acc = lax.fori_loop(0, steps, body, jnp.zeros((acc_rows, block_n), jnp.float32))
    if gemv:
        acc = _finish_gemv(acc, block_m)
    if bias_ref:
        bias = plgpu.load(bias_ref[0].at[e, pl.ds(n0, block_n)]).astype(jnp.float32)[None, :]
        acc = acc + jnp.where(split == 0, bias, 0.0)
    weight = plgpu.load(weights_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0).astype(jnp.float32)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row = jnp.where(valid, split * pairs + pair, out_ref.shape[0])
    plgpu.store(out_ref.at[row[:, None], cols], acc * weight[:, None],
                mask=jnp.broadcast_to(valid[:, None], (block_m, block_n)))


def _largest_divisor(n: int, choices: tuple[int, ...]) -> int:
    return next((c for c in choices if n % c == 0), choices[-1])


def tile_rows(pairs: int, num_experts: int) -> int:
    """Rows per tile: the pairs an expert gets on average, as a power of two in [16, 64] (16 is
    the smallest tensor-core tile; each tile streams its expert's weights once, so fewer, fuller
    tiles read less when many tokens share an expert)."""
    return min(64, max(16, next_power_of_2(-(-pairs // num_experts))))


def reduction_splits(pairs: int, num_experts: int, column_blocks: int, steps: int, num_sms: int,
                     mxfp4: bool) -> int:
    """Shares of the reduction per (tile, column block), each its own program. An MXFP4 weight's
    step streams a quarter of bf16's bytes and decodes them before its products: with few tiles
    (decode: one token's 4 experts x 45 column blocks make 180 programs for 132 SMs)
    too few loads are in flight to keep up with the memory, so the shares make up to
    ``PROGRAMS_PER_SM`` programs an SM (1.8x faster at one gpt-oss-20b token). Dense weights
    take one share: their steps are pipelined and measured no faster split
    (benchmarks/RESULTS.md, MXFP4 experts kernel, 2026-11-28). Each extra share writes and reads back f32 sums."""
    if not mxfp4:
        return 1
    programs = min(num_experts, pairs) * column_blocks
    return max(1, min(steps, num_sms * PROGRAMS_PER_SM // programs))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "interpret", *TUNING_ARGS))
def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array | Mxfp4Weight,
                   down: jax.Array | Mxfp4Weight, gate_up_bias: jax.Array | None = None,
                   down_bias: jax.Array | None = None, *,
                   swiglu_limit: float | None = None, swiglu_alpha: float = 1.702, interpret: bool = False,
                   block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   split_k: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                   gemv: bool | None = None) -> jax.Array:
    """Pallas version of ``routed_experts_reference`` (same arguments; the result within the
    rounding of its products, which the kernel keeps in f32 and rounds once): reads only the
    routed experts' weights. ``block_m`` rows per tile (default ``tile_rows``), ``block_n``
    output columns and ``block_k`` reduced dims per step (default: the largest of 64, 32, 16 and
    of 128, 64, 32, 16 that divide them; a multiple of 32 for an MXFP4 weight, whose steps
    reduce whole scale groups), ``split_k`` shares of each reduction, summed after the kernels
    (default ``reduction_splits``), ``num_stages`` software-pipelined steps (default: up to 3,
    as many as shared memory holds), ``gemv``: one token's products with an MXFP4 weight summed
    elementwise without tensor cores (``_gemv_ops``; None or True: for each MXFP4 weight at one
    token, True an error elsewhere; False: tensor cores)."""
    check_routed_experts_args(x, experts, weights, gate_up, down)
    if gemv and (experts.shape[0] != 1 or not any(isinstance(w, Mxfp4Weight) for w in (gate_up, down))):
        raise ValueError(f"gemv runs MXFP4 weights at one token, got {experts.shape[0]} tokens and "
                         f"{'MXFP4' if isinstance(gate_up, Mxfp4Weight) else 'dense'} gate_up, "
                         f"{'MXFP4' if isinstance(down, Mxfp4Weight) else 'dense'} down")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (gate_up.shape[0], gate_up.shape[2])),
                              ("down_bias", down_bias, (down.shape[0], down.shape[2]))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"{name} must be [E, {'2I' if name == 'gate_up_bias' else 'H'}] = {list(shape)}, "
                             f"got {list(bias.shape)}")
    block_m = tile_rows(experts.size, gate_up.shape[0]) if block_m is None else block_m
    if not (is_power_of_2(block_m) and block_m >= 16):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    check_launch(num_warps, num_stages or 1)
    (n, top_k), (num_experts, hidden, _), width = experts.shape, gate_up.shape, down.shape[1]
    pairs = n * top_k
    rows, tile_expert = (token_tiles(experts, block_m) if n == 1
                         else expert_tiles(experts.astype(jnp.int32), num_experts, block_m))
    num_tiles = tile_expert.shape[0]

    def call(kernel, operands, out_cols, reduce, name, weight, weight_tiles, out_dtype):
        mxfp4 = isinstance(weight, Mxfp4Weight)
        bn = block_n or _largest_divisor(weight.shape[2] // weight_tiles, (64, 32, 16))
        bk = block_k or _largest_divisor(reduce, (128, 64, 32, 16))
        for what, value, size, least in (("block_n", bn, weight.shape[2] // weight_tiles, 16),
                                         ("block_k", bk, reduce, 32 if mxfp4 else 16)):
            if not (is_power_of_2(value) and value >= least) or size % value:
                raise ValueError(f"{name}: {what} must be a power of two >= {least} that divides {size}"
                                 f"{' (whole MXFP4 scale groups)' if least == 32 else ''}, got {value}")
        # an MXFP4 weight tile streams bk/2 bytes of codes and bk/32 of scales per column
        weight_bytes = (bk // 2 + bk // 32) * bn if mxfp4 else bk * bn * x.dtype.itemsize
        stage_bytes = block_m * bk * x.dtype.itemsize + weight_tiles * weight_bytes
        budget = gpu_limits().smem_budget
        stages = max(1, min(3, budget // stage_bytes)) if num_stages is None else num_stages
        if stages * stage_bytes > budget:
            raise ValueError(f"{name}: num_stages={stages} stages of {stage_bytes} B (block_m {block_m}, block_n "
                             f"{bn}, block_k {bk}) exceed the {budget} B of shared memory a program may use: take "
                             "smaller tiles or fewer stages")
        column_blocks, steps = weight.shape[2] // weight_tiles // bn, reduce // bk
        splits = min(steps, split_k or reduction_splits(pairs, num_experts, column_blocks, steps,
                                                        gpu_limits().num_sms, mxfp4))
        out_shape = (pairs * splits, out_cols(splits))
        whole = lambda a: pl.BlockSpec(a.shape, lambda t, c, s: (0,) * a.ndim)  # noqa: E731
        elementwise = mxfp4 and n == 1 and gemv is not False
        out = pl.pallas_call(
            functools.partial(kernel, block_m=block_m, block_n=bn, block_k=bk, splits=splits, gemv=elementwise,
                              inline_asm=mxfp4 and not interpret and x.dtype == jnp.bfloat16),
            grid=(num_tiles, column_blocks, splits),
            in_specs=[jax.tree.map(whole, a) for a in operands],  # an Mxfp4Weight: one spec per array
            out_specs=pl.BlockSpec(out_shape, lambda t, c, s: (0, 0)),
            out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype(splits)),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=stages), interpret=interpret,
            name=name,
        )(*operands)
        return out.reshape(splits, pairs, out_shape[1])

    gate_up_kernel = functools.partial(_gate_up_kernel, top_k=top_k, swiglu_limit=swiglu_limit,
                                       swiglu_alpha=swiglu_alpha)
    # one share: h [N k, I] gated in the kernel; several: their gate | up sums [splits, N k, 2I]
    h = call(gate_up_kernel, (rows, tile_expert, x, gate_up) + (() if gate_up_bias is None else (gate_up_bias,)),
             lambda splits: width if splits == 1 else 2 * width, hidden, "routed_experts_gate_up", gate_up, 2,
             lambda splits: x.dtype if splits == 1 else jnp.float32)
    if h.shape[0] > 1:
        sums = h.sum(axis=0)
        if gate_up_bias is not None:
            sums = sums + gate_up_bias[jnp.maximum(experts, 0).reshape(-1)].astype(jnp.float32)
        gate, up = jnp.split(sums, 2, axis=-1)
        h = swiglu(gate, up, swiglu_limit, swiglu_alpha)[None]
    out = call(_down_kernel, (rows, tile_expert, weights.reshape(-1), h[0].astype(x.dtype), down)
               + (() if down_bias is None else (down_bias,)), lambda splits: hidden, width, "routed_experts_down",
               down, 1, lambda splits: jnp.float32)
    # a pair of expert -1 has no row: its output rows were never written
    out = jnp.where((experts >= 0)[None, ..., None], out.reshape(-1, n, top_k, hidden), 0.0)
    return out.sum(axis=(0, 2)).astype(x.dtype)

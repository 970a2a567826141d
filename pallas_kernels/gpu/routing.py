"""A MoE layer's routing in one or two GPU launches: RMSNorm, router logits, softmax, top k and
their weights, the Pallas version (Triton lowering) of ``route_reference`` (``pallas_kernels.routing``).

Through XLA a decode step's routing is a chain of small kernels a layer (the norm, the router's
product, the softmax, the top k, the renormalisation), each a launch of a few µs around a
product that reads 0.5 MB. Here a program holds 16 rows: it sums their squares, then walks its
share of the hidden size normalising each x tile (written out as h, which the experts read),
multiplying it by the router's tile on the tensor cores and, for hashed independent routing,
folding h's bits into the rows' hashes. With one share (one launch) the same program then takes
the softmax over the experts in f32 and the top k by k rounds of max and lowest index
(``lax.top_k``'s order, ties to the lower expert). One program streaming the whole router runs on
one SM's bandwidth, slower than XLA at decode (benchmarks/RESULTS.md, 2026-11-30), so by default
the hidden size is split into shares (``route_splits``: at one row, each router step its own
program) whose f32 logits and hashes a second launch adds in share order and finishes. Even so
it trails XLA's chain at decode (benchmarks/RESULTS.md, 2026-11-30), so only ``impl="pallas"``
runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu.fused_matmul import inverse_rms
from pallas_kernels.gpu.tuning import check_launch, gpu_limits
from pallas_kernels.routing import check_route_args, element_bits, gumbel_scores, hash_terms, log_popularity, mix32
from pallas_kernels.sizes import is_power_of_2, next_power_of_2

ROWS_PER_PROGRAM = 16  # the smallest tensor-core tile
TILE_BYTES = 32 * 1024  # the router tile a step streams, at most
RMS_TILE = 512  # columns a share program's RMSNorm statistics read at a time
MAX_SHARES = 32  # shares of the router a row block's default tiling aims for, at most


def _row_block():
    """(first row, rows [16, 1]) of this program's block of rows (program axis 0)."""
    m0 = pl.program_id(0) * ROWS_PER_PROGRAM
    return m0, m0 + lax.broadcasted_iota(jnp.int32, (ROWS_PER_PROGRAM, 1), 0)


def _wide_inverse_rms(x_ref, rows: jax.Array, eps: float) -> jax.Array:
    """``inverse_rms`` of the rows [16, 1] read ``RMS_TILE`` columns at a time (masked past the
    hidden size): every share program needs the whole rows' statistics before its own few steps,
    so they take a few wide loads, not one per ``block_k``."""
    n, hidden = x_ref.shape
    tile = min(RMS_TILE, next_power_of_2(hidden))

    def load_x(k0):
        cols = k0 + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        return plgpu.load(x_ref.at[rows, cols], mask=(rows < n) & (cols < hidden), other=0)

    return inverse_rms(load_x, hidden, ROWS_PER_PROGRAM, tile, eps)


def _partial_logits(x_ref, norm_ref, router_ref, h_ref, first_step: int | jax.Array, steps: int, *, block_k: int,
                    eps: float, independent: bool, wide_rms: bool) -> tuple[jax.Array, jax.Array]:
    """(f32 logits [16, E'], hashes [16, 1] uint32) of this program's rows over hidden dims
    ``first_step * block_k`` .. ``(first_step + steps) * block_k``, writing h there: the RMSNorm's
    statistics over the whole rows (``_wide_inverse_rms`` when ``wide_rms``), each x tile normalised, times the router's tile on the tensor
    cores, and (independent routing) h's bits folded into the rows' hashes (sums mod 2^32, so
    partial sums add up to the whole)."""
    (n, hidden), dtype = x_ref.shape, x_ref.dtype
    m0, rows = _row_block()
    x_mask = jnp.broadcast_to(rows < n, (ROWS_PER_PROGRAM, block_k))
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def load_x(k0):
        return plgpu.load(x_ref.at[pl.ds(m0, ROWS_PER_PROGRAM), pl.ds(k0, block_k)], mask=x_mask, other=0)

    inv_rms = _wide_inverse_rms(x_ref, rows, eps) if wide_rms else inverse_rms(load_x, hidden, ROWS_PER_PROGRAM,
                                                                                block_k, eps)

    def body(step, carry):
        logits, hashes = carry
        k0 = pl.multiple_of((first_step + step) * block_k, block_k)
        weight = plgpu.load(norm_ref.at[pl.ds(k0, block_k)]).astype(dtype)
        h = weight[None, :] * (load_x(k0).astype(jnp.float32) * inv_rms).astype(dtype)
        plgpu.store(h_ref.at[pl.ds(m0, ROWS_PER_PROGRAM), pl.ds(k0, block_k)], h, mask=x_mask)
        router = plgpu.load(router_ref.at[pl.ds(k0, block_k), :])
        logits = logits + lax.dot(h, router, precision=precision, preferred_element_type=jnp.float32)
        if independent:
            position = (k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)).astype(jnp.uint32)
            hashes = hashes + jnp.sum(hash_terms(element_bits(h), position), axis=1, keepdims=True, dtype=jnp.uint32)
        return logits, hashes

    return lax.fori_loop(0, steps, body, (jnp.zeros((ROWS_PER_PROGRAM, router_ref.shape[1]), jnp.float32),
                                          jnp.zeros((ROWS_PER_PROGRAM, 1), jnp.uint32)))


def _finish_route(logits, hashes, bias_ref, popularity_ref, experts_ref, weights_ref, *, n: int, dtype,
                  num_experts: int, top_k: int, norm_topk_prob: bool):
    """From the rows' f32 logits [16, E'] (and hashes): the product rounded to x's dtype as the
    reference's h @ router, the bias, softmax over the E real experts in f32, the top k by k rounds
    of max and lowest index (``lax.top_k``'s order; padded experts score -inf) or the hashed
    independent draw, their (renormalised) weights, stored."""
    _, rows = _row_block()
    padded = logits.shape[1]
    cols = lax.broadcasted_iota(jnp.int32, (1, padded), 1)
    logits = logits.astype(dtype)
    if bias_ref is not None:
        logits = logits + plgpu.load(bias_ref.at[:]).astype(dtype)[None, :]
    valid = cols < num_experts
    logits = jnp.where(valid, logits.astype(jnp.float32), -jnp.inf)
    exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = exp / jnp.sum(exp, axis=1, keepdims=True)
    if popularity_ref is not None:
        popularity = plgpu.load(popularity_ref.at[:])[None, :]
        scores = jnp.where(valid, gumbel_scores(mix32(hashes), cols.astype(jnp.uint32), popularity), -jnp.inf)
    else:
        scores = probs
    k_padded = next_power_of_2(top_k)
    slot = lax.broadcasted_iota(jnp.int32, (1, k_padded), 1)
    experts = jnp.zeros((ROWS_PER_PROGRAM, k_padded), jnp.int32)
    weights = jnp.zeros((ROWS_PER_PROGRAM, k_padded), jnp.float32)
    for j in range(top_k):
        best = jnp.max(scores, axis=1, keepdims=True)
        expert = jnp.min(jnp.where(scores == best, cols, padded), axis=1, keepdims=True)
        chosen = cols == expert
        experts = jnp.where(slot == j, expert, experts)
        weights = jnp.where(slot == j, jnp.sum(jnp.where(chosen, probs, 0.0), axis=1, keepdims=True), weights)
        scores = jnp.where(chosen, -jnp.inf, scores)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    out_mask = (rows < n) & (slot < top_k)
    plgpu.store(experts_ref.at[rows, slot], experts, mask=out_mask)
    plgpu.store(weights_ref.at[rows, slot], weights.astype(weights_ref.dtype), mask=out_mask)


def _optional_refs(refs: list, has_bias: bool, independent: bool):
    """(bias ref or None, log-popularity ref or None, the rest) of a kernel's trailing refs."""
    bias_ref = refs.pop(0) if has_bias else None
    popularity_ref = refs.pop(0) if independent else None
    return bias_ref, popularity_ref, refs


def _route_kernel(x_ref, norm_ref, router_ref, *refs, block_k: int, num_experts: int, top_k: int, eps: float,
                  norm_topk_prob: bool, has_bias: bool, independent: bool):
    """One launch. Program i: rows i * 16 .. i * 16 + 15 of x [N, H]; router [H, E'], then refs:
    (bias [E'],) (log popularity [E'] f32,) and the outputs h [N, H], experts [N, k], weights
    [N, k]. E' is the ``num_experts`` E padded with zeros to a power of two >= 16."""
    bias_ref, popularity_ref, (h_ref, experts_ref, weights_ref) = _optional_refs(list(refs), has_bias, independent)
    n, hidden = x_ref.shape
    logits, hashes = _partial_logits(x_ref, norm_ref, router_ref, h_ref, 0, hidden // block_k, block_k=block_k,
                                     eps=eps, independent=independent, wide_rms=False)
    _finish_route(logits, hashes, bias_ref, popularity_ref, experts_ref, weights_ref, n=n, dtype=x_ref.dtype,
                  num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob)


def _route_shares_kernel(x_ref, norm_ref, router_ref, h_ref, logits_ref, *hashes_ref, block_k: int,
                         steps_per_split: int, eps: float, independent: bool):
    """The first of two launches. Program (i, s): rows i * 16 .. of x [N, H] over the s-th share of
    the hidden size: h there, and the share's f32 logits [S, N, E'] (and, for independent routing,
    hashes [S, N, 1])."""
    n = x_ref.shape[0]
    split = pl.program_id(1)
    logits, hashes = _partial_logits(x_ref, norm_ref, router_ref, h_ref, split * steps_per_split, steps_per_split,
                                     block_k=block_k, eps=eps, independent=independent, wide_rms=True)
    _, rows = _row_block()
    cols = lax.broadcasted_iota(jnp.int32, (1, logits.shape[1]), 1)
    plgpu.store(logits_ref.at[split, rows, cols], logits, mask=jnp.broadcast_to(rows < n, logits.shape))
    if independent:
        plgpu.store(hashes_ref[0].at[split, rows, jnp.zeros((1, 1), jnp.int32)], hashes, mask=rows < n)


def _finish_shares_kernel(logits_ref, *refs, dtype, num_experts: int, top_k: int, norm_topk_prob: bool,
                          has_bias: bool, independent: bool):
    """The second launch. Program i: rows i * 16 .. of the shares' logits [S, N, E'] (and, for
    independent routing, hashes [S, N, 1]), summed in share order (deterministic), then
    ``_finish_route``."""
    refs = list(refs)
    hashes_ref = refs.pop(0) if independent else None
    bias_ref, popularity_ref, (experts_ref, weights_ref) = _optional_refs(refs, has_bias, independent)
    num_splits, n, padded = logits_ref.shape
    _, rows = _row_block()
    cols = lax.broadcasted_iota(jnp.int32, (1, padded), 1)

    def add(split, carry):
        logits, hashes = carry
        logits = logits + plgpu.load(logits_ref.at[split, rows, cols], mask=jnp.broadcast_to(rows < n, logits.shape),
                                     other=0)
        if independent:
            hashes = hashes + plgpu.load(hashes_ref.at[split, rows, jnp.zeros((1, 1), jnp.int32)], mask=rows < n,
                                         other=0)
        return logits, hashes

    logits, hashes = lax.fori_loop(0, num_splits, add, (jnp.zeros((ROWS_PER_PROGRAM, padded), jnp.float32),
                                                        jnp.zeros((ROWS_PER_PROGRAM, 1), jnp.uint32)))
    _finish_route(logits, hashes, bias_ref, popularity_ref, experts_ref, weights_ref, n=n, dtype=dtype,
                  num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob)


def route_blocks(hidden: int, padded_experts: int, itemsize: int, min_steps: int = 1) -> int:
    """The hidden size one step reduces: the largest power of two <= 128 that divides it, keeps
    the router's tile within ``TILE_BYTES`` and leaves at least ``min_steps`` steps; else 16."""
    return next((b for b in (128, 64, 32) if hidden % b == 0 and b * padded_experts * itemsize <= TILE_BYTES
                 and hidden // b >= min_steps), 16)


def route_splits(rows: int, steps: int, num_sms: int) -> int:
    """Shares of the hidden size: enough programs to cover the GPU's SMs (at one row, every step
    of the router its own program), at most one a step, a divisor of the steps."""
    splits = max(1, min(steps, num_sms // pl.cdiv(rows, ROWS_PER_PROGRAM)))
    while steps % splits:
        splits -= 1
    return splits


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "eps", "skew", "interpret", "block_k",
                                             "num_splits", "num_warps", "num_stages"))
def route(x: jax.Array, norm_weight: jax.Array, router: jax.Array, router_bias: jax.Array | None = None, *,
          top_k: int, norm_topk_prob: bool, eps: float, skew: float | None = None, interpret: bool = False,
          block_k: int | None = None, num_splits: int | None = None, num_warps: int = 4,
          num_stages: int | None = None):
    """Pallas version of ``route_reference`` (same arguments and results; the logits within the
    rounding of the product's f32 sums, so near-tied experts may come out in another order).
    ``block_k`` (default ``route_blocks``, leaving steps for up to ``MAX_SHARES`` shares unless
    ``num_splits`` is 1): hidden dims a step reduces; ``num_splits`` (default ``route_splits``):
    shares of the hidden size, each its own program, whose f32 logits a second launch adds in
    order and finishes (1: one launch, one program per 16 rows streaming the whole router);
    ``num_stages``: default 2, fewer where shared memory is short."""
    check_route_args(x, norm_weight, router, router_bias, top_k)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16) or router.dtype != x.dtype:
        raise ValueError(f"x and router must share a float32/bfloat16/float16 dtype, got {x.dtype} and {router.dtype}")
    (n, hidden), num_experts = x.shape, router.shape[1]
    if hidden % 16:
        raise ValueError(f"the hidden size must be a multiple of 16, got {hidden}")
    padded, limits = max(16, next_power_of_2(num_experts)), gpu_limits()
    row_programs = pl.cdiv(n, ROWS_PER_PROGRAM)
    if block_k is None:  # split: room for a share per SM, up to MAX_SHARES
        shares = 1 if num_splits == 1 else min(MAX_SHARES, max(1, limits.num_sms // row_programs))
        block_k = route_blocks(hidden, padded, x.dtype.itemsize, min_steps=shares)
    if not (is_power_of_2(block_k) and block_k >= 16 and hidden % block_k == 0):
        raise ValueError(f"block_k must be a power of two >= 16 that divides the hidden size {hidden}, got {block_k}")
    steps = hidden // block_k
    num_splits = route_splits(n, steps, limits.num_sms) if num_splits is None else num_splits
    if not 1 <= num_splits <= steps or steps % num_splits:
        raise ValueError(f"num_splits must divide the {steps} steps of block_k {block_k} over the hidden size "
                         f"{hidden}, got {num_splits}")
    stage_bytes = (ROWS_PER_PROGRAM + padded) * block_k * x.dtype.itemsize
    stages = num_stages or max(1, min(2, limits.smem_budget // stage_bytes))
    if stages * stage_bytes > limits.smem_budget:
        raise ValueError(f"num_stages={stages} stages of {stage_bytes} B exceed the {limits.smem_budget} B of "
                         "shared memory a program may use: take a smaller block_k or fewer stages")
    check_launch(num_warps, stages)
    pad = lambda a: a if padded == num_experts else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, padded - num_experts)])  # noqa: E731
    extras = [] if router_bias is None else [pad(router_bias)]
    if skew is not None:
        extras.append(pad(log_popularity(num_experts, skew)))
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=stages)
    h_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    choice_shapes = (jax.ShapeDtypeStruct((n, top_k), jnp.int32), jax.ShapeDtypeStruct((n, top_k), x.dtype))
    finish = dict(num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob,
                  has_bias=router_bias is not None, independent=skew is not None)
    operands = [x, norm_weight, pad(router)]
    if num_splits == 1:
        out_shapes = (h_shape, *choice_shapes)
        return pl.pallas_call(
            functools.partial(_route_kernel, block_k=block_k, eps=eps, **finish),
            grid=(row_programs,), in_specs=[whole(a) for a in operands + extras],
            out_specs=[whole(o) for o in out_shapes], out_shape=out_shapes, compiler_params=params,
            interpret=interpret, name="moe_route",
        )(*operands, *extras)
    share_shapes = (h_shape, jax.ShapeDtypeStruct((num_splits, n, padded), jnp.float32))
    if skew is not None:
        share_shapes += (jax.ShapeDtypeStruct((num_splits, n, 1), jnp.uint32),)
    h, *shares = pl.pallas_call(
        functools.partial(_route_shares_kernel, block_k=block_k, steps_per_split=steps // num_splits, eps=eps,
                          independent=skew is not None),
        grid=(row_programs, num_splits), in_specs=[whole(a) for a in operands],
        out_specs=[whole(o) for o in share_shapes], out_shape=share_shapes, compiler_params=params,
        interpret=interpret, name="moe_route_shares",
    )(*operands)
    experts, weights = pl.pallas_call(
        functools.partial(_finish_shares_kernel, dtype=x.dtype, **finish),
        grid=(row_programs,), in_specs=[whole(a) for a in shares + extras],
        out_specs=[whole(o) for o in choice_shapes], out_shape=choice_shapes,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="moe_route_finish",
    )(*shares, *extras)
    return h, experts, weights

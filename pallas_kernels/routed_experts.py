"""Routed SwiGLU experts of a MoE layer: each token's ``top_k`` experts, weighted and summed.
Optionally with per-expert biases on both projections and gpt-oss's clamped SwiGLU
(``swiglu_limit``: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)).

The reference is the grouped matmul XLA offers: the (token, expert) pairs sorted by expert,
``jax.lax.ragged_dot`` over the expert groups for gate|up and for down, the weighted outputs
scattered back onto their tokens. It is exact and runs anywhere; on a GPU, XLA's ragged_dot
reads every expert's weights whatever the routing (``benchmarks/RESULTS.md``).

An expert id of -1 marks a pair this call does not run (under expert parallelism, a pair routed
to an expert another device holds): it adds 0, takes no row of any tile and reads nothing.

Either weight may be an ``Mxfp4Weight`` (gpt-oss's released format, 4.25 bits a weight); the
reference dequantises it first (``dequantize_mxfp4``). ``expert_tiles`` lays the pairs out in
tiles of one expert each, as the kernels of both backends read them (``pallas_kernels.gpu`` and
``pallas_kernels.tpu``).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
COUNTING_LIMIT = 1 << 20  # pairs x experts whose running counts (4 MB of int32) expert_tiles keeps


class Mxfp4Weight(NamedTuple):
    """An expert weight [E, K, N] in MXFP4: blocks [E, K/2, N] u8, byte (k // 2, n) holding the
    FP4 E2M1 codes of k even (low nibble) and k odd (high nibble); scales [E, K/32, N] u8, the
    E8M0 scale 2^(s - 127) of each 32 values of k. K is a multiple of 32. gpt-oss's checkpoint
    tensors ``*_blocks`` [E, N, K/32, 16] and ``*_scales`` [E, N, K/32] become
    ``Mxfp4Weight(blocks.reshape(E, N, K // 2).transpose(0, 2, 1), scales.transpose(0, 2, 1))``."""

    blocks: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [E, K, N]."""
        *lead, half, n = self.blocks.shape
        return (*lead, 2 * half, n)


def e2m1(codes: jax.Array) -> jax.Array:
    """The float32 values of FP4 E2M1 codes (int32 in [0, 16)): sign, 2 exponent bits, 1 mantissa
    bit; 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (-0 for code 8)."""
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    quarters = jnp.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)  # 4 x the magnitude
    magnitude = quarters.astype(jnp.float32) * 0.25
    return jnp.where(codes >= 8, -magnitude, magnitude)


def e8m0(scales: jax.Array) -> jax.Array:
    """2^(s - 127) in float32 for E8M0 scales s in [1, 254], built as the float's exponent bits;
    s = 0 gives 0 (not 2^-127, below float32's normal range) and s = 255 (NaN in the MX spec) inf."""
    return lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)


def dequantize_mxfp4(w: Mxfp4Weight, dtype) -> jax.Array:
    """The [E, K, N] values of an MXFP4 weight in ``dtype``: code x scale, computed in float32 and
    exact in float32 and bfloat16 (dflash_jax.loading.mxfp4.dequantize's values bit for bit) for scales in
    [2, 254]; s = 0 gives zeros and s = 255 infinities/NaNs (see ``e8m0``; the host's decoder,
    as transformers', scales by 2^-127 and 2^128 there: neither occurs in released weights), and
    float16 overflows or rounds beyond its narrower range."""
    num_experts, k, n = w.shape
    packed = w.blocks.astype(jnp.int32)
    codes = jnp.stack([packed & 15, packed >> 4], axis=2).reshape(num_experts, k, n)  # k = 2 (k // 2) + nibble
    scales = jnp.repeat(e8m0(w.scales), 32, axis=1)
    return (e2m1(codes) * scales).astype(dtype)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For routing experts [N, k]: (order [N*k]: the flattened pairs sorted by expert, stably;
    tokens [N*k]: each sorted pair's token; group_sizes [E] int32: pairs per expert). Pairs of
    expert -1 sort first and count in no group."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counted = jnp.where(flat >= 0, flat, num_experts)  # past the end: dropped
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[counted].add(1, mode="drop")
    return order, order // experts.shape[1], group_sizes


def swiglu(gate: jax.Array, up: jax.Array, swiglu_limit: float | None, swiglu_alpha: float) -> jax.Array:
    """silu(gate) * up, or for a ``swiglu_limit`` gpt-oss's clamped form."""
    if swiglu_limit is None:
        return gate / (1 + jnp.exp(-gate)) * up
    gate = jnp.minimum(gate, swiglu_limit)
    up = jnp.clip(up, -swiglu_limit, swiglu_limit)
    return (up + 1) * (gate / (1 + jnp.exp(-swiglu_alpha * gate)))


def routed_experts_reference(x: jax.Array, experts: jax.Array, weights: jax.Array,
                             gate_up: jax.Array | Mxfp4Weight, down: jax.Array | Mxfp4Weight,
                             gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
                             swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> jax.Array:
    """sum_j weights[n, j] * down_e(swiglu(gate_e(x_n), up_e(x_n))) for e = experts[n, j].

    x [N, H]; experts [N, k] int32 in [0, E), or -1 for a pair that adds nothing; weights
    [N, k]; gate_up [E, H, 2I] (gate | up); down [E, I, H], either in x's dtype or an
    ``Mxfp4Weight`` (dequantised to x's dtype); biases gate_up_bias [E, 2I] and down_bias [E, H]
    or None (added to each projection, before the routing weight). Products are rounded to x's
    dtype (as torch's Linear), the weighted sum is accumulated in f32 and returned [N, H] in x's
    dtype.
    """
    gate_up, down = (dequantize_mxfp4(w, x.dtype) if isinstance(w, Mxfp4Weight) else w for w in (gate_up, down))
    weights = jnp.where(experts >= 0, weights, jnp.zeros((), weights.dtype))
    experts = jnp.maximum(experts, 0)
    num_experts = gate_up.shape[0]
    order, tokens, group_sizes = sort_by_expert(experts, num_experts)
    row_expert = experts.reshape(-1)[order]
    gate_up_out = jax.lax.ragged_dot(x[tokens], gate_up, group_sizes)
    if gate_up_bias is not None:
        gate_up_out = gate_up_out + gate_up_bias[row_expert]
    gate, up = jnp.split(gate_up_out, 2, axis=-1)
    out = jax.lax.ragged_dot(swiglu(gate, up, swiglu_limit, swiglu_alpha).astype(x.dtype), down, group_sizes)
    if down_bias is not None:
        out = out + down_bias[row_expert]
    scaled = (out * weights.reshape(-1)[order][:, None]).astype(jnp.float32)
    return jnp.zeros(x.shape, jnp.float32).at[tokens].add(scaled).astype(x.dtype)


def expert_tiles(experts: jax.Array, num_experts: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The pairs of routing experts [N, k] laid out in tiles of ``block_m`` rows, one expert per
    tile, each expert's pairs in token order: (rows [T * block_m]: the pair (n * k + j) each row
    holds, -1 for padding; tile_expert [T]: each tile's expert, -1 for a tile with no rows).
    Pairs of expert -1 are in no row.
    T = ceil(N k / block_m) + min(E, N k) bounds the tiles any routing needs (each expert with
    rows adds at most one partial tile). Up to ``COUNTING_LIMIT`` pairs x experts each pair's rank
    among its expert's pairs is counted (a running count per expert: a decode step runs a handful
    of small fused ops, no sort); past it (long prefills, where the counts would take hundreds of
    MB) the pairs are sorted."""
    pairs = experts.size
    flat = experts.reshape(-1)
    here = flat >= 0
    known = jnp.where(here, flat, 0)   # (any expert: the pairs of -1 are dropped below)
    if pairs * num_experts <= COUNTING_LIMIT:
        running = jnp.cumsum(flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype)[None, :], axis=0,
                             dtype=jnp.int32)                         # [P, E]: pairs so far per expert
        sizes = running[-1]
        within = jnp.take_along_axis(running, known[:, None], axis=1)[:, 0] - 1  # rank among its expert's pairs
    else:
        order, _, sizes = sort_by_expert(experts, num_experts)
        starts = jnp.cumsum(sizes) - sizes + (pairs - jnp.sum(sizes))  # (the pairs of -1 sort first)
        within = jnp.zeros((pairs,), jnp.int32).at[order].set(
            jnp.arange(pairs, dtype=jnp.int32) - starts[known[order]])
    padded = (sizes + block_m - 1) // block_m * block_m
    padded_end = jnp.cumsum(padded)
    num_tiles = pl.cdiv(pairs, block_m) + min(num_experts, pairs)
    slot = jnp.where(here, (padded_end - padded)[known] + within, num_tiles * block_m)
    rows = jnp.full((num_tiles * block_m,), -1, jnp.int32).at[slot].set(jnp.arange(pairs, dtype=jnp.int32),
                                                                        mode="drop")
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    tile_expert = jnp.sum(padded_end[None, :] <= tile_start[:, None], axis=1, dtype=jnp.int32)
    return rows, jnp.where(tile_start < padded_end[-1], tile_expert, -1)


def token_tiles(experts: jax.Array, block_m: int) -> tuple[jax.Array, jax.Array]:
    """``expert_tiles``' layout for one token's experts [1, k] (a decode step at batch 1, whose
    pairs never share an expert): tile j holds pair j in its first row, expert experts[0, j]
    (-1 tiles may lie between used ones); no op but a constant and a reshape."""
    (n, top_k) = experts.shape
    if n != 1:
        raise ValueError(f"token_tiles lays out one token's experts, got {n} tokens")
    rows = np.where(np.arange(block_m)[None, :] == 0, np.arange(top_k)[:, None], -1).reshape(-1)
    return jnp.asarray(rows, jnp.int32), experts.reshape(-1).astype(jnp.int32)


def _check_mxfp4(name: str, w: Mxfp4Weight) -> None:
    """An MXFP4 weight's own layout: u8 blocks [E, K/2, N] and scales [E, K/32, N], K a multiple of 32."""
    if w.blocks.dtype != jnp.uint8 or w.scales.dtype != jnp.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {w.blocks.dtype} and {w.scales.dtype}")
    if len(w.blocks.shape) != 3 or w.blocks.shape[1] % 16:
        raise ValueError(f"{name}: MXFP4 blocks must be [E, K/2, N] with K a multiple of 32, got "
                         f"{list(w.blocks.shape)}")
    num_experts, half, n = w.blocks.shape
    if w.scales.shape != (num_experts, half // 16, n):
        raise ValueError(f"{name}: MXFP4 scales must be [E, K/32, N] = {[num_experts, half // 16, n]} for blocks "
                         f"{list(w.blocks.shape)}, got {list(w.scales.shape)}")


def check_routed_experts_args(x, experts, weights, gate_up, down) -> None:
    mxfp4 = [isinstance(w, Mxfp4Weight) for w in (gate_up, down)]
    for name, w, quantized in zip(("gate_up", "down"), (gate_up, down), mxfp4):
        if quantized:
            _check_mxfp4(name, w)
    if x.ndim != 2 or len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ValueError(f"x must be [N, H], gate_up [E, H, 2I] and down [E, I, H]; got {x.shape}, "
                         f"{gate_up.shape}, {down.shape}")
    num_experts, hidden, width = gate_up.shape[0], x.shape[1], down.shape[1]
    if gate_up.shape != (num_experts, hidden, 2 * width) or down.shape != (num_experts, width, hidden):
        raise ValueError(f"gate_up {gate_up.shape} and down {down.shape} must be [E, H, 2I] and [E, I, H] with "
                         f"H = {hidden}")
    if experts.ndim != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(f"experts and weights must be [N, k] with N = {x.shape[0]}, got {experts.shape} and "
                         f"{weights.shape}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must be integer expert ids, got {experts.dtype}")
    dtypes = [None if quantized else w.dtype for w, quantized in zip((gate_up, down), mxfp4)]
    if x.dtype not in _SUPPORTED_DTYPES or any(d not in (None, x.dtype) for d in dtypes):
        raise ValueError(f"x, gate_up and down must share a float32/bfloat16/float16 dtype (a weight may be an "
                         f"Mxfp4Weight instead), got {x.dtype}, {dtypes[0] or 'mxfp4'}, {dtypes[1] or 'mxfp4'}")
    if hidden % 16 or width % 16:
        raise ValueError(f"the hidden size ({hidden}) and the expert width ({width}) must be multiples of 16")
    if x.shape[0] == 0 or experts.shape[1] == 0:
        raise ValueError(f"routed_experts needs at least one token and one expert per token, got experts "
                         f"{experts.shape}")

"""Routed SwiGLU experts of a MoE layer: each token's ``top_k`` experts, weighted and summed.
Optionally with per-expert biases on both projections and gpt-oss's clamped SwiGLU
(``swiglu_limit``: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)).

The reference is the grouped matmul XLA offers: the (token, expert) pairs sorted by expert,
``jax.lax.ragged_dot`` over the expert groups for gate|up and for down, the weighted outputs
scattered back onto their tokens. It is exact and runs anywhere; on a GPU, XLA's ragged_dot
reads every expert's weights whatever the routing (``benchmarks/RESULTS.md``).

The kernels read only the routed experts' weights, as vLLM's fused-MoE kernel does: the pairs
are grouped by expert and each expert's rows padded to whole tiles of ``block_m`` rows, so a
tile belongs to one expert (``expert_tiles``, a few fused XLA ops: no sort). One kernel computes
silu(x W_gate) * (x W_up) for every tile (gathering the tile's token rows of x), the other the
down projection times the routing weight, written back in pair order; XLA sums each token's k
rows. A tile with no rows streams nothing. At one token (decode) the 8 routed experts are 8
tiles of one row each: the weights are read once, as a matrix-vector product must.

An expert id of -1 marks a pair this call does not run (under expert parallelism, a pair routed
to an expert another device holds): it adds 0, takes no row of any tile and reads nothing.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import check_launch, gpu_limits, is_power_of_2, next_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TUNING_ARGS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
COUNTING_LIMIT = 1 << 20  # pairs x experts whose running counts (4 MB of int32) expert_tiles keeps


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


def routed_experts_reference(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array,
                             down: jax.Array, gate_up_bias: jax.Array | None = None,
                             down_bias: jax.Array | None = None, *, swiglu_limit: float | None = None,
                             swiglu_alpha: float = 1.702) -> jax.Array:
    """sum_j weights[n, j] * down_e(swiglu(gate_e(x_n), up_e(x_n))) for e = experts[n, j].

    x [N, H]; experts [N, k] int32 in [0, E), or -1 for a pair that adds nothing; weights
    [N, k]; gate_up [E, H, 2I] (gate | up); down [E, I, H]; biases gate_up_bias [E, 2I] and
    down_bias [E, H] or None (added to each projection, before the routing weight). Products are
    rounded to x's dtype (as torch's Linear), the weighted sum is accumulated in f32 and returned
    [N, H] in x's dtype.
    """
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


def _tile_pairs(rows_ref, tile, block_m: int):
    """(pairs [block_m], valid [block_m]) of a tile's rows."""
    pair = plgpu.load(rows_ref.at[pl.ds(tile * block_m, block_m)])
    return pair, pair >= 0


def _gate_up_kernel(rows_ref, tile_expert_ref, x_ref, w_ref, *refs, top_k: int, block_m: int, block_n: int,
                    block_k: int, swiglu_limit: float | None, swiglu_alpha: float):
    """Program (tile, column block): swiglu(x W_gate [+ b_gate], x W_up [+ b_up]) of the tile's
    rows, [block_m, block_n]; refs: (bias [E, 2I],) h."""
    *bias_ref, h_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[tile]
    hidden, width = x_ref.shape[1], h_ref.shape[1]
    pair, valid = _tile_pairs(rows_ref, tile, block_m)
    token = jnp.where(valid, pair // top_k, 0)
    e = jnp.maximum(expert, 0)
    n0 = col * block_n
    k_iota = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    x_mask = jnp.broadcast_to(valid[:, None], (block_m, block_k))
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)

    def body(step, accs):
        k0 = pl.multiple_of(step * block_k, block_k)
        x = plgpu.load(x_ref.at[token[:, None], k0 + k_iota], mask=x_mask, other=0)
        gate = plgpu.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(n0, block_n)])
        up = plgpu.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(width + n0, block_n)])
        return accs[0] + dot(x, gate), accs[1] + dot(x, up)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    # a tile with no rows streams nothing (a product, not a select: Triton wants an i32 bound)
    steps = (hidden // block_k) * (expert >= 0).astype(jnp.int32)
    gate, up = lax.fori_loop(0, steps, body, (zeros, zeros))
    if bias_ref:
        gate = gate + plgpu.load(bias_ref[0].at[e, pl.ds(n0, block_n)]).astype(jnp.float32)[None, :]
        up = up + plgpu.load(bias_ref[0].at[e, pl.ds(width + n0, block_n)]).astype(jnp.float32)[None, :]
    h = swiglu(gate, up, swiglu_limit, swiglu_alpha)
    plgpu.store(h_ref.at[pl.ds(tile * block_m, block_m), pl.ds(n0, block_n)], h.astype(h_ref.dtype),
                mask=jnp.broadcast_to(valid[:, None], (block_m, block_n)))


def _down_kernel(rows_ref, tile_expert_ref, weights_ref, h_ref, w_ref, *refs, block_m: int, block_n: int,
                 block_k: int):
    """Program (tile, column block): routing weight x (h W_down [+ b_down]) of the tile's rows,
    f32, stored at each row's pair (out [N * k, H]); refs: (bias [E, H],) out."""
    *bias_ref, out_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    expert = tile_expert_ref[tile]
    width = h_ref.shape[1]
    pair, valid = _tile_pairs(rows_ref, tile, block_m)
    e = jnp.maximum(expert, 0)
    n0 = col * block_n
    r0 = tile * block_m
    h_mask = jnp.broadcast_to(valid[:, None], (block_m, block_k))
    precision = lax.Precision.HIGHEST if h_ref.dtype == jnp.float32 else None
    dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)

    def body(step, acc):
        k0 = pl.multiple_of(step * block_k, block_k)
        h = plgpu.load(h_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], mask=h_mask, other=0)
        return acc + dot(h, plgpu.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(n0, block_n)]))

    steps = (width // block_k) * (expert >= 0).astype(jnp.int32)
    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    if bias_ref:
        acc = acc + plgpu.load(bias_ref[0].at[e, pl.ds(n0, block_n)]).astype(jnp.float32)[None, :]
    weight = plgpu.load(weights_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0).astype(jnp.float32)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    # padding rows point past the end too, so that interpret mode's scatter drops them as well
    row = jnp.where(valid, pair, out_ref.shape[0])
    plgpu.store(out_ref.at[row[:, None], cols], acc * weight[:, None],
                mask=jnp.broadcast_to(valid[:, None], (block_m, block_n)))


def _largest_divisor(n: int, choices: tuple[int, ...]) -> int:
    return next((c for c in choices if n % c == 0), choices[-1])


def check_routed_experts_args(x, experts, weights, gate_up, down) -> None:
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
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
    if x.dtype not in _SUPPORTED_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x, gate_up and down must share a float32/bfloat16/float16 dtype, got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}")
    if hidden % 16 or width % 16:
        raise ValueError(f"the hidden size ({hidden}) and the expert width ({width}) must be multiples of 16")
    if x.shape[0] == 0 or experts.shape[1] == 0:
        raise ValueError(f"routed_experts needs at least one token and one expert per token, got experts "
                         f"{experts.shape}")


def tile_rows(pairs: int, num_experts: int) -> int:
    """Rows per tile: the pairs an expert gets on average, as a power of two in [16, 64] (16 is
    the smallest tensor-core tile; each tile streams its expert's weights once, so fewer, fuller
    tiles read less when many tokens share an expert)."""
    return min(64, max(16, next_power_of_2(-(-pairs // num_experts))))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "interpret", *TUNING_ARGS))
def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                   gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
                   swiglu_limit: float | None = None, swiglu_alpha: float = 1.702, interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> jax.Array:
    """Pallas version of ``routed_experts_reference`` (same arguments; the result within the
    rounding of its products, which the kernel keeps in f32 and rounds once): reads only the
    routed experts' weights. ``block_m`` rows per tile (default ``tile_rows``), ``block_n``
    output columns and ``block_k`` reduced dims per step (default: the largest of 64, 32, 16 and
    of 128, 64, 32, 16 that divide them), ``num_stages`` software-pipelined steps (default: up to
    3, as many as shared memory holds)."""
    check_routed_experts_args(x, experts, weights, gate_up, down)
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (gate_up.shape[0], gate_up.shape[2])),
                              ("down_bias", down_bias, (down.shape[0], down.shape[2]))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"{name} must be [E, {'2I' if name == 'gate_up_bias' else 'H'}] = {list(shape)}, "
                             f"got {list(bias.shape)}")
    block_m = tile_rows(experts.size, gate_up.shape[0]) if block_m is None else block_m
    if not (is_power_of_2(block_m) and block_m >= 16):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    check_launch(num_warps, num_stages or 1)
    (n, top_k), (num_experts, hidden, _), width = experts.shape, gate_up.shape, down.shape[1]
    rows, tile_expert = expert_tiles(experts.astype(jnp.int32), num_experts, block_m)
    num_tiles = tile_expert.shape[0]
    def call(kernel, operands, out_rows, out_cols, reduce, out_dtype, name, weight_tiles):
        bn = block_n or _largest_divisor(out_cols, (64, 32, 16))
        bk = block_k or _largest_divisor(reduce, (128, 64, 32, 16))
        for what, value, size in (("block_n", bn, out_cols), ("block_k", bk, reduce)):
            if not (is_power_of_2(value) and value >= 16) or size % value:
                raise ValueError(f"{name}: {what} must be a power of two >= 16 that divides {size}, got {value}")
        stage_bytes = (block_m + weight_tiles * bn) * bk * x.dtype.itemsize
        budget = gpu_limits().smem_budget
        stages = max(1, min(3, budget // stage_bytes)) if num_stages is None else num_stages
        if stages * stage_bytes > budget:
            raise ValueError(f"{name}: num_stages={stages} stages of {stage_bytes} B (block_m {block_m}, block_n "
                             f"{bn}, block_k {bk}) exceed the {budget} B of shared memory a program may use: take "
                             "smaller tiles or fewer stages")
        whole = lambda a: pl.BlockSpec(a.shape, lambda t, c: (0,) * a.ndim)  # noqa: E731
        return pl.pallas_call(
            functools.partial(kernel, block_m=block_m, block_n=bn, block_k=bk),
            grid=(num_tiles, out_cols // bn),
            in_specs=[whole(a) for a in operands],
            out_specs=pl.BlockSpec((out_rows, out_cols), lambda t, c: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((out_rows, out_cols), out_dtype),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=stages), interpret=interpret,
            name=name,
        )(*operands)

    gate_up_kernel = functools.partial(_gate_up_kernel, top_k=top_k, swiglu_limit=swiglu_limit,
                                       swiglu_alpha=swiglu_alpha)
    h = call(gate_up_kernel, (rows, tile_expert, x, gate_up) + (() if gate_up_bias is None else (gate_up_bias,)),
             num_tiles * block_m, width, hidden, x.dtype, "routed_experts_gate_up", 2)
    out = call(_down_kernel, (rows, tile_expert, weights.reshape(-1), h, down)
               + (() if down_bias is None else (down_bias,)), n * top_k, hidden, width, jnp.float32,
               "routed_experts_down", 1)
    # a pair of expert -1 has no row: its output row was never written
    out = jnp.where((experts >= 0)[..., None], out.reshape(n, top_k, hidden), 0.0)
    return out.sum(axis=1).astype(x.dtype)

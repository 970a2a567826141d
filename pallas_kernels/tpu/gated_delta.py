"""The gated delta rule on TPUs (Mosaic): the token mixer of Qwen3.5 / Qwen3-Next Gated DeltaNet layers.

Same arguments and result as ``gated_delta_rule_reference`` (``pallas_kernels.gated_delta``, where
the rule, the references and the argument checks live): per value head, with the f32 state
S [dk, dv], q̂ = l2norm(q)·dk^-½, k̂ = l2norm(k): S ← e^g·S; δ = β(v − Sᵀk̂); S ← S + k̂⊗δ;
o = Sᵀq̂. Value head j reads key head j // (Hv / Hk); a token with g = 0 and β = 0 leaves S as it is.

One program per (sequence, block of ``block_heads`` value heads: whole key-head groups, so each key
head is read once). q and k are viewed as [B, T, Hk·dk] and v as [B, T, Hv·dv] (free reshapes),
so a block is a lane-aligned column range; g and β come as [T, Hv] blocks and a head's column is
picked by a lane mask (no dynamic lane slicing). The program's f32 state block [block_heads, dk, dv]
is read once and written once, and aliased to the new state (a donated state is updated in place).
The wrapper picks by T:

* T <= ``max_recurrent_len`` (decode, T = 1; verify, T = 2..16): the recurrent kernel walks the
  tokens one at a time on the VPU, a key head's group of value heads together: k̂ and q̂ are
  transposed once to columns [dk, T] (token t's column and g, β, v rows picked by masks, so the
  token loop needs no dynamic lane slicing), Sᵀk̂ and Sᵀq̂ are sublane reductions and k̂⊗δ a
  broadcast product; no dots. Its cost is the state's read and write plus about 7·dk·dv vector
  FLOPs per token and value head.
* Longer T (prefill): the chunked kernel, grid (sequence, head block, chunk) with the chunk axis
  sequential and the state block in a VMEM scratch from the first chunk to the last. Per chunk of
  ``chunk_size`` tokens, on the MXU (f32 dots at HIGHEST precision): L = (βk̂ k̂ᵀ)·e^(cum_i − cum_j)
  strictly below the diagonal; (I + L)⁻¹ by recursive block inversion (the inverse of blocks of
  2s rows is Y − Y B Y, Y the inverse of the diagonal blocks of s rows and B the part of L between
  them: only exact sub-inverses are multiplied, never the large powers of L a Neumann product
  would cancel); u = (I + L)⁻¹ βv, w = (I + L)⁻¹ (βk̂ e^cum), v_new = u − w S,
  o = (q̂ e^cum) S + (q̂ k̂ᵀ e^(cum_i − cum_j), j <= i) v_new, S ← e^total S + (k̂ e^(total − cum))ᵀ v_new.
  The within-chunk cumulative sums of g are taken by the wrapper ([B, T, Hv], tiny), padded with
  zeros to whole chunks; the last chunk's q/k/v rows past T are masked to zero in the kernel.

Limits: compiled (not interpreted), dk and dv must be multiples of 128 (lane tiles). The recurrent
kernel holds all T rows of its heads in VMEM (fine for verify blocks; longer T belongs to the
chunked kernel, whose VMEM does not grow with T).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gated_delta import check_gated_delta_args, l2_normalize
from pallas_kernels.tpu.paged_attention import vmem_capacity

TUNING_ARGS = ("max_recurrent_len", "chunk_size", "block_heads")
STATE_BYTES_PER_BLOCK = 1 << 20  # default recurrent head block: at most this much f32 state
_HIGHEST = lax.Precision.HIGHEST  # every dot multiplies f32 values (normalised keys, decayed rows)


def _iota(shape: tuple[int, ...], dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _dot(a, b, contract=(1, 0)):
    """a @ b (contract (1, 1): a @ bᵀ; (0, 0): aᵀ @ b), f32 at HIGHEST precision."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _head_column(block: jax.Array, head) -> jax.Array:
    """Column ``head`` [rows, 1] of a [rows, Hv] f32 block, selected by a lane mask."""
    return jnp.sum(jnp.where(_iota(block.shape, 1) == head, block, 0.0), axis=1, keepdims=True)


def _recurrent_kernel(*refs, group: int, with_output: bool, with_state: bool):
    """Program (b, head block): the block's tokens one at a time, each value head's state in VMEM.

    Refs: q (with output), k [T, key heads of the block · dk]; v [T, block_heads · dv]; g, beta
    [T, Hv] f32; state [block_heads, dk, dv]; out [T, block_heads · dv] and new state as flagged.
    A key head's group of value heads walks the tokens together (independent work per step).
    """
    if with_output:
        q_ref, *refs = refs
    k_ref, v_ref, g_ref, beta_ref, state_ref, *out_refs = refs
    out_ref = out_refs[0] if with_output else None
    seq_len = v_ref.shape[0]
    block_heads, key_dim, value_dim = state_ref.shape
    first_head = pl.program_id(1) * block_heads
    token_rows = _iota((seq_len, value_dim), 0)

    def key_head(j, carry):
        keys = pl.ds(pl.multiple_of(j * key_dim, key_dim), key_dim)
        k_cols = l2_normalize(k_ref[:, keys]).T  # [dk, T]
        q_cols = (l2_normalize(q_ref[:, keys]) * key_dim ** -0.5).T if with_output else None
        heads = [j * group + i for i in range(group)]
        values = [pl.ds(pl.multiple_of(h * value_dim, value_dim), value_dim) for h in heads]
        decays = [jnp.exp(_head_column(g_ref[...], first_head + h)) for h in heads]  # [T, 1]
        betas = [_head_column(beta_ref[...], first_head + h) for h in heads]
        vs = [v_ref[:, cols].astype(jnp.float32) for cols in values]  # [T, dv]

        def token(t, carry):
            states, outs = carry
            column, row = _iota((1, seq_len), 1) == t, token_rows[:, :1] == t
            k_t = jnp.sum(jnp.where(column, k_cols, 0.0), axis=1, keepdims=True)  # [dk, 1]
            q_t = jnp.sum(jnp.where(column, q_cols, 0.0), axis=1, keepdims=True) if with_output else None
            new_states, new_outs = [], []
            for s, out, decay, beta, v in zip(states, outs, decays, betas, vs):
                s = s * jnp.sum(jnp.where(row, decay, 0.0), axis=0, keepdims=True)
                v_t = jnp.sum(jnp.where(row, v, 0.0), axis=0, keepdims=True)  # [1, dv]
                beta_t = jnp.sum(jnp.where(row, beta, 0.0), axis=0, keepdims=True)
                s = s + k_t * (beta_t * (v_t - jnp.sum(s * k_t, axis=0, keepdims=True)))
                if with_output:
                    out = jnp.where(token_rows == t, jnp.sum(s * q_t, axis=0, keepdims=True), out)
                new_states.append(s)
                new_outs.append(out)
            return new_states, new_outs

        states = [state_ref[h] for h in heads]
        outs = [jnp.zeros((seq_len, value_dim), jnp.float32) for _ in heads]
        states, outs = lax.fori_loop(0, seq_len, token, (states, outs))
        for h, cols, s, out in zip(heads, values, states, outs):
            if with_output:
                out_ref[:, cols] = out.astype(out_ref.dtype)
            if with_state:
                out_refs[-1][h] = s
        return carry

    lax.fori_loop(0, block_heads // group, key_head, 0)


def _unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + L)⁻¹ for L [C, C] strictly lower triangular, by recursive block inversion: with Y the
    inverse over diagonal blocks of s rows and B the part of L joining two such blocks into one of
    2s rows, the inverse over the 2s blocks is Y − Y B Y ((Y B)² = 0)."""
    size = strict.shape[0]
    rows, cols = _iota((size, size), 0), _iota((size, size), 1)

    def joining(span):
        return jnp.where((rows // (2 * span) == cols // (2 * span)) & (rows // span != cols // span), strict, 0.0)

    inverse = (rows == cols).astype(jnp.float32) - joining(1)
    span = 2
    while span < size:
        inverse = inverse - _dot(_dot(inverse, joining(span)), inverse)
        span *= 2
    return inverse


def _chunk_kernel(*refs, group: int, seq_len: int, with_output: bool, with_state: bool):
    """Program (b, head block, chunk c): chunk c of the block's value heads, the state in scratch.
    A key head's k̂ k̂ᵀ and q̂ k̂ᵀ serve its group of value heads.

    Refs: q (with output), k [C, key heads of the block · dk]; v [C, block_heads · dv]; cum (the
    running sum of g within the chunk), beta [C, Hv] f32; state [block_heads, dk, dv]; out
    [C, block_heads · dv] and new state as flagged; the state scratch [block_heads, dk, dv] f32.
    """
    if with_output:
        q_ref, *refs = refs
    k_ref, v_ref, cum_ref, beta_ref, state_ref, *out_refs, s_ref = refs
    out_ref = out_refs[0] if with_output else None
    chunk, num_chunks = pl.program_id(2), pl.num_programs(2)
    size = v_ref.shape[0]
    block_heads, key_dim, value_dim = state_ref.shape
    first_head = pl.program_id(1) * block_heads
    rows, cols = _iota((size, size), 0), _iota((size, size), 1)
    real = chunk * size + _iota((size, 1), 0) < seq_len  # the last chunk's rows past T hold garbage

    @pl.when(chunk == 0)
    def _():
        s_ref[...] = state_ref[...]

    def key_head(j, carry):
        keys = pl.ds(pl.multiple_of(j * key_dim, key_dim), key_dim)
        k = l2_normalize(jnp.where(real, k_ref[:, keys].astype(jnp.float32), 0.0))
        k_k = _dot(k, k, (1, 1))
        if with_output:
            q = l2_normalize(jnp.where(real, q_ref[:, keys].astype(jnp.float32), 0.0)) * key_dim ** -0.5
            q_k = _dot(q, k, (1, 1))

        def value_head(i, carry):
            h = j * group + i
            values = pl.ds(pl.multiple_of(h * value_dim, value_dim), value_dim)
            cum = _head_column(cum_ref[...], first_head + h)  # [C, 1]
            beta = _head_column(beta_ref[...], first_head + h)
            cum_row = cum.T  # [1, C]
            total = cum_row[:, size - 1:]
            decay = jnp.exp(jnp.where(rows >= cols, cum - cum_row, -jnp.inf))
            inverse = _unit_lower_inverse(jnp.where(rows > cols, beta * k_k * decay, 0.0))
            v = jnp.where(real, v_ref[:, values].astype(jnp.float32), 0.0)
            u = _dot(inverse, beta * v)
            w = _dot(inverse, (beta * jnp.exp(cum)) * k)
            s = s_ref[h]
            v_new = u - _dot(w, s)
            if with_output:
                out = _dot(q * jnp.exp(cum), s) + _dot(q_k * decay, v_new)
                out_ref[:, values] = out.astype(out_ref.dtype)
            s_ref[h] = jnp.exp(total) * s + _dot(k * jnp.exp(total - cum), v_new, (0, 0))
            return carry

        return lax.fori_loop(0, group, value_head, carry)

    lax.fori_loop(0, block_heads // group, key_head, 0)

    if with_state:
        @pl.when(chunk == num_chunks - 1)
        def _():
            out_refs[-1][...] = s_ref[...]


def _padded_rows(rows: int, itemsize: int) -> int:
    """Rows of a VMEM block rounded up to whole sublane tiles."""
    tile = 8 * 4 // itemsize
    return -(-rows // tile) * tile


def vmem_estimate(*, recurrent: bool, rows: int, block_heads: int, group: int, value_heads: int, key_dim: int,
                  value_dim: int, itemsize: int) -> int:
    """Bytes of VMEM a program holds: the state blocks in and out (double-buffered by the pipeline)
    and, chunked, the state scratch; the q/k/v/out row blocks (double-buffered); the g/β (or cum/β)
    blocks, lanes padded to 128; the f32 values live at once (recurrent: two states per value head
    of a group and the rows; chunked: about eight [C, C] matrices, eight [C, d] rows and two states)."""
    state = block_heads * key_dim * value_dim * 4
    padded = _padded_rows(rows, itemsize)
    tiles = 2 * padded * (2 * block_heads // group * key_dim + 2 * block_heads * value_dim) * itemsize
    gates = 2 * 2 * _padded_rows(rows, 4) * (-(-value_heads // 128) * 128) * 4
    if recurrent:
        live = 2 * group * key_dim * value_dim * 4 + 6 * padded * max(key_dim, value_dim) * 4
        return 4 * state + tiles + gates + live
    live = 8 * rows * max(rows, 128) * 4 + 8 * rows * max(key_dim, value_dim) * 4 + 2 * key_dim * value_dim * 4
    return 5 * state + tiles + gates + live


def _check_tuning(*, key_dim: int, value_dim: int, group: int, value_heads: int, max_recurrent_len: int,
                  chunk_size: int, block_heads: int, interpret: bool) -> None:
    if max_recurrent_len < 0:
        raise ValueError(f"max_recurrent_len must be >= 0, got {max_recurrent_len}")
    if chunk_size < 16 or chunk_size % 16:
        raise ValueError(f"chunk_size must be a positive multiple of 16 (bf16 sublane tiles), got {chunk_size}")
    if block_heads < 1 or block_heads % group or value_heads % block_heads:
        raise ValueError(f"block_heads must be a multiple of the group size {group} that divides value_heads "
                         f"{value_heads}, got {block_heads}")
    if not interpret and (key_dim % 128 or value_dim % 128):
        raise ValueError(f"key_dim and value_dim must be multiples of 128 (TPU lane tiles), got {key_dim} and "
                         f"{value_dim}")


def default_block_heads(value_heads: int, group: int, key_dim: int, value_dim: int, recurrent: bool) -> int:
    """Value heads per program: recurrent, the most whole key-head groups dividing value_heads with
    at most STATE_BYTES_PER_BLOCK of state; chunked, one group (one key head)."""
    if not recurrent:
        return group
    fitting = max(1, STATE_BYTES_PER_BLOCK // (key_dim * value_dim * 4))
    return max(h for h in range(group, value_heads + 1, group) if value_heads % h == 0 and (h <= fitting or h == group))


@functools.partial(jax.jit, static_argnames=("with_output", "with_state", "interpret", *TUNING_ARGS))
def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array, *,
                     with_output: bool = True, with_state: bool = True, interpret: bool = False,
                     max_recurrent_len: int = 16, chunk_size: int = 64,
                     block_heads: int | None = None) -> tuple[jax.Array | None, jax.Array | None]:
    """TPU version of ``gated_delta_rule_reference`` (same arguments and result).

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv] f32 ->
    (out [B, T, Hv, dv] in v's dtype or None, new state or None). T <= ``max_recurrent_len`` runs
    the recurrent kernel, longer T the chunked kernel (chunks of ``chunk_size`` tokens, a multiple
    of 16); ``block_heads`` value heads per program (whole key-head groups; default: see
    ``default_block_heads``).
    """
    check_gated_delta_args(q, k, v, g, beta, state)
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    group = value_heads // key_heads
    recurrent = seq_len <= max_recurrent_len
    if block_heads is None:
        block_heads = default_block_heads(value_heads, group, key_dim, value_dim, recurrent)
    _check_tuning(key_dim=key_dim, value_dim=value_dim, group=group, value_heads=value_heads,
                  max_recurrent_len=max_recurrent_len, chunk_size=chunk_size, block_heads=block_heads,
                  interpret=interpret)
    if not (with_output or with_state):
        return None, None
    name = "tpu_gated_delta_recurrent" if recurrent else "tpu_gated_delta_chunked"
    itemsize = jnp.dtype(v.dtype).itemsize
    rows = seq_len if recurrent else chunk_size
    needed = vmem_estimate(recurrent=recurrent, rows=rows, block_heads=block_heads, group=group,
                           value_heads=value_heads, key_dim=key_dim, value_dim=value_dim,
                           itemsize=max(itemsize, jnp.dtype(q.dtype).itemsize))
    capacity = None if interpret else vmem_capacity()
    if capacity is not None and needed > capacity * 3 // 4:
        raise ValueError(f"{name}: block_heads={block_heads} value heads of a [{key_dim}, {value_dim}] f32 state "
                         f"and {rows} token rows need about {needed / 2**20:.0f} MiB of VMEM, more than 3/4 of the "
                         f"{capacity / 2**20:.0f} MiB this TPU has: take fewer block_heads or a smaller chunk_size")
    limit = None if capacity is None else min(capacity * 3 // 4, max(32 * 2**20, 2 * needed))

    key_cols = block_heads // group * key_dim
    value_cols = block_heads * value_dim
    flat_q, flat_k = (x.reshape(batch, seq_len, key_heads * key_dim) for x in (q, k))
    flat_v = v.reshape(batch, seq_len, value_heads * value_dim)
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    grid = (batch, value_heads // block_heads)
    if recurrent:
        def key_spec():
            return pl.BlockSpec((None, seq_len, key_cols), lambda b, n: (b, 0, n))
        value_spec = pl.BlockSpec((None, seq_len, value_cols), lambda b, n: (b, 0, n))
        gate_spec = pl.BlockSpec((None, seq_len, value_heads), lambda b, n: (b, 0, 0))
        state_spec = pl.BlockSpec((None, block_heads, key_dim, value_dim), lambda b, n: (b, n, 0, 0))
        gates, scratch = (g, beta), []
        kernel = functools.partial(_recurrent_kernel, group=group, with_output=with_output, with_state=with_state)
        semantics = ("parallel", "parallel")
        padded_len = seq_len
    else:
        num_chunks = -(-seq_len // chunk_size)
        padded_len = num_chunks * chunk_size
        grid += (num_chunks,)

        def key_spec():
            return pl.BlockSpec((None, chunk_size, key_cols), lambda b, n, c: (b, c, n))
        value_spec = pl.BlockSpec((None, chunk_size, value_cols), lambda b, n, c: (b, c, n))
        gate_spec = pl.BlockSpec((None, chunk_size, value_heads), lambda b, n, c: (b, c, 0))
        state_spec = pl.BlockSpec((None, block_heads, key_dim, value_dim), lambda b, n, c: (b, n, 0, 0))
        pad = ((0, 0), (0, padded_len - seq_len), (0, 0))
        cum = jnp.cumsum(jnp.pad(g, pad).reshape(batch, num_chunks, chunk_size, value_heads), axis=2)
        gates = (cum.reshape(batch, padded_len, value_heads), jnp.pad(beta, pad))
        scratch = [pltpu.VMEM((block_heads, key_dim, value_dim), jnp.float32)]
        kernel = functools.partial(_chunk_kernel, group=group, seq_len=seq_len, with_output=with_output,
                                   with_state=with_state)
        semantics = ("parallel", "parallel", "arbitrary")

    operands = ((flat_q,) if with_output else ()) + (flat_k, flat_v, *gates, state)
    in_specs = [key_spec() for _ in range(2 if with_output else 1)] + [value_spec, gate_spec, gate_spec, state_spec]
    out_shape, out_specs = [], []
    if with_output:
        out_shape.append(jax.ShapeDtypeStruct(flat_v.shape, v.dtype))
        out_specs.append(value_spec)
    if with_state:
        out_shape.append(jax.ShapeDtypeStruct(state.shape, jnp.float32))
        out_specs.append(state_spec)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        input_output_aliases={len(operands) - 1: len(out_shape) - 1} if with_state else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit),
        cost_estimate=_cost(recurrent=recurrent, batch=batch, seq_len=seq_len, padded_len=padded_len,
                            chunk_size=chunk_size, key_heads=key_heads, value_heads=value_heads, key_dim=key_dim,
                            value_dim=value_dim, qk_itemsize=jnp.dtype(q.dtype).itemsize, v_itemsize=itemsize,
                            with_output=with_output, with_state=with_state),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*operands)
    out = outs[0].reshape(v.shape) if with_output else None
    return out, (outs[-1] if with_state else None)


def _cost(*, recurrent: bool, batch: int, seq_len: int, padded_len: int, chunk_size: int, key_heads: int,
          value_heads: int, key_dim: int, value_dim: int, qk_itemsize: int, v_itemsize: int, with_output: bool,
          with_state: bool) -> pl.CostEstimate:
    """Bytes: q (with output) and k once per key head, v, the output, g and β (f32, chunked: cum
    and β padded to whole chunks), the state read once and written once (with state). FLOPs:
    recurrent, 7·dk·dv per token and value head (5 without output); chunked, per chunk and value
    head the dots (k̂k̂ᵀ and q̂k̂ᵀ once per key head; the block inversion; u, w; w S, q̂ S and the
    state update with dk·dv; the causal attention with v_new)."""
    state_bytes = batch * value_heads * key_dim * value_dim * 4
    rows_bytes = batch * seq_len * (key_heads * key_dim * qk_itemsize * (2 if with_output else 1)
                                    + value_heads * value_dim * v_itemsize * (2 if with_output else 1))
    gate_bytes = 2 * batch * padded_len * value_heads * 4
    bytes_accessed = state_bytes * (2 if with_state else 1) + rows_bytes + gate_bytes
    heads = batch * value_heads
    if recurrent:
        flops = heads * seq_len * key_dim * value_dim * (7 if with_output else 5)
        transcendentals = heads * seq_len + batch * seq_len * key_heads * (2 if with_output else 1)
    else:
        c, chunks = chunk_size, padded_len // chunk_size
        levels = max(0, math.ceil(math.log2(c)) - 1)
        per_key_head = 2 * c * c * key_dim * (2 if with_output else 1)
        per_value_head = (4 * levels * c ** 3 + 2 * c * c * (key_dim + value_dim) + 4 * c * key_dim * value_dim
                          + ((2 * c * key_dim * value_dim + 2 * c * c * value_dim) if with_output else 0))
        flops = batch * chunks * (key_heads * per_key_head + value_heads * per_value_head)
        transcendentals = heads * chunks * (c * c + 3 * c) + batch * padded_len * key_heads * 2
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)

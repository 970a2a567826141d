"""The gated delta rule on GPUs: the Pallas kernels (Triton lowering) behind
``gated_delta_rule_reference`` (``pallas_kernels.gated_delta``, where the rule, the references
and the argument checks live).

The kernels walk the tokens with one program per (sequence, value head, block of ``block_v``
value dims), which holds its [dk, block_v] block of the state in registers from the first token
to the last: the state is read and written once per call (and aliased, so a donated state is
updated in place). The wrapper picks by T:

* T <= ``max_recurrent_len`` (decode, T = 1; verify, T = 2..16): the recurrent kernel walks the
  tokens one at a time with elementwise products and reductions (no dots; each step loads the
  next token while it computes this one). Its cost is the state's read and write.
* Longer T (prefill): two kernels. The chunk solve, one program per (sequence, value head, chunk
  of ``chunk_size`` tokens), computes the chunk's state-independent part of the UT transform in
  parallel over the chunks: w = (I + L)⁻¹ (βk̂ e^cum) and u = (I + L)⁻¹ βv (f32, [B, T, Hv, dk]
  and [B, T, Hv, dv]), L being βk̂ k̂ᵀ e^(cum_i − cum_j) strictly below the diagonal, by blocked
  forward substitution over sub-blocks of 16 rows (the smallest tensor-core tile; Triton cannot
  slice register tensors, so a chunk is a Python list of sub-blocks): each 16×16 diagonal block
  is inverted by forward substitution over its rows, the blocks below it are applied by dots.
  The chunk scan then walks the chunks with the state block: v_new = u − w S,
  o = (q̂ e^cum) S + (q̂ k̂ᵀ e^(cum_i − cum_j), j <= i) v_new,
  S ← e^total S + (k̂ e^(total − cum))ᵀ v_new.

Every decay is e^x with x <= 0 (no division by a decay); rows past T load as zeros (g = 0, β = 0:
they change nothing) and are never stored. f32 products are exact f32 in interpret mode and three
TF32 tensor-core passes on the GPU (f32-level accuracy; exact f32 FMA dots made a first,
single-kernel version of the chunked path 3x or more slower).
Measurements and the tuning defaults' reasons: ``benchmarks/RESULTS.md`` (Qwen3.5 hybrids, 2026-11-27).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta import check_gated_delta_args, l2_normalize
from pallas_kernels.gpu.tuning import check_launch
from pallas_kernels.sizes import is_power_of_2

TUNING_ARGS = ("max_recurrent_len", "chunk_size", "block_v", "num_warps", "num_stages")
SUB_BLOCK = 16  # rows of the sub-blocks of the chunk solve: the smallest tensor-core tile
SOLVE_NUM_WARPS = 4  # H200: the chunk solve ran 1.5x faster on 4 warps than on 8
_HIGHEST = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# Kernels. Per program, refs hold one sequence's rows: q, k [T, dk] (the key head of the value
# head), v [T, dv or block_v], g, beta [T], state [dk, block_v]; chunk intermediates [T, d].


def _iota(shape: tuple[int, ...], dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _load_rows(ref, start, rows: int, seq_len: int) -> jax.Array:
    """Rows [start, start + rows) of a [T] or [T, width] ref in f32; rows past T read as zeros."""
    valid = start + _iota((rows,), 0) < seq_len
    mask = valid if len(ref.shape) == 1 else jnp.broadcast_to(valid[:, None], (rows, ref.shape[1]))
    return plgpu.load(ref.at[pl.ds(start, rows)], mask=mask, other=0).astype(jnp.float32)


def _store_rows(ref, start, value: jax.Array, seq_len: int) -> None:
    """Store value [rows, width] at rows [start, start + rows) of ref [T, width], those below T only."""
    valid = start + _iota((value.shape[0],), 0) < seq_len
    plgpu.store(ref.at[pl.ds(start, value.shape[0])], value.astype(ref.dtype),
                mask=jnp.broadcast_to(valid[:, None], value.shape))


def _decay(cum_rows: jax.Array, cum_cols: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """e^(cum_i − cum_j), zero where ``mask`` is False (masked before the exp: no overflow)."""
    diff = cum_rows[:, None] - cum_cols[None, :]
    return jnp.exp(diff if mask is None else jnp.where(mask, diff, -jnp.inf))


def _dot(a, b, precision, contract=(1, 0)):
    """a @ b (contract (1, 1): a @ bᵀ; (0, 0): aᵀ @ b), accumulated in f32."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, *out_refs, with_output: bool,
                      with_state: bool):
    """Walk the tokens one at a time, the state block in registers; each step loads the next
    token while it computes this one (the loads do not wait on the state)."""
    out_ref = out_refs[0] if with_output else None
    seq_len, key_dim = k_ref.shape

    def load_token(t):  # t past the end reads the last token again (unused)
        t = jnp.minimum(t, seq_len - 1)
        return k_ref[t], v_ref[t], g_ref[t], beta_ref[t], (q_ref[t] if with_output else None)

    def step(t, carry):
        s, (k, v, g, beta, q) = carry
        upcoming = load_token(t + 1)
        k = l2_normalize(k)
        s = s * jnp.exp(g.astype(jnp.float32))
        delta = beta.astype(jnp.float32) * (v.astype(jnp.float32) - jnp.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        if with_output:
            q = l2_normalize(q) * key_dim ** -0.5
            out_ref[t] = jnp.sum(s * q[:, None], axis=0).astype(out_ref.dtype)
        return s, upcoming

    s, _ = lax.fori_loop(0, seq_len, step, (state_ref[...], load_token(0)))
    if with_state:
        out_refs[-1][...] = s


def _unit_lower_inverses(strict_lowers: list) -> list:
    """(I + L)⁻¹ of each strictly lower triangular L [n, n], by forward substitution over the rows
    (one loop for all of them, so their independent steps interleave)."""
    n = strict_lowers[0].shape[0]
    rows = _iota((n, n), 0)

    def substitute(i, inverses):  # row i of X − I = −L_i − L_i (X − I), rows < i already done
        new = []
        for m in inverses:
            row = jnp.sum(jnp.where(rows == i, m, 0), axis=0)
            new.append(jnp.where(rows == i, (row + jnp.sum(row[:, None] * m, axis=0))[None, :], m))
        return tuple(new)

    inverses = lax.fori_loop(1, n, substitute, tuple(-m for m in strict_lowers))
    return [m + (rows == _iota((n, n), 1)).astype(jnp.float32) for m in inverses]


def _chunk_solve_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, *, chunk_size: int, precision):
    """Program (b, h, chunk): w = (I + L)⁻¹ (βk̂ e^cum) and u = (I + L)⁻¹ βv of the chunk (f32).

    Blocked forward substitution over sub-blocks of 16 rows (a Python list: Triton cannot slice
    register tensors): each 16×16 diagonal block of I + L is inverted by forward substitution,
    the blocks below the diagonal are applied by dots.
    """
    seq_len = k_ref.shape[0]
    c0 = pl.program_id(2) * chunk_size
    starts = [c0 + a * SUB_BLOCK for a in range(chunk_size // SUB_BLOCK)]
    k = [l2_normalize(_load_rows(k_ref, start, SUB_BLOCK, seq_len)) for start in starts]
    beta = [_load_rows(beta_ref, start, SUB_BLOCK, seq_len)[:, None] for start in starts]
    cum, total = [], jnp.float32(0)
    for start in starts:
        g = _load_rows(g_ref, start, SUB_BLOCK, seq_len)
        cum.append(total + jnp.cumsum(g))
        total = total + jnp.sum(g)
    k_beta = [k_a * beta_a for k_a, beta_a in zip(k, beta)]
    strictly_lower = _iota((SUB_BLOCK, SUB_BLOCK), 0) > _iota((SUB_BLOCK, SUB_BLOCK), 1)
    inverses = _unit_lower_inverses([
        jnp.where(strictly_lower, _dot(kb_a, k_a, precision, (1, 1)) * _decay(cum_a, cum_a, strictly_lower), 0)
        for kb_a, k_a, cum_a in zip(k_beta, k, cum)])
    w, u = [], []
    for a, start in enumerate(starts):
        w_rhs = k_beta[a] * jnp.exp(cum[a])[:, None]
        u_rhs = _load_rows(v_ref, start, SUB_BLOCK, seq_len) * beta[a]
        for b in range(a):
            lower_block = _dot(k_beta[a], k[b], precision, (1, 1)) * _decay(cum[a], cum[b])
            w_rhs = w_rhs - _dot(lower_block, w[b], precision)
            u_rhs = u_rhs - _dot(lower_block, u[b], precision)
        w.append(_dot(inverses[a], w_rhs, precision))
        u.append(_dot(inverses[a], u_rhs, precision))
        _store_rows(w_ref, start, w[a], seq_len)
        _store_rows(u_ref, start, u[a], seq_len)


def _chunk_scan_kernel(q_ref, k_ref, g_ref, w_ref, u_ref, state_ref, *out_refs, chunk_size: int, with_output: bool,
                       with_state: bool, precision):
    """Program (b, h, value block): walk the chunks, the state block in registers.

    Per chunk: v_new = u − w S; o = (q̂ e^cum) S + (q̂ k̂ᵀ e^(cum_i − cum_j), j <= i) v_new;
    S ← e^total S + (k̂ e^(total − cum))ᵀ v_new. Only the dots with S or v_new wait on the
    previous chunk; the loads, norms and q̂ k̂ᵀ do not, and each step loads the next chunk while
    it computes this one.
    """
    out_ref = out_refs[0] if with_output else None
    seq_len, key_dim = k_ref.shape
    lower = _iota((chunk_size, chunk_size), 0) >= _iota((chunk_size, chunk_size), 1)

    def load_chunk(c):  # raw rows of chunk c (zeros past T)
        c0 = c * chunk_size
        return tuple(_load_rows(ref, c0, chunk_size, seq_len) for ref in (k_ref, g_ref, w_ref, u_ref)) + (
            (_load_rows(q_ref, c0, chunk_size, seq_len),) if with_output else ())

    def chunk(c, carry):
        s, (k, g, w, u, *q) = carry
        upcoming = load_chunk(c + 1)
        k = l2_normalize(k)
        cum, total = jnp.cumsum(g), jnp.sum(g)
        v_new = u - _dot(w, s, precision)
        if with_output:
            q = l2_normalize(q[0]) * key_dim ** -0.5
            attention = _dot(q, k, precision, (1, 1)) * _decay(cum, cum, lower)
            out = _dot(q * jnp.exp(cum)[:, None], s, precision) + _dot(attention, v_new, precision)
            _store_rows(out_ref, c * chunk_size, out, seq_len)
        s = jnp.exp(total) * s + _dot(k * jnp.exp(total - cum)[:, None], v_new, precision, (0, 0))
        return s, upcoming

    s, _ = lax.fori_loop(0, pl.cdiv(seq_len, chunk_size), chunk, (state_ref[...], load_chunk(0)))
    if with_state:
        out_refs[-1][...] = s


def _check_tuning(*, value_dim: int, chunk_size: int, block_v: int, num_warps: int, num_stages: int,
                  max_recurrent_len: int) -> None:
    if not (is_power_of_2(chunk_size) and chunk_size >= SUB_BLOCK):
        raise ValueError(f"chunk_size must be a power of two >= {SUB_BLOCK}, got {chunk_size}")
    if not (is_power_of_2(block_v) and block_v >= 16) or value_dim % block_v:
        raise ValueError(f"block_v must be a power of two >= 16 that divides value_dim {value_dim}, got {block_v}")
    if max_recurrent_len < 0:
        raise ValueError(f"max_recurrent_len must be >= 0, got {max_recurrent_len}")
    check_launch(num_warps, num_stages)


@functools.partial(jax.jit, static_argnames=("with_output", "with_state", "interpret", *TUNING_ARGS))
def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array, *,
                     with_output: bool = True, with_state: bool = True, interpret: bool = False,
                     max_recurrent_len: int = 16, chunk_size: int = 16, block_v: int | None = None,
                     num_warps: int | None = None, num_stages: int = 1) -> tuple[jax.Array | None, jax.Array | None]:
    """Pallas version of ``gated_delta_rule_reference`` (same arguments and result).

    T <= ``max_recurrent_len`` runs the recurrent kernel, longer T the chunk solve and chunk scan
    (chunks of ``chunk_size`` tokens, a power of two >= 16). ``block_v`` value dims and
    ``num_warps`` of the kernel that walks the state (recurrent: 32 and 2; chunk scan: 64 and 8;
    block_v at most value_dim; the chunk solve always runs 4 warps), Triton ``num_stages``.
    """
    check_gated_delta_args(q, k, v, g, beta, state)
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    recurrent = seq_len <= max_recurrent_len
    block_v = min(value_dim, 32 if recurrent else 64) if block_v is None else block_v
    num_warps = (2 if recurrent else 8) if num_warps is None else num_warps
    _check_tuning(value_dim=value_dim, chunk_size=chunk_size, block_v=block_v, num_warps=num_warps,
                  num_stages=num_stages, max_recurrent_len=max_recurrent_len)
    if not (with_output or with_state):
        return None, None
    precision = _HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    group = value_heads // key_heads

    key_rows = pl.BlockSpec((None, seq_len, None, key_dim), lambda b, h, j: (b, 0, h // group, 0))
    value_rows = pl.BlockSpec((None, seq_len, None, block_v), lambda b, h, j: (b, 0, h, j))
    gate_rows = pl.BlockSpec((None, seq_len, None), lambda b, h, j: (b, 0, h))
    state_spec = pl.BlockSpec((None, None, key_dim, block_v), lambda b, h, j: (b, h, 0, j))
    out_shape, out_specs = [], []
    if with_output:
        out_shape.append(jax.ShapeDtypeStruct(v.shape, v.dtype))
        out_specs.append(value_rows)
    if with_state:
        out_shape.append(jax.ShapeDtypeStruct(state.shape, jnp.float32))
        out_specs.append(state_spec)
    flags = dict(with_output=with_output, with_state=with_state)
    if recurrent:
        kernel, name = functools.partial(_recurrent_kernel, **flags), "gated_delta_rule_recurrent"
        in_specs, operands = [key_rows, key_rows, value_rows, gate_rows, gate_rows, state_spec], (q, k, v, g, beta)
    else:
        def whole_rows(width):  # [T, width] of value head h
            return pl.BlockSpec((None, seq_len, None, width), lambda b, h, c: (b, 0, h, 0))

        w, u = pl.pallas_call(
            functools.partial(_chunk_solve_kernel, chunk_size=chunk_size, precision=precision),
            grid=(batch, value_heads, pl.cdiv(seq_len, chunk_size)),
            in_specs=[key_rows, whole_rows(value_dim), gate_rows, gate_rows],
            out_specs=[whole_rows(key_dim), whole_rows(value_dim)],
            out_shape=[jax.ShapeDtypeStruct((batch, seq_len, value_heads, key_dim), jnp.float32),
                       jax.ShapeDtypeStruct((batch, seq_len, value_heads, value_dim), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=SOLVE_NUM_WARPS, num_stages=num_stages),
            interpret=interpret, name="gated_delta_rule_chunk_solve",
        )(k, v, g, beta)
        kernel = functools.partial(_chunk_scan_kernel, chunk_size=chunk_size, precision=precision, **flags)
        name = "gated_delta_rule_chunk_scan"
        in_specs = [key_rows, key_rows, gate_rows, whole_rows(key_dim), value_rows, state_spec]
        operands = (q, k, g, w, u)
    outs = pl.pallas_call(
        kernel,
        grid=(batch, value_heads, value_dim // block_v),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={len(operands): len(out_shape) - 1} if with_state else {},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*operands, state)
    return (outs[0] if with_output else None), (outs[-1] if with_state else None)

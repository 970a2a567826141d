"""RMSNorm and rotary embedding (Qwen3 conventions): references and fused Pallas kernels.

Math follows HF Qwen3: RMSNorm in f32, cast back, times the weight; RoPE with
``inv_freq = theta ** (-2i / head_dim)``, rotate-half layout, cos/sin cast to the input dtype.

``norm_rope_write`` fuses k's per-head RMSNorm and RoPE and scatters it, with v unchanged,
straight into the paged cache (the pages are aliased to the outputs, so a donated cache is
updated in place). ``qkv_norm_rope_write`` does a target layer's whole attention input in one
launch, reading q, k and v from the fused qkv projection: q normed and rotated out, k and v into
their pages; ``qkv_norm_rope`` is the same kernel returning k and v instead (the draft's block,
which never enters the cache). The kernels work on rows ``(token, head)`` of ``head_dim``
values, ``block_rows`` rows per program, and handle the two rotate-half halves as separate
loads/stores (Triton has no lane shuffles). The rotary cos/sin come in as per-token tables
computed by XLA (``rope_half_tables``), not per row in the kernel. On the H200 the page-writing
kernels make the model 3-5% faster than XLA's fusions of the references, so ``impl="auto"`` runs
them on GPU; ``qkv_norm_rope`` measured level with XLA there, so auto leaves it to XLA
(benchmarks/RESULTS.md).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paging import write_pages
from pallas_kernels.tuning import check_launch, is_power_of_2, row_block


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _inv_freq(head_dim: int, theta: float) -> jax.Array:
    """1 / theta ** (2i / head_dim) in f32 as transformers computes it: the power rounded to f32,
    then its reciprocal. One rounding instead of two put 24 of Qwen3-8B's 64 frequencies 1 ulp
    off HF's (a phase error of 4e-3 at position 32k); now at most one differs (torch's f32 ``pow``
    is not always correctly rounded). Computed on the host in float64 and rounded there, because
    an f32 ``pow`` gives different last bits eagerly and under jit (XLA folds the constant)."""
    power = np.float32(theta ** (np.arange(0, head_dim, 2) / head_dim))
    return jnp.asarray(np.float32(1.0 / power.astype(np.float64)))


def rope_half_tables(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim / 2] of each frequency at integer positions [...], rounded to dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * _inv_freq(head_dim, theta)
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables [..., head_dim] for integer positions [...] (rotate-half layout: both
    halves repeat the frequencies)."""
    cos, sin = rope_half_tables(positions, head_dim, theta, dtype)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate x [..., T, heads, head_dim] by its positions [..., T]."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    cos, sin = cos[..., None, :], sin[..., None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def norm_rope_reference(x: jax.Array, weight: jax.Array, positions: jax.Array, *,
                        eps: float, theta: float) -> jax.Array:
    """Per-head RMSNorm (weight [head_dim]) then RoPE: x [B, T, heads, head_dim]."""
    return apply_rope(rms_norm(x, weight, eps), positions, theta)


def norm_rope_write_reference(k: jax.Array, v: jax.Array, k_norm_weight: jax.Array, positions: jax.Array,
                              k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, *,
                              eps: float, theta: float) -> tuple[jax.Array, jax.Array]:
    """Store norm_rope(k) and v [B, T, Hkv, D] at ``positions`` [B, T] into their pages."""
    k = norm_rope_reference(k, k_norm_weight, positions, eps=eps, theta=theta)
    return (write_pages(k_pages, page_table, positions, k),
            write_pages(v_pages, page_table, positions, v))


# ---------------------------------------------------------------------------------------------
# Kernels.

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _row_mask(r0, block_rows: int, num_rows: int, width: int):
    ok = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0) < num_rows
    return ok, jnp.broadcast_to(ok[:, None], (block_rows, width))


def _load_halves(x_ref, r0, block_rows: int):
    """Rows [r0, r0 + block_rows) of x [rows, D] as two f32 [rows, D/2] halves (zeros past the end)."""
    num_rows, head_dim = x_ref.shape
    half = head_dim // 2
    _, mask = _row_mask(r0, block_rows, num_rows, half)
    return tuple(plgpu.load(x_ref.at[pl.ds(r0, block_rows), pl.ds(d, half)], mask=mask,
                            other=0).astype(jnp.float32) for d in (0, half))


def _weight_halves(w_ref):
    """The norm weight [D] as two [1, D/2] halves."""
    half = w_ref.shape[0] // 2
    return tuple(w_ref[pl.ds(d, half)][None, :] for d in (0, half))


def _rope_rows(cos_ref, sin_ref, token, ok):
    """cos, sin [rows, D/2] (f32) of each row's token from the tables [tokens, D/2]."""
    half = cos_ref.shape[1]
    index = (jnp.where(ok, token, 0)[:, None], lax.broadcasted_iota(jnp.int32, (1, half), 1))
    mask = jnp.broadcast_to(ok[:, None], (ok.shape[0], half))
    return tuple(plgpu.load(ref.at[index], mask=mask, other=0).astype(jnp.float32)
                 for ref in (cos_ref, sin_ref))


def _rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype):
    """The kernels' rotary inputs: cos, sin [tokens, D/2] for positions [B, T]. Computed by XLA
    once per token (and, inside a model, once per step for all layers: the tables of equal
    positions are one computation after CSE) rather than per (token, head) row in the kernel.
    H200, 256 rows: with the trigonometry in the kernel, norm_rope took 10.2 us of device time,
    15.0 us per call in a loop; with the tables, 5.2 us per call."""
    return rope_half_tables(positions.reshape(-1), head_dim, theta, dtype)


def _norm_rope_halves(x1, x2, w1, w2, cos, sin, *, eps: float, dtype):
    """RMSNorm (weight halves w1, w2 broadcast to the rows) then RoPE of rows given as f32 halves.

    cos, sin: [rows, D/2] f32, already rounded to ``dtype`` like the reference's tables. Rounds
    where the reference does (normed and weight product to ``dtype``) and does the rotation in f32.
    """
    head_dim = 2 * x1.shape[1]
    inv_rms = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / head_dim + eps)

    def round_(x):
        return x.astype(dtype).astype(jnp.float32)

    def normed(x, w):
        return round_(round_(w) * round_(x * inv_rms[:, None]))

    n1, n2 = normed(x1, w1), normed(x2, w2)
    return (n1 * cos - n2 * sin).astype(dtype), (n2 * cos + n1 * sin).astype(dtype)


def _norm_rope_rows(x_ref, w_ref, cos_ref, sin_ref, token, r0, block_rows: int, *, eps: float):
    """Rows [r0, r0 + block_rows) of x [rows, D] (row i belongs to token[i]), normalized and
    rotated: two [rows, D/2] halves."""
    ok, _ = _row_mask(r0, block_rows, x_ref.shape[0], 1)
    return _norm_rope_halves(*_load_halves(x_ref, r0, block_rows), *_weight_halves(w_ref),
                             *_rope_rows(cos_ref, sin_ref, token, ok), eps=eps, dtype=x_ref.dtype)


def _check_rows(name: str, x: jax.Array, weight: jax.Array, positions: jax.Array, weight_name: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must be [batch, T, heads, head_dim], got shape {x.shape}")
    if 0 in x.shape[:3]:
        raise ValueError(f"{name} must hold at least one row (batch, T and heads >= 1), got shape {x.shape}")
    head_dim = x.shape[3]
    if head_dim < 16 or not is_power_of_2(head_dim):
        raise ValueError(f"{name} head_dim must be a power of two >= 16, got {head_dim}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.shape != (head_dim,):
        raise ValueError(f"{weight_name} must be [head_dim={head_dim}], got {weight.shape}")
    if positions.shape != x.shape[:2] or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer [batch, T] = {x.shape[:2]} array, got "
                         f"{positions.dtype} {positions.shape}")


def _check_pages(k, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array) -> None:
    """k (or its shape/dtype) [B, T, Hkv, D] against pages [P, S, Hkv, D] and the page table."""
    batch, _, heads, head_dim = k.shape
    if k_pages.ndim != 4 or k_pages.shape[2:] != (heads, head_dim):
        raise ValueError(f"k_pages must be [num_pages, page_size, {heads}, {head_dim}], got "
                         f"{k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    if k_pages.dtype != k.dtype or v_pages.dtype != k.dtype:
        raise ValueError(f"k_pages/v_pages dtype {k_pages.dtype}/{v_pages.dtype} must equal k dtype {k.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [batch={batch}, pages_per_seq], got "
                         f"{page_table.dtype} {page_table.shape}")


def _rows_per_program(block_rows: int | None, num_rows: int) -> int:
    """block_rows as given (a power of two) or, by default, ``tuning.row_block``."""
    block_rows = row_block(num_rows) if block_rows is None else block_rows
    if not is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    return block_rows


def _compiler_params(num_warps: int | None, num_stages: int | None):
    num_warps, num_stages = 4 if num_warps is None else num_warps, 1 if num_stages is None else num_stages
    check_launch(num_warps, num_stages)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _page_addresses(positions, ok, pt_ref, seq, num_pages: int, page_size: int):
    """(page id [rows], slot in page [rows], ok [rows]) of each row's token position; a row whose
    position lies outside its sequence's page table, or maps to no page, is not ok."""
    pages_per_seq = pt_ref.shape[1]
    logical = positions // page_size
    ok = ok & (positions >= 0) & (logical < pages_per_seq)
    page = plgpu.load(pt_ref.at[seq, jnp.clip(logical, 0, pages_per_seq - 1)], mask=ok, other=num_pages)
    return page, positions % page_size, ok & (page >= 0) & (page < num_pages)


def _store_rows(ref, index, ok, value) -> None:
    """Scatter value [rows, n] to ref.at[index] where ok [rows]."""
    plgpu.store(ref.at[index], value, mask=jnp.broadcast_to(ok[:, None], value.shape))


def _norm_rope_write_kernel(pos_ref, pt_ref, k_ref, v_ref, w_ref, cos_ref, sin_ref, _k_in, _v_in,
                            k_pages_ref, v_pages_ref, *, q_len: int, heads: int,
                            block_rows: int, eps: float):
    r0 = pl.program_id(0) * block_rows
    num_rows, head_dim = k_ref.shape
    num_pages, page_size = k_pages_ref.shape[:2]
    half = head_dim // 2
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    token, head = rows // heads, rows % heads
    in_rows = rows < num_rows
    positions = plgpu.load(pos_ref.at[token], mask=in_rows, other=0)
    page, slot, ok = _page_addresses(positions, in_rows, pt_ref, token // q_len, num_pages, page_size)
    # Dropped rows also point past the last page, so interpret mode's scatter drops them too.
    index = (jnp.where(ok, page, num_pages)[:, None], slot[:, None], head[:, None])
    first = lax.broadcasted_iota(jnp.int32, (1, half), 1)
    k1, k2 = _norm_rope_rows(k_ref, w_ref, cos_ref, sin_ref, token, r0, block_rows, eps=eps)
    _store_rows(k_pages_ref, (*index, first), ok, k1)
    _store_rows(k_pages_ref, (*index, first + half), ok, k2)
    _, mask = _row_mask(r0, block_rows, num_rows, head_dim)
    v = plgpu.load(v_ref.at[pl.ds(r0, block_rows)], mask=mask, other=0)
    _store_rows(v_pages_ref, (*index, lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)), ok,
                v.astype(v_pages_ref.dtype))


@functools.partial(jax.jit, static_argnames=("eps", "theta", "interpret", "block_rows",
                                             "num_warps", "num_stages"))
def norm_rope_write(k: jax.Array, v: jax.Array, k_norm_weight: jax.Array, positions: jax.Array,
                    k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, *,
                    eps: float, theta: float, interpret: bool = False,
                    block_rows: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas version of ``norm_rope_write_reference``: returns the updated (k_pages, v_pages).

    k, v: [B, T, Hkv, D]; positions [B, T]; pages [P, S, Hkv, D]; page_table [B, n] int32.
    Positions outside the page table (or mapped to a page id outside [0, P)) are dropped. The
    pages are aliased to the outputs: donate them (or call inside a jit that owns them) and the
    update is in place; otherwise XLA copies them first.
    """
    _check_rows("k", k, k_norm_weight, positions, "k_norm_weight")
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} != k shape {k.shape}")
    _check_pages(k, k_pages, v_pages, page_table)
    batch, q_len, heads, head_dim = k.shape
    num_rows = batch * q_len * heads
    block_rows = _rows_per_program(block_rows, num_rows)
    kernel = functools.partial(_norm_rope_write_kernel, q_len=q_len, heads=heads,
                               block_rows=block_rows, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={7: 0, 8: 1},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="norm_rope_write",
    )(positions.reshape(-1).astype(jnp.int32), page_table, k.reshape(num_rows, head_dim),
      v.reshape(num_rows, head_dim), k_norm_weight, *_rope_tables(positions, head_dim, theta, k.dtype),
      k_pages, v_pages)


# ---------------------------------------------------------------------------------------------
# A layer's whole attention input in one kernel, read from its fused qkv projection: q and k
# normed and rotated, v as it is. ``qkv_norm_rope`` returns all three (the draft's block, which
# never enters the cache); ``qkv_norm_rope_write`` returns q and stores k and v into their pages
# (a target layer's new tokens).


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., Hq, D], k and v [..., Hkv, D] from a fused projection [..., (Hq + 2 Hkv) * D]."""
    slots = num_heads + 2 * num_kv_heads
    heads = qkv.reshape(*qkv.shape[:-1], slots, qkv.shape[-1] // slots)
    return (heads[..., :num_heads, :], heads[..., num_heads:num_heads + num_kv_heads, :],
            heads[..., num_heads + num_kv_heads:, :])


def qkv_norm_rope_reference(qkv: jax.Array, q_norm_weight: jax.Array, k_norm_weight: jax.Array,
                            positions: jax.Array, *, num_heads: int, num_kv_heads: int, eps: float,
                            theta: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [B, T, (Hq + 2 Hkv) * D] at ``positions`` [B, T] -> (norm_rope(q) [B, T, Hq, D],
    norm_rope(k) [B, T, Hkv, D], v [B, T, Hkv, D])."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads)
    return (norm_rope_reference(q, q_norm_weight, positions, eps=eps, theta=theta),
            norm_rope_reference(k, k_norm_weight, positions, eps=eps, theta=theta), v)


def qkv_norm_rope_write_reference(qkv: jax.Array, q_norm_weight: jax.Array, k_norm_weight: jax.Array,
                                  positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  page_table: jax.Array, *, num_heads: int, num_kv_heads: int,
                                  eps: float, theta: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [B, T, (Hq + 2 Hkv) * D] at ``positions`` [B, T] -> (norm_rope(q) [B, T, Hq, D],
    k_pages, v_pages with norm_rope(k) and v stored)."""
    q, k, v = qkv_norm_rope_reference(qkv, q_norm_weight, k_norm_weight, positions, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, eps=eps, theta=theta)
    return (q, write_pages(k_pages, page_table, positions, k),
            write_pages(v_pages, page_table, positions, v))


def _qkv_norm_rope_kernel(*refs, paged: bool, q_len: int, num_heads: int, num_kv_heads: int,
                          block_rows: int, eps: float):
    """Rows of x are (token, slot) for slot in q heads | k heads | v heads. Refs: x, the q and k
    norm weights, cos, sin, then (when ``paged``) positions, the page table and the aliased input
    pages, and the outputs: q [tokens * Hq, D] and either the k and v pages or k and v
    [tokens * Hkv, D]."""
    x_ref, qw_ref, kw_ref, cos_ref, sin_ref, *rest = refs
    q_ref, k_ref, v_ref = rest[-3:]
    r0 = pl.program_id(0) * block_rows
    num_rows, head_dim = x_ref.shape
    half = head_dim // 2
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    slots = num_heads + 2 * num_kv_heads
    token, slot = rows // slots, rows % slots
    in_rows = rows < num_rows
    is_q, is_v = slot < num_heads, slot >= num_heads + num_kv_heads
    is_k = ~is_q & ~is_v
    x1, x2 = _load_halves(x_ref, r0, block_rows)
    (qw1, qw2), (kw1, kw2) = _weight_halves(qw_ref), _weight_halves(kw_ref)
    select = lambda q_part, k_part: jnp.where(is_q[:, None], q_part, k_part)  # noqa: E731
    r1, r2 = _norm_rope_halves(x1, x2, select(qw1, kw1), select(qw2, kw2),
                               *_rope_rows(cos_ref, sin_ref, token, in_rows), eps=eps, dtype=x_ref.dtype)
    first = lax.broadcasted_iota(jnp.int32, (1, half), 1)
    # Rows that are not written point past the end of their output too, so that interpret mode's
    # scatter drops them as well.
    q_ok = in_rows & is_q
    q_row = jnp.where(q_ok, token * num_heads + slot, q_ref.shape[0])[:, None]
    _store_rows(q_ref, (q_row, first), q_ok, r1)
    _store_rows(q_ref, (q_row, first + half), q_ok, r2)

    if paged:
        pos_ref, pt_ref = rest[:2]
        num_pages, page_size = k_ref.shape[:2]
        positions = plgpu.load(pos_ref.at[token], mask=in_rows, other=0)
        page, page_slot, ok = _page_addresses(positions, in_rows & ~is_q, pt_ref, token // q_len,
                                              num_pages, page_size)
    else:
        ok = in_rows
    for kind, ref, head, (v1, v2) in (
            (is_k, k_ref, slot - num_heads, (r1, r2)),
            (is_v, v_ref, slot - num_heads - num_kv_heads,
             (x1.astype(x_ref.dtype), x2.astype(x_ref.dtype)))):
        kind_ok = ok & kind
        if paged:
            index = (jnp.where(kind_ok, page, num_pages)[:, None], page_slot[:, None], head[:, None])
        else:
            index = (jnp.where(kind_ok, token * num_kv_heads + head, ref.shape[0])[:, None],)
        _store_rows(ref, (*index, first), kind_ok, v1)
        _store_rows(ref, (*index, first + half), kind_ok, v2)


def _check_qkv(qkv: jax.Array, q_norm_weight, k_norm_weight, positions, num_heads: int,
               num_kv_heads: int) -> tuple[int, int, int, int]:
    """(batch, T, head_dim, rows) of a valid fused projection; ValueError naming what is not."""
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    slots = num_heads + 2 * num_kv_heads
    if qkv.ndim != 3 or qkv.shape[-1] % slots:
        raise ValueError(f"qkv must be [batch, T, (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[.., .., {slots} * head_dim], got {qkv.shape}")
    batch, q_len, width = qkv.shape
    head_dim = width // slots
    _check_rows("qkv", jax.ShapeDtypeStruct((batch, q_len, num_heads, head_dim), qkv.dtype), q_norm_weight,
                positions, "q_norm_weight")
    if k_norm_weight.shape != (head_dim,):
        raise ValueError(f"k_norm_weight must be [head_dim={head_dim}], got {k_norm_weight.shape}")
    return batch, q_len, head_dim, batch * q_len * slots


def _qkv_norm_rope_call(qkv, q_norm_weight, k_norm_weight, positions, pages, *, num_heads: int,
                        num_kv_heads: int, eps: float, theta: float, interpret: bool, block_rows,
                        num_warps, num_stages):
    """The pallas_call behind both wrappers: ``pages`` is (k_pages, v_pages, page_table) or None."""
    batch, q_len, head_dim, num_rows = _check_qkv(qkv, q_norm_weight, k_norm_weight, positions, num_heads,
                                                  num_kv_heads)
    tokens = batch * q_len
    if pages is None:
        kv_shape = jax.ShapeDtypeStruct((tokens * num_kv_heads, head_dim), qkv.dtype)
        kv_outs, paged_ins, aliases = (kv_shape, kv_shape), (), {}
    else:
        k_pages, v_pages, page_table = pages
        _check_pages(jax.ShapeDtypeStruct((batch, q_len, num_kv_heads, head_dim), qkv.dtype), k_pages,
                     v_pages, page_table)
        kv_outs = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pages, v_pages))
        paged_ins = (positions.reshape(-1).astype(jnp.int32), page_table, k_pages, v_pages)
        aliases = {7: 1, 8: 2}  # the input pages are outputs 1 and 2
    block_rows = _rows_per_program(block_rows, num_rows)
    kernel = functools.partial(_qkv_norm_rope_kernel, paged=pages is not None, q_len=q_len,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, block_rows=block_rows,
                               eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((tokens * num_heads, head_dim), qkv.dtype), *kv_outs),
        input_output_aliases=aliases,
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="qkv_norm_rope" if pages is None else "qkv_norm_rope_write",
    )(qkv.reshape(num_rows, head_dim), q_norm_weight, k_norm_weight,
      *_rope_tables(positions, head_dim, theta, qkv.dtype), *paged_ins)


_QKV_STATICS = ("num_heads", "num_kv_heads", "eps", "theta", "interpret", "block_rows", "num_warps",
                "num_stages")


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope(qkv: jax.Array, q_norm_weight: jax.Array, k_norm_weight: jax.Array, positions: jax.Array,
                  *, num_heads: int, num_kv_heads: int, eps: float, theta: float, interpret: bool = False,
                  block_rows: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas version of ``qkv_norm_rope_reference`` (same arguments and results): one launch
    instead of three slices and two norm+RoPE passes. block_rows (rows of D values per program)
    defaults to ``tuning.row_block``."""
    q, k, v = _qkv_norm_rope_call(qkv, q_norm_weight, k_norm_weight, positions, None, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, eps=eps, theta=theta, interpret=interpret,
                                  block_rows=block_rows, num_warps=num_warps, num_stages=num_stages)
    batch, q_len = qkv.shape[:2]
    return (q.reshape(batch, q_len, num_heads, -1), k.reshape(batch, q_len, num_kv_heads, -1),
            v.reshape(batch, q_len, num_kv_heads, -1))


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope_write(qkv: jax.Array, q_norm_weight: jax.Array, k_norm_weight: jax.Array,
                        positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                        *, num_heads: int, num_kv_heads: int, eps: float, theta: float,
                        interpret: bool = False, block_rows: int | None = None,
                        num_warps: int | None = None,
                        num_stages: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas version of ``qkv_norm_rope_write_reference`` (same arguments and results): one
    launch instead of a split, two norm+RoPE passes and two scatters. Pages are aliased to the
    outputs (in place when donated); positions outside the page table are dropped for k/v.
    block_rows (rows of D values per program) defaults to ``tuning.row_block``."""
    q, k_pages, v_pages = _qkv_norm_rope_call(
        qkv, q_norm_weight, k_norm_weight, positions, (k_pages, v_pages, page_table), num_heads=num_heads,
        num_kv_heads=num_kv_heads, eps=eps, theta=theta, interpret=interpret, block_rows=block_rows,
        num_warps=num_warps, num_stages=num_stages)
    return q.reshape(*qkv.shape[:2], num_heads, -1), k_pages, v_pages

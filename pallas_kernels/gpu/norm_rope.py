"""RMSNorm and rotary embedding in Pallas kernels (Triton lowering), with the paged KV write: the
GPU kernels behind the references of ``pallas_kernels.norm_rope`` (the math and the argument
checks live there).

``norm_rope_write`` fuses k's per-head RMSNorm and RoPE and scatters it, with v unchanged,
straight into the paged cache (the pages are aliased to the outputs, so a donated cache is
updated in place). ``qkv_norm_rope_write`` does a target layer's whole attention input in one
launch, reading q, k and v from the fused qkv projection: q normed and rotated out, k and v into
their pages; ``qkv_norm_rope`` is the same kernel returning k and v instead (the draft's block,
which never enters the cache). The kernels work on rows ``(token, head)`` of ``head_dim``
values, ``block_rows`` rows per program, each row as chunks of ``rotary_dim / 2`` values: the
first two chunks are the rotate-half pair, the others pass through (Triton has no lane shuffles,
so the pair is two loads and stores). On the H200 the page-writing kernels make the model 3-5%
faster than XLA's fusions of the references, so ``impl="auto"`` runs them on GPU;
``qkv_norm_rope`` measured level with XLA there, so auto leaves it to XLA (benchmarks/RESULTS.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu.tuning import check_launch, row_block
from pallas_kernels.norm_rope import check_norm_rope_write_args, check_pages, check_positions, check_qkv
from pallas_kernels.sizes import is_power_of_2


def _row_mask(r0, block_rows: int, num_rows: int, width: int):
    ok = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0) < num_rows
    return ok, jnp.broadcast_to(ok[:, None], (block_rows, width))


def _load_chunks(x_ref, r0, block_rows: int, width: int) -> list:
    """Rows [r0, r0 + block_rows) of x [rows, D] as D / width f32 chunks [rows, width] (zeros
    past the end)."""
    num_rows, head_dim = x_ref.shape
    _, mask = _row_mask(r0, block_rows, num_rows, width)
    return [plgpu.load(x_ref.at[pl.ds(r0, block_rows), pl.ds(d, width)], mask=mask, other=0).astype(jnp.float32)
            for d in range(0, head_dim, width)]


def _weight_chunks(w_ref, width: int) -> list:
    """The norm weight [D] as D / width chunks [1, width]."""
    return [w_ref[pl.ds(d, width)][None, :] for d in range(0, w_ref.shape[0], width)]


def _rope_rows(cos_ref, sin_ref, token, ok):
    """cos, sin [rows, R/2] (f32) of each row's token from the tables [tokens, R/2]."""
    width = cos_ref.shape[1]
    index = (jnp.where(ok, token, 0)[:, None], lax.broadcasted_iota(jnp.int32, (1, width), 1))
    mask = jnp.broadcast_to(ok[:, None], (ok.shape[0], width))
    return tuple(plgpu.load(ref.at[index], mask=mask, other=0).astype(jnp.float32)
                 for ref in (cos_ref, sin_ref))


def _norm_rope_chunks(chunks: list, weights: list | None, cos, sin, *, eps: float, dtype) -> list:
    """RMSNorm (weight chunks broadcast to the rows; None: no norm) then RoPE of rows given as f32
    chunks of R/2 values: chunks 0 and 1 are the rotate-half pair, the others pass through.

    cos, sin: [rows, R/2] f32, already rounded to ``dtype`` like the reference's tables. Rounds
    where the reference does (normed and weight product to ``dtype``) and does the rotation in f32.
    Returns the chunks in ``dtype``.
    """
    if weights is not None:
        head_dim = len(chunks) * chunks[0].shape[1]
        inv_rms = lax.rsqrt(sum(jnp.sum(c * c, axis=1) for c in chunks) / head_dim + eps)

        def round_(x):
            return x.astype(dtype).astype(jnp.float32)

        chunks = [round_(round_(w) * round_(c * inv_rms[:, None])) for c, w in zip(chunks, weights)]
    n1, n2, *rest = chunks
    return [(n1 * cos - n2 * sin).astype(dtype), (n2 * cos + n1 * sin).astype(dtype),
            *(c.astype(dtype) for c in rest)]


def _store_chunks(ref, index, ok, chunks: list) -> None:
    """Scatter row chunks [rows, width] to consecutive column ranges of ref.at[index] where ok."""
    width = chunks[0].shape[1]
    first = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    for i, chunk in enumerate(chunks):
        _store_rows(ref, (*index, first + i * width), ok, chunk)


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


def _flat_tables(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tables [B, T, R/2] as the kernels read them: one row per token [B * T, R/2]."""
    return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])


def _norm_rope_write_kernel(*refs, normalize: bool, q_len: int, heads: int, block_rows: int, eps: float):
    """Refs: positions, page table, k, v, (k norm weight,) cos, sin, the aliased input pages, and
    the output k and v pages."""
    pos_ref, pt_ref, k_ref, v_ref, *rest = refs
    w_ref = rest.pop(0) if normalize else None
    cos_ref, sin_ref, _k_in, _v_in, k_pages_ref, v_pages_ref = rest
    width = cos_ref.shape[1]
    r0 = pl.program_id(0) * block_rows
    num_rows, head_dim = k_ref.shape
    num_pages, page_size = k_pages_ref.shape[:2]
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    token, head = rows // heads, rows % heads
    in_rows = rows < num_rows
    positions = plgpu.load(pos_ref.at[token], mask=in_rows, other=0)
    page, slot, ok = _page_addresses(positions, in_rows, pt_ref, token // q_len, num_pages, page_size)
    # Dropped rows also point past the last page, so interpret mode's scatter drops them too.
    index = (jnp.where(ok, page, num_pages)[:, None], slot[:, None], head[:, None])
    k_chunks = _norm_rope_chunks(_load_chunks(k_ref, r0, block_rows, width),
                                 None if w_ref is None else _weight_chunks(w_ref, width),
                                 *_rope_rows(cos_ref, sin_ref, token, in_rows), eps=eps, dtype=k_ref.dtype)
    _store_chunks(k_pages_ref, index, ok, k_chunks)
    _, mask = _row_mask(r0, block_rows, num_rows, head_dim)
    v = plgpu.load(v_ref.at[pl.ds(r0, block_rows)], mask=mask, other=0)
    _store_rows(v_pages_ref, (*index, lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)), ok,
                v.astype(v_pages_ref.dtype))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_rows", "num_warps", "num_stages"))
def norm_rope_write(k: jax.Array, v: jax.Array, k_norm_weight: jax.Array | None, cos: jax.Array, sin: jax.Array,
                    positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, *,
                    eps: float, interpret: bool = False, block_rows: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas version of ``norm_rope_write_reference``: returns the updated (k_pages, v_pages).

    k, v: [B, T, Hkv, D]; k_norm_weight [D] or None (no norm); cos, sin [B, T, R/2]; positions
    [B, T]; pages [P, S, Hkv, D]; page_table [B, n] int32. Positions outside the page table (or
    mapped to a page id outside [0, P)) are dropped. The pages are aliased to the outputs: donate
    them (or call inside a jit that owns them) and the update is in place; otherwise XLA copies
    them first.
    """
    check_norm_rope_write_args(k, v, k_norm_weight, cos, sin, positions, k_pages, v_pages, page_table)
    batch, q_len, heads, head_dim = k.shape
    num_rows = batch * q_len * heads
    block_rows = _rows_per_program(block_rows, num_rows)
    normalize = k_norm_weight is not None
    kernel = functools.partial(_norm_rope_write_kernel, normalize=normalize, q_len=q_len, heads=heads,
                               block_rows=block_rows, eps=eps)
    inputs = (positions.reshape(-1).astype(jnp.int32), page_table, k.reshape(num_rows, head_dim),
              v.reshape(num_rows, head_dim), *((k_norm_weight,) if normalize else ()),
              *_flat_tables(cos.astype(k.dtype), sin.astype(k.dtype)), k_pages, v_pages)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={len(inputs) - 2: 0, len(inputs) - 1: 1},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="norm_rope_write",
    )(*inputs)


# ---------------------------------------------------------------------------------------------
# A layer's whole attention input in one kernel, read from its fused qkv projection: q and k
# normed and rotated, v as it is. ``qkv_norm_rope`` returns all three (the draft's block, which
# never enters the cache); ``qkv_norm_rope_write`` returns q and stores k and v into their pages
# (a target layer's new tokens).


def _qkv_norm_rope_kernel(*refs, paged: bool, normalize: bool, q_len: int, num_heads: int, num_kv_heads: int,
                          block_rows: int, eps: float):
    """Rows of x are (token, slot) for slot in q heads | k heads | v heads. Refs: x, (the q and k
    norm weights,) cos, sin, then (when ``paged``) positions, the page table and the aliased
    input pages, and the outputs: q [tokens * Hq, D] and either the k and v pages or k and v
    [tokens * Hkv, D]."""
    x_ref, *rest = refs
    qw_ref, kw_ref = (rest.pop(0), rest.pop(0)) if normalize else (None, None)
    cos_ref, sin_ref, *rest = rest
    q_ref, k_ref, v_ref = rest[-3:]
    width = cos_ref.shape[1]
    r0 = pl.program_id(0) * block_rows
    num_rows = x_ref.shape[0]
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    slots = num_heads + 2 * num_kv_heads
    token, slot = rows // slots, rows % slots
    in_rows = rows < num_rows
    is_q, is_v = slot < num_heads, slot >= num_heads + num_kv_heads
    is_k = ~is_q & ~is_v
    x_chunks = _load_chunks(x_ref, r0, block_rows, width)
    weights = None
    if normalize:
        weights = [jnp.where(is_q[:, None], qw, kw)
                   for qw, kw in zip(_weight_chunks(qw_ref, width), _weight_chunks(kw_ref, width))]
    rotated = _norm_rope_chunks(x_chunks, weights, *_rope_rows(cos_ref, sin_ref, token, in_rows), eps=eps,
                                dtype=x_ref.dtype)
    # Rows that are not written point past the end of their output too, so that interpret mode's
    # scatter drops them as well.
    q_ok = in_rows & is_q
    _store_chunks(q_ref, (jnp.where(q_ok, token * num_heads + slot, q_ref.shape[0])[:, None],), q_ok, rotated)

    if paged:
        pos_ref, pt_ref = rest[:2]
        num_pages, page_size = k_ref.shape[:2]
        positions = plgpu.load(pos_ref.at[token], mask=in_rows, other=0)
        page, page_slot, ok = _page_addresses(positions, in_rows & ~is_q, pt_ref, token // q_len,
                                              num_pages, page_size)
    else:
        ok = in_rows
    for kind, ref, head, chunks in (
            (is_k, k_ref, slot - num_heads, rotated),
            (is_v, v_ref, slot - num_heads - num_kv_heads, [c.astype(x_ref.dtype) for c in x_chunks])):
        kind_ok = ok & kind
        if paged:
            index = (jnp.where(kind_ok, page, num_pages)[:, None], page_slot[:, None], head[:, None])
        else:
            index = (jnp.where(kind_ok, token * num_kv_heads + head, ref.shape[0])[:, None],)
        _store_chunks(ref, index, kind_ok, chunks)


def _qkv_norm_rope_call(qkv, q_norm_weight, k_norm_weight, cos, sin, positions, pages, *, num_heads: int,
                        num_kv_heads: int, eps: float, interpret: bool, block_rows, num_warps, num_stages):
    """The pallas_call behind both wrappers: ``pages`` is (k_pages, v_pages, page_table) or None."""
    batch, q_len, head_dim, num_rows = check_qkv(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                                                  num_kv_heads)
    tokens = batch * q_len
    normalize = q_norm_weight is not None
    inputs = (qkv.reshape(num_rows, head_dim), *((q_norm_weight, k_norm_weight) if normalize else ()),
              *_flat_tables(cos.astype(qkv.dtype), sin.astype(qkv.dtype)))
    if pages is None:
        kv_shape = jax.ShapeDtypeStruct((tokens * num_kv_heads, head_dim), qkv.dtype)
        kv_outs, aliases = (kv_shape, kv_shape), {}
    else:
        k_pages, v_pages, page_table = pages
        check_positions(positions, (batch, q_len))
        check_pages(jax.ShapeDtypeStruct((batch, q_len, num_kv_heads, head_dim), qkv.dtype), k_pages,
                     v_pages, page_table)
        kv_outs = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pages, v_pages))
        inputs += (positions.reshape(-1).astype(jnp.int32), page_table, k_pages, v_pages)
        aliases = {len(inputs) - 2: 1, len(inputs) - 1: 2}  # the input pages are outputs 1 and 2
    block_rows = _rows_per_program(block_rows, num_rows)
    kernel = functools.partial(_qkv_norm_rope_kernel, paged=pages is not None, normalize=normalize,
                               q_len=q_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               block_rows=block_rows, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((tokens * num_heads, head_dim), qkv.dtype), *kv_outs),
        input_output_aliases=aliases,
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="qkv_norm_rope" if pages is None else "qkv_norm_rope_write",
    )(*inputs)


_QKV_STATICS = ("num_heads", "num_kv_heads", "eps", "interpret", "block_rows", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope(qkv: jax.Array, q_norm_weight: jax.Array | None, k_norm_weight: jax.Array | None,
                  cos: jax.Array, sin: jax.Array, *, num_heads: int, num_kv_heads: int, eps: float,
                  interpret: bool = False, block_rows: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas version of ``qkv_norm_rope_reference`` (same arguments and results): one launch
    instead of three slices and two norm+RoPE passes. block_rows (rows of D values per program)
    defaults to ``tuning.row_block``."""
    q, k, v = _qkv_norm_rope_call(qkv, q_norm_weight, k_norm_weight, cos, sin, None, None, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, eps=eps, interpret=interpret,
                                  block_rows=block_rows, num_warps=num_warps, num_stages=num_stages)
    batch, q_len = qkv.shape[:2]
    return (q.reshape(batch, q_len, num_heads, -1), k.reshape(batch, q_len, num_kv_heads, -1),
            v.reshape(batch, q_len, num_kv_heads, -1))


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope_write(qkv: jax.Array, q_norm_weight: jax.Array | None, k_norm_weight: jax.Array | None,
                        cos: jax.Array, sin: jax.Array, positions: jax.Array, k_pages: jax.Array,
                        v_pages: jax.Array, page_table: jax.Array, *, num_heads: int, num_kv_heads: int,
                        eps: float, interpret: bool = False, block_rows: int | None = None,
                        num_warps: int | None = None,
                        num_stages: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas version of ``qkv_norm_rope_write_reference`` (same arguments and results): one
    launch instead of a split, two norm+RoPE passes and two scatters. Pages are aliased to the
    outputs (in place when donated); positions outside the page table are dropped for k/v.
    block_rows (rows of D values per program) defaults to ``tuning.row_block``."""
    q, k_pages, v_pages = _qkv_norm_rope_call(
        qkv, q_norm_weight, k_norm_weight, cos, sin, positions, (k_pages, v_pages, page_table),
        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, interpret=interpret, block_rows=block_rows,
        num_warps=num_warps, num_stages=num_stages)
    return q.reshape(*qkv.shape[:2], num_heads, -1), k_pages, v_pages

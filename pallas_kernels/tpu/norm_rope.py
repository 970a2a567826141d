"""RMSNorm + RoPE with the paged KV write on TPUs (Mosaic).

Same arguments and results as ``norm_rope_write_reference``, ``qkv_norm_rope_write_reference``
and ``qkv_norm_rope_reference`` (plain jnp, in ``pallas_kernels.norm_rope``):
per-head RMSNorm in f32 (a weight of None skips it), then rotate-half RoPE on the first
``rotary_dim`` dims of each head with precomputed tables cos, sin ``[B, T, rotary_dim / 2]``.

The batch's tokens are flattened to ``B * T`` rows; one program takes ``block_t`` of them (all,
when they fit) with every head, so each input is read from HBM once: the fused projection
``[tokens, (Hq + 2 Hkv) * D]`` (or k and v), the tables and the norm weights. Inside a program,
``CHUNK_T`` tokens at a time are viewed as ``[tokens, heads, D]`` and normed and rotated in f32:
the rotate-half partner of lane ``i`` comes from two lane rolls (``pltpu.roll`` by ``R/2`` and by
``D - R/2``), and the tables are widened to ``D`` lanes as ``[cos, cos, 1...]`` and
``[-sin, sin, 0...]``, so the dims past ``rotary_dim`` pass through unchanged (partial RoPE)
without unaligned lane slices.

The pages stay in HBM (``memory_space=pl.ANY``) and are aliased to the outputs: donated by the
caller, they are updated in place and only the new rows move. Each token's normed and rotated
``[Hkv, D]`` k row and its v row are staged in VMEM and copied by one DMA each into
``pages.at[page_id, slot]``; the pool keeps its layout ``[num_pages, page_size, Hkv, D]``, so
nothing relayouts or copies it. The positions ``[B * T]`` and the page table are prefetched into
SMEM, where each token's page is looked up: a negative position, one past the sequence's page
table, or a page id outside ``[0, num_pages)`` (the cache's sentinel) is dropped, its copy never
started, and the rest of the pool is never touched. Two tokens of a batch writing the same
(page, slot) race, as they do in the reference's scatter.

Limits: float32 and bfloat16 only (float16 is refused); the GPU kernels' shape rules (the
``check_*`` functions of ``pallas_kernels.norm_rope``: head_dim a power of two >= 16,
rotary_dim / 2 a power of two dividing head_dim / 2); the whole page table must fit in SMEM
beside the positions, as for ``paged_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.norm_rope import check_norm_rope_write_args, check_pages, check_positions, check_qkv
from pallas_kernels.tpu.dma import guarded
from pallas_kernels.tpu.paged_attention import vmem_capacity

# Elements of the input rows (tokens x heads x head_dim) one program takes at most by default.
ELEMENTS_PER_TILE = 2 ** 20
# Tokens normed and rotated at a time inside a program (one bf16 (16, 128) tile of rows), so that
# the f32 temporaries and the code stay small whatever the block.
CHUNK_T = 16
# f32 copies of a chunk that the norm and the rotation keep live at once (x, its two rolls, the
# widened tables' products and the result), counted by the VMEM estimate.
LIVE_F32_CHUNKS = 5


def choose_block_t(tokens: int, width: int) -> int:
    """Tokens per program: all of them when ``tokens * width`` fits ELEMENTS_PER_TILE, otherwise
    a multiple of 16 (whole bf16 (16, 128) tiles) that fits it."""
    if tokens * width <= ELEMENTS_PER_TILE:
        return tokens
    return max(16, ELEMENTS_PER_TILE // width // 16 * 16)


def vmem_estimate(block_t: int, in_width: int, out_width: int, rope_width: int, staged_width: int,
                  itemsize: int) -> int:
    """Bytes of VMEM a program holds: its input and output blocks (double-buffered by the
    pipeline), the tables, the rows staged for the page DMAs and the f32 temporaries of a chunk's
    ``rope_width`` values per token that are normed and rotated."""
    blocks = 2 * block_t * (in_width + out_width) * itemsize
    staged = block_t * staged_width * itemsize
    return blocks + staged + LIVE_F32_CHUNKS * min(block_t, CHUNK_T) * rope_width * 4


def _norm_rope(x: jax.Array, weight: jax.Array | None, cos: jax.Array, sin: jax.Array, *, eps: float,
               dtype) -> jax.Array:
    """RMSNorm (weight [1, D]; None: no norm) then rotate-half RoPE of x [t, heads, D], with the
    tables cos, sin [t, R/2]; returns [t, heads, D] in ``dtype``.

    Rounds to ``dtype`` where the reference does (the normed rows and their product with the
    weight) and rotates in f32.
    """
    x = x.astype(jnp.float32)
    tokens, _, head_dim = x.shape
    if weight is not None:
        def round_(value):
            return value.astype(dtype).astype(jnp.float32)

        inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        x = round_(round_(weight.astype(jnp.float32))[None] * round_(x * inv_rms))
    half = cos.shape[-1]
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    rest = head_dim - 2 * half
    ones, zeros = (jnp.full((tokens, rest), value, jnp.float32) for value in (1.0, 0.0))
    cos_wide = jnp.concatenate([cos, cos] + ([ones] if rest else []), axis=-1)[:, None, :]
    sin_wide = jnp.concatenate([-sin, sin] + ([zeros] if rest else []), axis=-1)[:, None, :]
    lane = lax.broadcasted_iota(jnp.int32, (1, 1, head_dim), 2)
    # Lane i < R/2 pairs with i + R/2 (negated by sin_wide), lane R/2 <= i < R with i - R/2.
    partner = jnp.where(lane < half, pltpu.roll(x, head_dim - half, 2), pltpu.roll(x, half, 2))
    return (x * cos_wide + partner * sin_wide).astype(dtype)


def _write_rows(pos_ref, pt_ref, first: int | jax.Array, count: jax.Array, q_len: int, rows, pages,
                sem) -> None:
    """DMA rows.at[t] (each [Hkv, D]) to pages.at[page, slot] of token ``first + t``'s position
    for t < count; ``rows`` and ``pages`` are equal-length lists (k and v). A position that is
    negative, past its sequence's page table or mapped to a page id outside the pool is dropped
    (as ``paging.write_pages`` drops it): its copies are never started. All are started, then
    waited for."""
    num_pages, page_size = pages[0].shape[:2]
    pages_per_seq = pt_ref.shape[1]

    def copies(t):
        token = first + t
        position = pos_ref[token]
        logical = position // page_size
        page = pt_ref[token // q_len, jnp.clip(logical, 0, pages_per_seq - 1)]
        wanted = (position >= 0) & (logical < pages_per_seq) & (page >= 0) & (page < num_pages)
        page = jnp.clip(page, 0, num_pages - 1)
        return wanted, [pltpu.make_async_copy(src.at[t], dst.at[page, position % page_size], sem.at[i])
                        for i, (src, dst) in enumerate(zip(rows, pages))]

    def start(t, carry):
        guarded(*copies(t), "start")
        return carry

    def wait(t, carry):
        guarded(*copies(t), "wait")
        return carry

    lax.fori_loop(0, count, start, 0)
    lax.fori_loop(0, count, wait, 0)


def _for_chunks(block_t: int, body) -> None:
    """body(rows) for the tile's tokens in chunks of CHUNK_T rows (pl.ds), a shorter one last."""
    full, tail = divmod(block_t, CHUNK_T)
    if full:
        def step(chunk, carry):
            body(pl.ds(pl.multiple_of(chunk * CHUNK_T, CHUNK_T), CHUNK_T))
            return carry
        lax.fori_loop(0, full, step, 0)
    if tail:
        body(pl.ds(full * CHUNK_T, tail))


def _tile_count(block_t: int, tokens: int) -> jax.Array:
    """Real tokens of this program's tile (the last tile may be partial)."""
    return jnp.minimum(block_t, tokens - pl.program_id(0) * block_t)


def _norm_rope_write_kernel(pos_ref, pt_ref, k_ref, v_ref, *refs, normalize: bool, tokens: int, q_len: int,
                            eps: float):
    """Refs: positions [B * T] and the page table (SMEM), k and v [t, Hkv, D], (k norm weight
    [1, D],) cos, sin [t, R/2], the input pages (aliased), the output pages, the staged k rows and
    the DMA semaphores."""
    refs = list(refs)
    kw_ref = refs.pop(0) if normalize else None
    cos_ref, sin_ref, _k_in, _v_in, k_pages, v_pages, k_rows, sems = refs
    block_t = k_ref.shape[0]

    def chunk(rows):
        k_rows[rows] = _norm_rope(k_ref[rows], None if kw_ref is None else kw_ref[...], cos_ref[rows], sin_ref[rows],
                                  eps=eps, dtype=k_rows.dtype)

    _for_chunks(block_t, chunk)
    _write_rows(pos_ref, pt_ref, pl.program_id(0) * block_t, _tile_count(block_t, tokens), q_len, [k_rows, v_ref],
                [k_pages, v_pages], sems)


def _vmem_limit(name: str, needed: int, interpret: bool, what: str) -> int | None:
    """The scoped VMEM limit for a program needing ``needed`` bytes; ValueError naming the kernel
    when that is more than 3/4 of the TPU's VMEM."""
    capacity = None if interpret else vmem_capacity()
    if capacity is None:
        return None
    if needed > capacity * 3 // 4:
        raise ValueError(f"{name}: {what} need about {needed / 2**20:.0f} MiB of VMEM, more than 3/4 of the "
                         f"{capacity / 2**20:.0f} MiB this TPU has: take a smaller block_t")
    return min(capacity * 3 // 4, max(32 * 2**20, 2 * needed))


def _block_t(name: str, block_t: int | None, tokens: int, width: int) -> int:
    """block_t as given (checked) or chosen by ``choose_block_t``, at most ``tokens``."""
    block_t = choose_block_t(tokens, width) if block_t is None else block_t
    if block_t < 1 or (block_t < tokens and block_t % 16):
        raise ValueError(f"{name}: block_t must be a multiple of 16 or all {tokens} tokens, got {block_t}")
    return min(block_t, tokens)


def _cost(tokens: int, rope_heads: int, head_dim: int, half: int, normalize: bool, moved: int, itemsize: int):
    """Our own count: every input and output byte once (``moved`` values per token, plus the
    tables); about 10 FLOPs per normed and rotated value, one rsqrt per normed row."""
    return pl.CostEstimate(flops=10 * tokens * rope_heads * head_dim,
                           transcendentals=tokens * rope_heads if normalize else 0,
                           bytes_accessed=tokens * (moved + 2 * half) * itemsize)


def _check_dtype(name: str, dtype) -> None:
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: dtype must be float32 or bfloat16 on TPU, got {dtype}")


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_t"))
def norm_rope_write(k: jax.Array, v: jax.Array, k_norm_weight: jax.Array | None, cos: jax.Array, sin: jax.Array,
                    positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, *,
                    eps: float, interpret: bool = False,
                    block_t: int | None = None) -> tuple[jax.Array, jax.Array]:
    """TPU version of ``norm_rope_write_reference``: returns the updated (k_pages, v_pages).

    k, v: [B, T, Hkv, D]; k_norm_weight [D] or None; cos, sin [B, T, R/2]; positions [B, T];
    pages [P, S, Hkv, D] (aliased to the outputs: donate them for an in-place update);
    page_table [B, n] int32. block_t: tokens per program (of the B * T).
    """
    name = "tpu_norm_rope_write"
    check_norm_rope_write_args(k, v, k_norm_weight, cos, sin, positions, k_pages, v_pages, page_table)
    _check_dtype(name, k.dtype)
    batch, q_len, heads, head_dim = k.shape
    tokens, half, itemsize = batch * q_len, cos.shape[-1], k.dtype.itemsize
    row = heads * head_dim
    block_t = _block_t(name, block_t, tokens, row)
    normalize = k_norm_weight is not None
    limit = _vmem_limit(name, vmem_estimate(block_t, 2 * row + 2 * half, 0, row, row, itemsize), interpret,
                        f"block_t={block_t} tokens x {heads} KV heads of {head_dim}")
    rows_spec = pl.BlockSpec((block_t, heads, head_dim), lambda i, *_: (i, 0, 0))
    table_spec = pl.BlockSpec((block_t, half), lambda i, *_: (i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [rows_spec, rows_spec, *([pl.BlockSpec((1, head_dim), lambda i, *_: (0, 0))] if normalize else []),
                table_spec, table_spec, any_spec, any_spec]
    inputs = (k.reshape(tokens, heads, head_dim), v.reshape(tokens, heads, head_dim),
              *((k_norm_weight.reshape(1, head_dim),) if normalize else ()),
              cos.astype(k.dtype).reshape(tokens, half), sin.astype(k.dtype).reshape(tokens, half), k_pages, v_pages)
    kernel = functools.partial(_norm_rope_write_kernel, normalize=normalize, tokens=tokens, q_len=q_len, eps=eps)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(pl.cdiv(tokens, block_t),), in_specs=in_specs,
            out_specs=(any_spec, any_spec),
            scratch_shapes=[pltpu.VMEM((block_t, heads, head_dim), k.dtype), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        # operands 0 and 1 are the positions and the page table; the pages are the last two
        input_output_aliases={len(inputs): 0, len(inputs) + 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
        cost_estimate=_cost(tokens, heads, head_dim, half, normalize, 4 * row, itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(positions.reshape(-1).astype(jnp.int32), page_table, *inputs)


def _qkv_kernel(*refs, paged: bool, normalize: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                tokens: int, q_len: int, eps: float):
    """Refs: (positions [B * T] and the page table in SMEM,) qkv [t, (Hq + 2 Hkv) * D], (q and k
    norm weights [1, D],) cos, sin [t, R/2], (the input pages,) then the outputs q [t, Hq, D] and
    either the pages, the staged k and v rows and the DMA semaphores (``paged``) or k and v
    [t, Hkv, D]."""
    refs = list(refs)
    pos_ref, pt_ref = (refs.pop(0), refs.pop(0)) if paged else (None, None)
    x_ref = refs.pop(0)
    qw_ref, kw_ref = (refs.pop(0), refs.pop(0)) if normalize else (None, None)
    cos_ref, sin_ref, *refs = refs
    if paged:
        _k_in, _v_in, q_ref, k_pages, v_pages, k_ref, v_ref, sems = refs
    else:
        q_ref, k_ref, v_ref = refs
    block_t = x_ref.shape[0]

    def chunk(rows):
        def heads(first, count):
            """Heads [first, first + count) of the chunk's tokens as f32 [t, count, D] (split
            from the lanes in f32: a bf16 value split so and stored at a dynamic row offset fails
            Mosaic's tiling proof)."""
            x = x_ref[rows, first * head_dim:(first + count) * head_dim].astype(jnp.float32)
            return x.reshape(-1, count, head_dim)

        cos, sin = cos_ref[rows], sin_ref[rows]
        for out_ref, w_ref, x in ((q_ref, qw_ref, heads(0, num_heads)),
                                  (k_ref, kw_ref, heads(num_heads, num_kv_heads))):
            out_ref[rows] = _norm_rope(x, None if w_ref is None else w_ref[...], cos, sin, eps=eps,
                                       dtype=out_ref.dtype)
        v_ref[rows] = heads(num_heads + num_kv_heads, num_kv_heads).astype(v_ref.dtype)

    _for_chunks(block_t, chunk)
    if paged:
        _write_rows(pos_ref, pt_ref, pl.program_id(0) * block_t, _tile_count(block_t, tokens), q_len,
                    [k_ref, v_ref], [k_pages, v_pages], sems)


def _qkv_call(qkv, q_norm_weight, k_norm_weight, cos, sin, positions, pages, *, num_heads: int,
              num_kv_heads: int, eps: float, interpret: bool, block_t: int | None):
    """The pallas_call behind both qkv wrappers: ``pages`` is (k_pages, v_pages, page_table) or
    None. Returns q [B * T, Hq, D] and either the pages or k, v [B * T, Hkv, D]."""
    name = "tpu_qkv_norm_rope" if pages is None else "tpu_qkv_norm_rope_write"
    batch, q_len, head_dim, _ = check_qkv(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads)
    _check_dtype(name, qkv.dtype)
    tokens, width, half, itemsize = batch * q_len, qkv.shape[-1], cos.shape[-1], qkv.dtype.itemsize
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    block_t = _block_t(name, block_t, tokens, width)
    normalize = q_norm_weight is not None
    weight_spec = pl.BlockSpec((1, head_dim), lambda i, *_: (0, 0))
    table_spec = pl.BlockSpec((block_t, half), lambda i, *_: (i, 0))
    in_specs = [pl.BlockSpec((block_t, width), lambda i, *_: (i, 0)),
                *((weight_spec, weight_spec) if normalize else ()), table_spec, table_spec]
    inputs = [qkv.reshape(tokens, width),
              *((q_norm_weight.reshape(1, head_dim), k_norm_weight.reshape(1, head_dim)) if normalize else ()),
              cos.astype(qkv.dtype).reshape(tokens, half), sin.astype(qkv.dtype).reshape(tokens, half)]
    q_shape = jax.ShapeDtypeStruct((tokens, num_heads, head_dim), qkv.dtype)
    q_spec = pl.BlockSpec((block_t, num_heads, head_dim), lambda i, *_: (i, 0, 0))
    if pages is None:
        prefetch, scratch, aliases = (), [], {}
        kv_shape = jax.ShapeDtypeStruct((tokens, num_kv_heads, head_dim), qkv.dtype)
        kv_spec = pl.BlockSpec((block_t, num_kv_heads, head_dim), lambda i, *_: (i, 0, 0))
        out_shape, out_specs = (q_shape, kv_shape, kv_shape), (q_spec, kv_spec, kv_spec)
        out_width = q_width + 2 * kv_width
    else:
        k_pages, v_pages, page_table = pages
        check_positions(positions, (batch, q_len))
        check_pages(jax.ShapeDtypeStruct((batch, q_len, num_kv_heads, head_dim), qkv.dtype), k_pages, v_pages,
                     page_table)
        prefetch = (positions.reshape(-1).astype(jnp.int32), page_table)
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        in_specs += [any_spec, any_spec]
        inputs += [k_pages, v_pages]
        aliases = {len(inputs): 1, len(inputs) + 1: 2}  # operands 0 and 1 are the positions and table
        out_shape = (q_shape, *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pages, v_pages)))
        out_specs = (q_spec, any_spec, any_spec)
        scratch = [pltpu.VMEM((block_t, num_kv_heads, head_dim), qkv.dtype)] * 2 + [pltpu.SemaphoreType.DMA((2,))]
        out_width = q_width
    rope_width = q_width + kv_width
    needed = vmem_estimate(block_t, width + 2 * half, out_width, rope_width, 2 * kv_width * (pages is not None),
                           itemsize)
    limit = _vmem_limit(name, needed, interpret,
                        f"block_t={block_t} tokens x {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    kernel = functools.partial(_qkv_kernel, paged=pages is not None, normalize=normalize, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, tokens=tokens, q_len=q_len, eps=eps)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(pl.cdiv(tokens, block_t),), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
        cost_estimate=_cost(tokens, num_heads + num_kv_heads, head_dim, half, normalize, width + q_width + 2 * kv_width,
                            itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*prefetch, *inputs)


_QKV_STATICS = ("num_heads", "num_kv_heads", "eps", "interpret", "block_t")


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope(qkv: jax.Array, q_norm_weight: jax.Array | None, k_norm_weight: jax.Array | None,
                  cos: jax.Array, sin: jax.Array, *, num_heads: int, num_kv_heads: int, eps: float,
                  interpret: bool = False, block_t: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TPU version of ``qkv_norm_rope_reference`` (same arguments and results): qkv
    [B, T, (Hq + 2 Hkv) * D] -> (norm_rope(q) [B, T, Hq, D], norm_rope(k), v [B, T, Hkv, D])."""
    q, k, v = _qkv_call(qkv, q_norm_weight, k_norm_weight, cos, sin, None, None, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, eps=eps, interpret=interpret, block_t=block_t)
    batch, q_len = qkv.shape[:2]
    return tuple(x.reshape(batch, q_len, *x.shape[1:]) for x in (q, k, v))


@functools.partial(jax.jit, static_argnames=_QKV_STATICS)
def qkv_norm_rope_write(qkv: jax.Array, q_norm_weight: jax.Array | None, k_norm_weight: jax.Array | None,
                        cos: jax.Array, sin: jax.Array, positions: jax.Array, k_pages: jax.Array,
                        v_pages: jax.Array, page_table: jax.Array, *, num_heads: int, num_kv_heads: int,
                        eps: float, interpret: bool = False,
                        block_t: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TPU version of ``qkv_norm_rope_write_reference`` (same arguments and results): qkv
    [B, T, (Hq + 2 Hkv) * D] at ``positions`` [B, T] -> (norm_rope(q) [B, T, Hq, D], k_pages,
    v_pages with norm_rope(k) and v stored). The pages are aliased to the outputs (in place when
    donated); dropped positions leave them untouched."""
    q, k_pages, v_pages = _qkv_call(qkv, q_norm_weight, k_norm_weight, cos, sin, positions,
                                    (k_pages, v_pages, page_table), num_heads=num_heads,
                                    num_kv_heads=num_kv_heads, eps=eps, interpret=interpret, block_t=block_t)
    return q.reshape(*qkv.shape[:2], num_heads, -1), k_pages, v_pages

"""Pallas kernels vs their plain-jnp references (interpret mode on CPU), and their CUDA lowering.

Every case builds a fresh paged cache: pages handed out in a random order, every slot that no
query may see (free pages, the tail of a sequence's last page) filled with NaN, and unused
page-table entries pointing past the last page, so a wrong read shows up as NaN or a mismatch.
On a GPU backend (``JAX_PLATFORMS=cuda``) the same checks run the compiled kernels instead.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

F32_TOL = 1e-5
LOW_TOL = 1e-2  # bf16 / f16: relative L2 error


@pytest.fixture
def interpret():
    return jax.default_backend() != "gpu"


def _rng(*key) -> np.random.Generator:
    """A fresh, reproducible stream per test case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _check(out, ref, dtype):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "kernel output has NaN/inf (read of an invisible slot?)"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < (F32_TOL if dtype == jnp.float32 else LOW_TOL), f"relative L2 error {err:.3g}"


def make_cache(rng, lens, *, pages_per_seq, page_size, kv_heads, head_dim, dtype, spare=3):
    """Random K/V pages where only positions < lens[b] of each sequence hold numbers.

    Returns (k_pages, v_pages, page_table). Pages are handed out in a random order; pages past a
    sequence's need map to ``num_pages`` (out of range, as the cache allocator leaves them).
    """
    batch = len(lens)
    need = [-(-int(n) // page_size) for n in lens]
    num_pages = sum(need) + spare
    order = rng.permutation(num_pages)
    table = np.full((batch, pages_per_seq), num_pages, np.int32)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    used = 0
    for b, n in enumerate(lens):
        table[b, :need[b]] = order[used:used + need[b]]
        used += need[b]
        for p in range(n):
            slot = (table[b, p // page_size], p % page_size)
            k[slot] = rng.standard_normal((kv_heads, head_dim))
            v[slot] = rng.standard_normal((kv_heads, head_dim))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


# --------------------------------------------------------------------------------------------
# paged_verify_attention: decode (T=1), verify (T<=16), prefill (query tiles).

VERIFY_CASES = [
    # dtype, group, head_dim, page_size, T, lengths (start + T), window, tuning
    ("f32", 1, 64, 16, 1, [1, 32, 45], None, {}),
    ("f32", 4, 128, 32, 16, [64, 16, 50], None, {}),
    ("bf16", 8, 64, 16, 5, [5, 48, 37], 20, {}),
    ("bf16", 4, 128, 16, 1, [80, 1, 33], None, {"num_splits": 3}),
    ("f32", 4, 64, 32, 40, [40, 96], 24, {"block_t": 8}),
    ("bf16", 1, 128, 32, 16, [16, 61], 8, {}),
    ("f32", 8, 128, 16, 2, [2, 64, 17], 17, {"num_splits": 2, "pages_per_block": 2}),
    ("bf16", 4, 64, 16, 70, [70, 90], None, {"block_t": 16, "num_splits": 2}),
    ("f16", 4, 64, 16, 3, [3, 31], None, {}),
]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_verify_attention(case, interpret):
    dtype, group, head_dim, page_size, q_len, lens, window, tuning = case
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    rng = _rng("verify", case)
    kv_heads = 2
    pages_per_seq = -(-max(lens) // page_size) + 1
    k, v, table = make_cache(rng, lens, pages_per_seq=pages_per_seq, page_size=page_size,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), q_len, kv_heads * group, head_dim)), dtype)
    start = jnp.asarray(lens, jnp.int32) - q_len
    out = pk.paged_verify_attention(q, k, v, table, start, sliding_window=window,
                                    interpret=interpret, **tuning)
    ref = jax.jit(pk.paged_verify_attention_reference, static_argnames="sliding_window")(
        q, k, v, table, start, sliding_window=window)
    _check(out, ref, dtype)


# --------------------------------------------------------------------------------------------
# paged_draft_attention: context pages + the block's own K/V in one softmax.

DRAFT_CASES = [
    # dtype, group, head_dim, page_size, T, context_lens, block_lens, window, causal, tuning
    ("f32", 4, 64, 16, 16, [0, 1, 32], None, None, False, {}),
    ("f32", 1, 128, 32, 16, [64, 45], [5, 16], None, True, {}),
    ("bf16", 8, 64, 16, 8, [17, 48, 3], [8, 0, 3], 12, False, {}),
    ("bf16", 4, 128, 16, 16, [77, 32], [16, 9], 20, True, {"num_splits": 3}),
    ("f32", 4, 64, 32, 16, [96, 10], [1, 16], 40, False, {"num_splits": 2, "block_t": 2}),
    ("bf16", 1, 64, 32, 4, [31, 0], [2, 4], None, False, {}),
]


@pytest.mark.parametrize("case", DRAFT_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_draft_attention(case, interpret):
    dtype, group, head_dim, page_size, block, ctx, blens, window, causal, tuning = case
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    rng = _rng("draft", case)
    kv_heads = 2
    batch = len(ctx)
    pages_per_seq = -(-max(ctx) // page_size) + 1
    k, v, table = make_cache(rng, ctx, pages_per_seq=pages_per_seq, page_size=page_size,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((batch, block, kv_heads * group, head_dim)), dtype)
    block_k = rng.standard_normal((batch, block, kv_heads, head_dim))
    block_v = rng.standard_normal((batch, block, kv_heads, head_dim))
    if blens is not None:  # keys past block_lens are not real: poison them
        pad = np.arange(block)[None, :] >= np.asarray(blens)[:, None]
        block_k[pad] = np.nan
        block_v[pad] = np.nan
        blens = jnp.asarray(blens, jnp.int32)
    block_k, block_v = jnp.asarray(block_k, dtype), jnp.asarray(block_v, dtype)
    ctx = jnp.asarray(ctx, jnp.int32)
    out = pk.paged_draft_attention(q, k, v, table, ctx, block_k, block_v, blens,
                                   sliding_window=window, causal=causal, interpret=interpret,
                                   **tuning)
    ref = jax.jit(pk.paged_draft_attention_reference,
                  static_argnames=("sliding_window", "causal"))(
        q, k, v, table, ctx, block_k, block_v, blens, sliding_window=window, causal=causal)
    _check(out, ref, dtype)


# --------------------------------------------------------------------------------------------
# norm_rope and norm_rope_write.

NORM_CASES = [("f32", 64, 3, 5), ("bf16", 128, 8, 3), ("f32", 128, 1, 40), ("bf16", 64, 32, 1)]


@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_rope(case, interpret):
    dtype, head_dim, heads, q_len = case
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    rng = _rng("norm_rope", case)
    x = jnp.asarray(3 * rng.standard_normal((2, q_len, heads, head_dim)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, head_dim), dtype)
    positions = jnp.asarray(rng.integers(0, 40_000, (2, q_len)), jnp.int32)
    kw = dict(eps=1e-6, theta=1e6)
    out = pk.norm_rope(x, weight, positions, interpret=interpret, **kw)
    ref = jax.jit(functools.partial(pk.norm_rope_reference, **kw))(x, weight, positions)
    _check(out, ref, dtype)


WRITE_CASES = [("f32", 64, 16, 2), ("bf16", 128, 32, 8), ("f32", 128, 32, 1), ("bf16", 64, 16, 4)]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_rope_write(case, interpret):
    dtype, head_dim, page_size, heads = case
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    rng = _rng("write", case)
    batch, q_len, pages_per_seq = 3, 6, 3
    num_pages = batch * pages_per_seq + 2
    table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
    table[2, 2] = num_pages  # unallocated entry: writes there are dropped
    cap = pages_per_seq * page_size
    positions = np.stack([rng.permutation(cap)[:q_len] for _ in range(batch)])
    positions[0, :3] = [-1, cap, 0]  # outside the page table: dropped
    positions[2, 0] = 2 * page_size + 1  # lands in the unallocated page
    pages = [jnp.asarray(rng.standard_normal((num_pages, page_size, heads, head_dim)), dtype)
             for _ in range(2)]
    k, v = (jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)), dtype)
            for _ in range(2))
    weight = jnp.asarray(rng.uniform(0.5, 1.5, head_dim), dtype)
    args = (k, v, weight, jnp.asarray(positions, jnp.int32), *pages,
            jnp.asarray(table, jnp.int32))
    kw = dict(eps=1e-6, theta=1e4)
    k_out, v_out = pk.norm_rope_write(*args, interpret=interpret, **kw)
    k_ref, v_ref = jax.jit(functools.partial(pk.norm_rope_write_reference, **kw))(*args)
    _check(k_out, k_ref, dtype)
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))


# --------------------------------------------------------------------------------------------
# Argument checking and the CUDA (Triton) lowering, both without running anything.

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


def _attention_shapes(batch=2, q_len=16, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                      pages_per_seq=64, num_pages=200, dtype=BF):
    pages = S((num_pages, page_size, kv_heads, head_dim), dtype)
    return (S((batch, q_len, q_heads, head_dim), dtype), pages, pages,
            S((batch, pages_per_seq), jnp.int32), S((batch,), jnp.int32))


def _draft_shapes(batch=2, block=16, kv_heads=8, head_dim=128, **kw):
    blk = S((batch, block, kv_heads, head_dim), kw.get("dtype", BF))
    return (*_attention_shapes(batch=batch, q_len=block, kv_heads=kv_heads, head_dim=head_dim,
                               **kw), blk, blk, S((batch,), jnp.int32))


def _write_shapes(batch=2, q_len=16, kv_heads=8, head_dim=128):
    kv = S((batch, q_len, kv_heads, head_dim), BF)
    pages = S((200, 16, kv_heads, head_dim), BF)
    return (kv, kv, S((head_dim,), BF), S((batch, q_len), jnp.int32), pages, pages,
            S((batch, 64), jnp.int32))


LOWERINGS = {
    "decode": (pk.paged_verify_attention, _attention_shapes(q_len=1), {}),
    "verify_window": (pk.paged_verify_attention, _attention_shapes(), {"sliding_window": 64}),
    "verify_one_split": (pk.paged_verify_attention, _attention_shapes(batch=32), {}),
    "prefill": (pk.paged_verify_attention, _attention_shapes(batch=1, q_len=1000), {}),
    "verify_f32": (pk.paged_verify_attention, _attention_shapes(dtype=jnp.float32), {}),
    "draft": (pk.paged_draft_attention, _draft_shapes(), {}),
    "draft_causal_window": (pk.paged_draft_attention, _draft_shapes(batch=32),
                            {"causal": True, "sliding_window": 32}),
    "norm_rope": (pk.norm_rope, (S((2, 16, 32, 128), BF), S((128,), BF), S((2, 16), jnp.int32)),
                  {"eps": 1e-6, "theta": 1e6}),
    "norm_rope_write": (pk.norm_rope_write, _write_shapes(), {"eps": 1e-6, "theta": 1e6}),
}


def _abstract_gpu():
    """Lowering for CUDA without a GPU: jax >= 0.11 takes the target from an abstract device
    (0.10 falls back to sm_90 by itself, and accepts the same context)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("name", LOWERINGS)
def test_lowers_for_cuda(name):
    fn, shapes, kw = LOWERINGS[name]
    with _abstract_gpu():
        text = jax.jit(functools.partial(fn, **kw)).trace(*shapes).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


BAD_ARGS = [
    ("q", lambda: _attention_shapes(head_dim=48)),
    ("q heads", lambda: _attention_shapes(q_heads=24)),
    ("k_pages dtype", lambda: (S((2, 16, 32, 128), jnp.float32), *_attention_shapes()[1:])),
    ("page_size", lambda: _attention_shapes(page_size=24)),
    ("page_table", lambda: (*_attention_shapes()[:3], S((2, 64), jnp.int64 if jax.config.x64_enabled
                                                         else jnp.int16), S((2,), jnp.int32))),
    ("start", lambda: (*_attention_shapes()[:4], S((3,), jnp.int32))),
]


@pytest.mark.parametrize("match,shapes", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_verify_rejects_bad_args(match, shapes):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(pk.paged_verify_attention, *shapes())


def test_rejects_bad_tuning_and_block_shapes():
    with pytest.raises(ValueError, match="block_t"):
        jax.eval_shape(functools.partial(pk.paged_verify_attention, block_t=3),
                       *_attention_shapes())
    with pytest.raises(ValueError, match="pages_per_block"):
        jax.eval_shape(functools.partial(pk.paged_verify_attention, pages_per_block=3),
                       *_attention_shapes())
    shapes = list(_draft_shapes())
    shapes[5] = S((2, 8, 8, 128), BF)
    with pytest.raises(ValueError, match="block_k"):
        jax.eval_shape(pk.paged_draft_attention, *shapes)
    with pytest.raises(ValueError, match="block_rows"):
        jax.eval_shape(functools.partial(pk.norm_rope, eps=1e-6, theta=1e6, block_rows=48),
                       S((2, 16, 32, 128), BF), S((128,), BF), S((2, 16), jnp.int32))
    shapes = list(_write_shapes())
    shapes[4] = S((200, 16, 4, 128), BF)
    with pytest.raises(ValueError, match="k_pages"):
        jax.eval_shape(functools.partial(pk.norm_rope_write, eps=1e-6, theta=1e6), *shapes)

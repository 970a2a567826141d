"""Pallas kernels vs their plain-jnp references (interpret mode on CPU), and their CUDA lowering.

Every case builds a fresh paged cache: pages handed out in a random order, every slot that no
query may see (free pages, the tail of a sequence's last page) filled with NaN, and unused
page-table entries pointing past the last page, so a wrong read shows up as NaN or a mismatch.
On a GPU backend (``JAX_PLATFORMS=cuda``) the same checks run the compiled kernels instead.
"""

from __future__ import annotations

import functools
import itertools
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import gpu as pk_gpu
from pallas_kernels.attention import masked_gqa_attention
from pallas_kernels.gpu import tuning as pk_tuning
from pallas_kernels.gpu.fused_matmul import matmul_blocks

F32_TOL = 1e-5
LOW_TOL = 1e-2  # bf16 / f16: relative L2 error


@pytest.fixture
def interpret():
    return jax.default_backend() != "gpu"


def _rng(*key) -> np.random.Generator:
    """A fresh, reproducible stream per test case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _reference(fn, *args, **static):
    """The reference, jitted (as the model runs it) and with full-precision f32 matmuls (on a
    GPU, XLA's default would be TF32)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(fn, **static))(*args)


@pytest.fixture
def check(record_property):
    """Compare with the reference; the errors go into the junit report (``--junitxml``)."""
    def check(out, ref, dtype):
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        assert out.shape == ref.shape
        assert np.isfinite(out).all(), "kernel output has NaN/inf (read of an invisible slot?)"
        err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
        record_property("rel_l2_err", float(err))
        record_property("max_abs_err", float(np.max(np.abs(out - ref))))
        assert err < (F32_TOL if dtype == jnp.float32 else LOW_TOL), f"relative L2 error {err:.3g}"
    return check


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

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _grid(*axes):
    return list(itertools.product(*axes))


# Full product of dtype x GQA group x head_dim x sliding window; page size, query length (decode
# 1, verify 16 / 5, prefill 37 in several query tiles) and tuning overrides cycle along it so
# that each meets every value of the other axes (page size every head_dim x window pair); every
# batch mixes a fresh prompt (start 0), an exact page multiple and a random length.
VERIFY_GRID = _grid(("f32", "bf16"), (1, 4, 8), (64, 128), (None, 20))
VERIFY_T = (1, 16, 5, 37)
TUNINGS = ({}, {"num_splits": 3, "pallas_merge": True}, {"pages_per_block": 1},
           {"block_t": 16, "num_splits": 2, "pallas_merge": False})
VERIFY_CASES = [
    (dtype, group, head_dim, (16, 32)[(i + i // 2 + i // 4) % 2], window, VERIFY_T[(i + i // 4) % 4],
     TUNINGS[(i // 2 + i // 4) % 4])
    for i, (dtype, group, head_dim, window) in enumerate(VERIFY_GRID)
] + [("bf16", 4, 64, 16, 1, 5, {"num_splits": 2}),  # a window of one key: each query sees itself
     ("f16", 4, 64, 16, None, 3, {}), ("bf16", 4, 128, 16, 24, 70, {"block_t": 16}),
     ("bf16", 4, 128, 16, None, 16, {"pages_per_block": 4, "num_stages": 3, "num_splits": 1}),
     # groups that are not a power of two (Qwen3-14B: 40 heads over 8) ride padded to one
     ("bf16", 5, 128, 16, None, 16, {}), ("f32", 5, 64, 16, None, 16, {}),
     ("f32", 3, 64, 32, 20, 37, {"num_splits": 3})]


# Attention sinks (gpt-oss): a per-head logit in every row's normaliser. The kernel writes its
# log-sum-exp and the sink enters in the merge, with one split or several; windows, padded groups,
# decode, verify and prefill tiles; sinks large enough to dominate some rows.
SINK_CASES = [("f32", 4, 64, 16, None, 1, {}), ("f32", 2, 64, 16, 6, 16, {"num_splits": 3}),
              ("bf16", 8, 64, 32, 20, 37, {"block_t": 16}), ("f32", 5, 64, 16, 4, 5, {"num_splits": 2}),
              ("bf16", 4, 128, 16, None, 16, {"num_splits": 1})]



@pytest.mark.parametrize("case, with_sinks", [(c, False) for c in VERIFY_CASES] + [(c, True) for c in SINK_CASES],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else ("sinks" if c else "plain"))
def test_verify_attention(case, with_sinks, interpret, check):
    dtype, group, head_dim, page_size, window, q_len, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("verify", case, with_sinks)
    kv_heads = 2
    lens = [q_len, max(q_len, 2 * page_size), int(rng.integers(q_len, 3 * page_size + q_len))]
    pages_per_seq = -(-max(lens) // page_size) + 1
    k, v, table = make_cache(rng, lens, pages_per_seq=pages_per_seq, page_size=page_size,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), q_len, kv_heads * group, head_dim)), dtype)
    sinks = jnp.asarray(rng.normal(0.0, 2.0, kv_heads * group), dtype) if with_sinks else None
    start = jnp.asarray(lens, jnp.int32) - q_len
    out = pk_gpu.paged_verify_attention(q, k, v, table, start, sliding_window=window, sinks=sinks,
                                        interpret=interpret, **tuning)
    ref = _reference(pk.paged_verify_attention_reference, q, k, v, table, start,
                     sliding_window=window, sinks=sinks)
    check(out, ref, dtype)
    if with_sinks:  # the sinks move the rows (the comparison above could fail without them)
        plain = _reference(pk.paged_verify_attention_reference, q, k, v, table, start, sliding_window=window)
        assert not np.allclose(np.asarray(ref, np.float32), np.asarray(plain, np.float32), atol=1e-3)


def test_sink_reference_is_transformers_eager_formula():
    """gpt-oss's eager attention: the sink is one more score column, the softmax is taken over
    keys and sink together, and the sink's column is dropped (its weight has no value)."""
    rng = _rng("sink-formula")
    b, t, kv_heads, group, d, keys = 2, 3, 2, 3, 8, 7
    q = rng.standard_normal((b, t, kv_heads * group, d)).astype(np.float32)
    k = rng.standard_normal((b, keys, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((b, keys, kv_heads, d)).astype(np.float32)
    sinks = rng.normal(0, 2, kv_heads * group).astype(np.float32)
    visible = rng.random((b, t, keys)) < 0.7
    visible[:, :, 0] = True
    out = masked_gqa_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible),
                                  jnp.asarray(sinks))
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d)
    scores = np.where(visible[:, None], scores, -np.inf)
    column = np.broadcast_to(sinks[None, :, None, None], (b, kv_heads * group, t, 1))
    both = np.concatenate([scores, column], axis=-1)
    weights = np.exp(both - both.max(-1, keepdims=True))
    weights = (weights / weights.sum(-1, keepdims=True))[..., :-1]
    expected = np.einsum("bhts,bshd->bthd", weights, vv)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# paged_draft_attention: context pages + the block's own K/V in one softmax.

# Full product of dtype x group x causal x window; head_dim / page_size / block length and the
# tuning overrides cycle along it; each batch has context lengths 0, 1, an exact page multiple
# and a random one, and block_lens full, half, empty and random.
DRAFT_GRID = _grid(("f32", "bf16"), (1, 4, 8), (False, True), (None, 12))
DRAFT_SHAPES = ((64, 16, 16), (128, 32, 8), (128, 16, 16), (64, 32, 4))
DRAFT_CASES = [(*c, *DRAFT_SHAPES[(i + i // 2) % 4], TUNINGS[(i + i // 4) % 4])
               for i, c in enumerate(DRAFT_GRID)] + [
    ("bf16", 5, False, None, 128, 16, 16, {}), ("f32", 3, True, 12, 64, 32, 8, {"num_splits": 2}),
    # a two-sided window narrower than the block (the grid's windows all exceed its blocks there),
    # and no window on page size 32, non-causal
    ("f32", 4, False, 6, 64, 16, 16, {}), ("bf16", 4, False, 5, 128, 32, 16, {"num_splits": 2}),
    ("f32", 8, False, None, 128, 32, 16, {}), ("f32", 4, True, 1, 64, 16, 8, {}),
    # blocks longer than 16 that are not a power of two, or are one: the block tile pads them
    ("f32", 4, False, None, 64, 16, 24, {}), ("bf16", 1, True, 20, 128, 32, 32, {"num_splits": 2})]


# with attention sinks: causal or not, windowed or not, one split or several
DRAFT_SINK_CASES = [("f32", 4, False, None, 64, 16, 16, {}), ("bf16", 2, True, 12, 64, 16, 8, {"num_splits": 2}),
                    ("f32", 5, False, 6, 64, 32, 16, {"num_splits": 3})]


@pytest.mark.parametrize("case, with_sinks", [(c, False) for c in DRAFT_CASES] + [(c, True) for c in DRAFT_SINK_CASES],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else ("sinks" if c else "plain"))
def test_draft_attention(case, with_sinks, interpret, check):
    dtype, group, causal, window, head_dim, page_size, block, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("draft", case, with_sinks)
    kv_heads = 2
    ctx = [0, 1, 2 * page_size, int(rng.integers(2, 4 * page_size))]
    blens = [block, block // 2, 0, int(rng.integers(1, block + 1))]
    batch = len(ctx)
    pages_per_seq = -(-max(ctx) // page_size) + 1
    k, v, table = make_cache(rng, ctx, pages_per_seq=pages_per_seq, page_size=page_size,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((batch, block, kv_heads * group, head_dim)), dtype)
    block_k = rng.standard_normal((batch, block, kv_heads, head_dim))
    block_v = rng.standard_normal((batch, block, kv_heads, head_dim))
    pad = np.arange(block)[None, :] >= np.asarray(blens)[:, None]
    block_k[pad] = np.nan  # keys past block_lens are not real: poison them
    block_v[pad] = np.nan
    block_k, block_v = jnp.asarray(block_k, dtype), jnp.asarray(block_v, dtype)
    ctx, blens = jnp.asarray(ctx, jnp.int32), jnp.asarray(blens, jnp.int32)
    sinks = jnp.asarray(rng.normal(0.0, 2.0, kv_heads * group), dtype) if with_sinks else None
    out = pk_gpu.paged_draft_attention(q, k, v, table, ctx, block_k, block_v, blens,
                                       sliding_window=window, causal=causal, sinks=sinks, interpret=interpret,
                                       **tuning)
    ref = _reference(pk.paged_draft_attention_reference, q, k, v, table, ctx, block_k, block_v,
                     blens, sliding_window=window, causal=causal, sinks=sinks)
    check(out, ref, dtype)


# Long contexts on small KV tiles, so most steps take the unmasked loop and the masked edges
# (a window's start inside a tile, the causal diagonal, a ragged end) land at every offset
# within a tile and on both sides of a context split.
EDGE_CASES = [("verify", 1, None, {"pages_per_block": 1, "num_splits": 3}),
              ("verify", 16, None, {"pages_per_block": 2, "num_splits": 2}),
              ("verify", 5, 45, {"pages_per_block": 1, "num_splits": 3}),
              ("verify", 16, 100, {"pages_per_block": 2}),
              ("draft", 16, None, {"pages_per_block": 1, "num_splits": 3}),
              ("draft", 8, 37, {"pages_per_block": 2, "num_splits": 2})]


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_attention_unmasked_steps(case, interpret, check):
    kind, q_len, window, tuning = case
    rng = _rng("edges", case)
    page_size, kv_heads, head_dim, group = 16, 2, 64, 4
    lens = [q_len + 5 * page_size, q_len + int(rng.integers(3 * page_size, 12 * page_size)),
            q_len + int(rng.integers(1, page_size))]
    k, v, table = make_cache(rng, lens, pages_per_seq=-(-max(lens) // page_size) + 1,
                             page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
                             dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lens), q_len, kv_heads * group, head_dim)), jnp.float32)
    if kind == "verify":
        start = jnp.asarray(lens, jnp.int32) - q_len
        out = pk_gpu.paged_verify_attention(q, k, v, table, start, sliding_window=window,
                                            interpret=interpret, **tuning)
        ref = _reference(pk.paged_verify_attention_reference, q, k, v, table, start,
                         sliding_window=window)
    else:
        ctx = jnp.asarray(lens, jnp.int32)
        block_k, block_v = (jnp.asarray(rng.standard_normal((len(lens), q_len, kv_heads, head_dim)),
                                        jnp.float32) for _ in range(2))
        out = pk_gpu.paged_draft_attention(q, k, v, table, ctx, block_k, block_v, sliding_window=window,
                                           causal=False, interpret=interpret, **tuning)
        ref = _reference(pk.paged_draft_attention_reference, q, k, v, table, ctx, block_k, block_v,
                         sliding_window=window, causal=False)
    check(out, ref, jnp.float32)


def test_draft_attention_default_block_lens(interpret, check):
    rng = _rng("draft-default")
    k, v, table = make_cache(rng, [5, 40], pages_per_seq=4, page_size=16, kv_heads=2,
                             head_dim=64, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64)), jnp.float32)
    block_k, block_v = (jnp.asarray(rng.standard_normal((2, 16, 2, 64)), jnp.float32)
                        for _ in range(2))
    ctx = jnp.asarray([5, 40], jnp.int32)
    out = pk_gpu.paged_draft_attention(q, k, v, table, ctx, block_k, block_v, interpret=interpret)
    ref = _reference(pk.paged_draft_attention_reference, q, k, v, table, ctx, block_k, block_v)
    check(out, ref, jnp.float32)


def test_attention_at_the_page_tables_capacity(interpret, check):
    """Tables filled to the last slot: verify queries past the table's capacity (their keys
    could never be written) see every cached key, and a draft context longer than the table
    reads only what the table holds, as the references do."""
    rng = _rng("capacity")
    page_size, kv_heads, group, head_dim, q_len = 16, 2, 4, 64, 16
    lens = [3 * page_size, 3 * page_size]
    k, v, table = make_cache(rng, lens, pages_per_seq=3, page_size=page_size, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, q_len, kv_heads * group, head_dim)), jnp.float32)
    start = jnp.asarray([3 * page_size - 4, 3 * page_size - 9], jnp.int32)  # 12 and 7 queries past the end
    for tuning in ({}, {"pages_per_block": 1, "num_splits": 2}):
        out = pk_gpu.paged_verify_attention(q, k, v, table, start, interpret=interpret, **tuning)
        check(out, _reference(pk.paged_verify_attention_reference, q, k, v, table, start), jnp.float32)
        block_k, block_v = (jnp.asarray(rng.standard_normal((2, q_len, kv_heads, head_dim)), jnp.float32)
                            for _ in range(2))
        ctx = jnp.asarray([3 * page_size, 3 * page_size + 7], jnp.int32)
        out = pk_gpu.paged_draft_attention(q, k, v, table, ctx, block_k, block_v, interpret=interpret, **tuning)
        check(out, _reference(pk.paged_draft_attention_reference, q, k, v, table, ctx, block_k, block_v),
              jnp.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_f16_values_at_the_top_of_the_range_stay_finite(interpret, num_splits):
    """Every value 65504 (f16's largest): the output is a convex combination of the values, so
    it must come out 65504, not round past it to inf (split partials too). Key 0 scores 0 (the
    maximum); keys 1..31 share the score whose weight f16 rounds up the most, the worst case for
    a normalizer that would sum the weights unrounded."""
    head_dim, page_size = 16, 16
    scale = np.float32(head_dim ** -0.5 * np.log2(np.e))
    weight = lambda c: np.exp2(np.float32(c) * scale)  # noqa: E731  (q = e_0, key = c e_0)
    c = max(-np.arange(0.5, 4, 2 ** -9, dtype=np.float32),
            key=lambda c: (np.float32(np.float16(weight(c))) - weight(c)) / weight(c))
    k = np.zeros((2, page_size, 1, head_dim), np.float16)
    k.reshape(-1, head_dim)[1:, 0] = c
    v = np.full(k.shape, 65504, np.float16)
    q = np.zeros((1, 1, 1, head_dim), np.float16)
    q[..., 0] = 1
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([[0, 1]], jnp.int32),
            jnp.asarray([2 * page_size - 1], jnp.int32))  # the query sees all 32 keys
    out = pk_gpu.paged_verify_attention(*args, interpret=interpret, num_splits=num_splits, pages_per_block=1)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 65504)


# --------------------------------------------------------------------------------------------
# norm_rope_write, qkv_norm_rope_write and qkv_norm_rope. Each case also picks a RoPE: its kind
# (default, llama3 or YaRN tables, whose attention factor scales cos and sin), the rotated
# fraction of head_dim (1: whole heads; less: partial rotary, the rest passing through) and
# whether the heads are RMS-normed first (Qwen3) or not (LLaMA).

ROPES = {"default": ("default", 1.0, True), "llama3-nonorm": ("llama3", 1.0, False),
         "yarn-half": ("yarn", 0.5, True), "quarter-nonorm": ("default", 0.25, False)}


def _rope_tables(name: str, positions, head_dim: int, dtype):
    """(cos, sin, normed) of RoPE variant ``name`` at ``positions`` [B, T]."""
    from dflash_jax.model.nn.rope import RopeSpec, tables

    kind, fraction, normed = ROPES[name]
    scaling = {"llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
               "yarn": dict(factor=4.0, original_max_position_embeddings=256, attention_factor=1.2)}
    spec = RopeSpec(theta=1e4, rotary_dim=int(head_dim * fraction), kind=kind, **scaling.get(kind, {}))
    cos, sin = tables(jnp.asarray(positions, jnp.int32), spec, dtype)
    return cos, sin, normed


WRITE_CASES = [("f32", 64, 16, 2, "default"), ("bf16", 128, 32, 8, "llama3-nonorm"), ("f32", 128, 32, 1, "yarn-half"),
               ("bf16", 64, 16, 4, "quarter-nonorm"), ("f32", 64, 32, 2, "llama3-nonorm"),
               ("bf16", 128, 16, 8, "yarn-half"), ("f32", 64, 16, 4, "quarter-nonorm")]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_rope_write(case, interpret, check):
    dtype, head_dim, page_size, heads, rope = case
    dtype = DTYPES[dtype]
    rng = _rng("write", case)
    batch, q_len, pages_per_seq = 3, 6, 3
    num_pages = batch * pages_per_seq + 2
    table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
    table[2, 2] = num_pages  # unallocated entry: writes there are dropped
    table[1, 0] = -1  # and a negative one (it would address memory before the pages on a GPU)
    cap = pages_per_seq * page_size
    positions = np.stack([rng.permutation(cap)[:q_len] for _ in range(batch)])
    positions[0, :3] = [-1, cap, 0]  # outside the page table: dropped
    positions[2, 0] = 2 * page_size + 1  # lands in the unallocated page
    positions[1, 0] = 1  # lands in the negative one
    pages = [jnp.asarray(rng.standard_normal((num_pages, page_size, heads, head_dim)), dtype)
             for _ in range(2)]
    k, v = (jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)), dtype)
            for _ in range(2))
    cos, sin, normed = _rope_tables(rope, positions, head_dim, dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, head_dim), dtype) if normed else None
    args = (k, v, weight, cos, sin, jnp.asarray(positions, jnp.int32), *pages,
            jnp.asarray(table, jnp.int32))
    kw = dict(eps=1e-6)
    k_out, v_out = pk_gpu.norm_rope_write(*args, interpret=interpret, **kw)
    k_ref, v_ref = _reference(pk.norm_rope_write_reference, *args, **kw)
    # the written slots against the reference's (on their own: they are ~5% of the pages), and
    # every other slot untouched
    k_out, k_ref, before = (np.asarray(x, np.float32) for x in (k_out, k_ref, pages[0]))
    written = np.any(k_ref != before, axis=-1)
    assert 0 < written.sum() < batch * q_len * heads  # some positions fall outside the table
    check(k_out[written], k_ref[written], dtype)
    np.testing.assert_array_equal(k_out[~written], before[~written])
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))


def _qkv_projection(rng, batch: int, q_len: int, group: int, head_dim: int, dtype, normed: bool):
    """A random fused q|k|v projection [batch, q_len, (Hq + 2 Hkv) * D] (2 KV heads), the q and k
    norm weights (None unless ``normed``), and the kernels' static arguments."""
    kv_heads = 2
    heads = kv_heads * group
    qkv = jnp.asarray(3 * rng.standard_normal((batch, q_len, (heads + 2 * kv_heads) * head_dim)), dtype)
    q_w, k_w = (jnp.asarray(rng.uniform(0.5, 1.5, head_dim), dtype) if normed else None for _ in range(2))
    return qkv, q_w, k_w, dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6)


# (dtype, GQA group, head_dim, page size, tokens per sequence, RoPE)
QKV_CASES = [("f32", 1, 64, 16, 6, "default"), ("bf16", 4, 128, 32, 5, "llama3-nonorm"),
             ("f32", 8, 64, 32, 1, "yarn-half"), ("bf16", 8, 128, 16, 16, "quarter-nonorm"),
             ("bf16", 4, 64, 32, 3, "default"), ("f32", 4, 128, 16, 2, "yarn-half"),
             ("f32", 2, 64, 16, 4, "quarter-nonorm")]


@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: "-".join(map(str, c)))
def test_qkv_norm_rope_write(case, interpret, check):
    """q out, k and v into NaN-poisoned, permuted pages; dropped positions leave pages as they were."""
    dtype, group, head_dim, page_size, q_len, rope = case
    dtype = DTYPES[dtype]
    rng = _rng("qkv_write", case)
    lens = [page_size + 3, 2 * page_size, 1]  # ragged, an exact page multiple, a fresh prompt
    qkv, q_w, k_w, kw = _qkv_projection(rng, len(lens), q_len, group, head_dim, dtype, ROPES[rope][2])
    pages_per_seq = -(-(max(lens) + q_len) // page_size) + 1
    k_pages, v_pages, table = make_cache(rng, lens, pages_per_seq=pages_per_seq, page_size=page_size,
                                         kv_heads=kw["num_kv_heads"], head_dim=head_dim, dtype=dtype,
                                         spare=2 * pages_per_seq)
    table = np.array(table)
    for b, n in enumerate(lens):  # pages for the new tokens, from the free (NaN) ones
        # sequence 0's whole row holds real pages, so a write past its table could only be
        # dropped by the kernel's bound, not land on an out-of-range id by luck
        need = pages_per_seq if b == 0 else -(-(n + q_len) // page_size)
        free = sorted(set(range(k_pages.shape[0])) - set(table.ravel()))
        for p in range(-(-n // page_size), need):
            table[b, p] = free.pop(rng.integers(len(free)))
    positions = np.asarray(lens)[:, None] + np.arange(q_len)[None, :]
    positions[0, -1] = pages_per_seq * page_size  # past the page table: dropped
    cos, sin, _ = _rope_tables(rope, positions, head_dim, dtype)
    args = (qkv, q_w, k_w, cos, sin, jnp.asarray(positions, jnp.int32), k_pages, v_pages, jnp.asarray(table))
    outs = pk_gpu.qkv_norm_rope_write(*args, interpret=interpret, **kw)
    refs = _reference(pk.qkv_norm_rope_write_reference, *args, **kw)
    check(outs[0], refs[0], dtype)
    for out, ref in zip(outs[1:], refs[1:]):  # pages: NaN exactly where the reference has NaN
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        written = ~np.isnan(ref)
        check(out[written], ref[written], dtype)


# (dtype, GQA group, head_dim, tokens per sequence, rows per program, RoPE)
QKV_BLOCK_CASES = [("f32", 1, 64, 6, None, "default"), ("bf16", 4, 128, 16, None, "yarn-half"),
                   ("f32", 8, 64, 1, 16, "llama3-nonorm"), ("bf16", 2, 128, 5, 8, "quarter-nonorm"),
                   ("bf16", 8, 64, 3, None, "default"), ("f32", 4, 128, 16, None, "quarter-nonorm"),
                   ("f32", 2, 64, 4, None, "yarn-half")]


@pytest.mark.parametrize("case", QKV_BLOCK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_qkv_norm_rope(case, interpret, check):
    """The draft block's q, k (normed, rotated) and v straight from the fused projection."""
    dtype, group, head_dim, q_len, block_rows, rope = case
    dtype = DTYPES[dtype]
    rng = _rng("qkv_block", case)
    batch = 3
    qkv, q_w, k_w, kw = _qkv_projection(rng, batch, q_len, group, head_dim, dtype, ROPES[rope][2])
    positions = rng.integers(0, 40_000, (batch, q_len))
    cos, sin, _ = _rope_tables(rope, positions, head_dim, dtype)
    outs = pk_gpu.qkv_norm_rope(qkv, q_w, k_w, cos, sin, interpret=interpret, block_rows=block_rows, **kw)
    refs = _reference(pk.qkv_norm_rope_reference, qkv, q_w, k_w, cos, sin, **kw)
    for out, ref in zip(outs[:2], refs[:2], strict=True):
        check(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(outs[2], np.float32), np.asarray(refs[2], np.float32))


# --------------------------------------------------------------------------------------------
# routed_experts: a MoE layer's routed SwiGLU experts, reading only the routed experts' tiles.

# (dtype, tokens, top_k, experts, hidden, expert width, block_m, routing)
EXPERT_CASES = [("f32", 1, 2, 8, 64, 32, 16, "random"), ("bf16", 1, 8, 128, 64, 16, 16, "random"),
                ("f32", 5, 3, 6, 32, 48, 16, "random"), ("bf16", 17, 2, 4, 64, 16, 16, "one-expert"),
                ("f32", 16, 8, 16, 64, 32, 32, "random"), ("bf16", 33, 4, 8, 128, 64, 16, "skewed"),
                ("f16", 3, 2, 4, 32, 32, 16, "random")]


def _routing(rng, tokens: int, top_k: int, experts: int, kind: str) -> np.ndarray:
    """Distinct experts per token: uniform; all tokens on the same experts (one expert spans many
    tiles); or most tokens on a few experts and the rest spread (ragged groups)."""
    if kind == "one-expert":
        return np.tile(np.arange(top_k), (tokens, 1))
    hot = rng.permutation(experts)[:top_k + 1]
    rows = [rng.permutation(hot)[:top_k] if kind == "skewed" and rng.random() < 0.7 else rng.permutation(experts)[:top_k]
            for _ in range(tokens)]
    return np.stack(rows)


def _expert_inputs(rng, case, gate_up_std: float = 0.1):
    """x [N, H], routing experts and weights [N, k], gate_up [E, H, 2I] and down [E, I, H] of an
    EXPERT_CASES case, in its dtype."""
    dtype, tokens, top_k, num_experts, hidden, width, _, routing = case
    dtype = DTYPES[dtype]
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    experts = jnp.asarray(_routing(rng, tokens, top_k, num_experts, routing), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (tokens, top_k)), dtype)
    gate_up = jnp.asarray(gate_up_std * rng.standard_normal((num_experts, hidden, 2 * width)), dtype)
    down = jnp.asarray(0.1 * rng.standard_normal((num_experts, width, hidden)), dtype)
    return x, experts, weights, gate_up, down


@pytest.mark.parametrize("tuning", [{}, {"split_k": 3, "block_k": 16}], ids=["one-share", "three-shares"])
@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_routed_experts(case, tuning, interpret, check):
    """The rule's reduction shares (dense weights: one, the SwiGLU in the kernel) and three of
    16-dim steps, summed after the kernels (ragged: 4 steps as 1 + 1 + 2, 2 steps as 2 shares)."""
    dtype, block_m = DTYPES[case[0]], case[6]
    x, experts, weights, gate_up, down = _expert_inputs(_rng("experts", case), case)
    out = pk_gpu.routed_experts(x, experts, weights, gate_up, down, interpret=interpret, block_m=block_m, **tuning)
    check(out, _reference(pk.routed_experts_reference, x, experts, weights, gate_up, down), dtype)


@pytest.mark.parametrize("case", [c for c in EXPERT_CASES if c[0] != "f16"][:4] + [EXPERT_CASES[5]],
                         ids=lambda c: "-".join(map(str, c)))
def test_routed_experts_with_biases_and_clamped_swiglu(case, interpret, check):
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU, with values large
    enough that the clamp at 7 cuts some; the reference against the formula written out per pair."""
    dtype, tokens, top_k, num_experts, hidden, width, block_m, _ = case
    dtype = DTYPES[dtype]
    rng = _rng("experts-gpt-oss", case)
    x, experts, weights, gate_up, down = _expert_inputs(rng, case, gate_up_std=1.0)
    gate_up_bias = jnp.asarray(rng.normal(0, 2, (num_experts, 2 * width)), dtype)
    down_bias = jnp.asarray(rng.normal(0, 1, (num_experts, hidden)), dtype)
    kw = dict(swiglu_limit=7.0, swiglu_alpha=1.702)
    args = (x, experts, weights, gate_up, down, gate_up_bias, down_bias)
    out = pk_gpu.routed_experts(*args, interpret=interpret, block_m=block_m, **kw)
    ref = _reference(pk.routed_experts_reference, *args, **kw)
    check(out, ref, dtype)
    if dtype == jnp.float32:
        xs, gu, dn = (np.asarray(a, np.float64) for a in (x, gate_up, down))
        expected = np.zeros((tokens, hidden))
        for n in range(tokens):
            for j in range(top_k):
                e = int(experts[n, j])
                h = xs[n] @ gu[e] + np.asarray(gate_up_bias[e], np.float64)
                gate, up = np.minimum(h[:width], 7.0), np.clip(h[width:], -7.0, 7.0)
                a = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
                expected[n] += float(weights[n, j]) * (a @ dn[e] + np.asarray(down_bias[e], np.float64))
        np.testing.assert_allclose(np.asarray(ref, np.float64), expected, rtol=1e-4, atol=1e-4)
        assert np.abs(np.asarray(x) @ np.asarray(gate_up)).max() > 7  # the clamp cut something


@pytest.mark.parametrize("case", [c for c in EXPERT_CASES if c[0] != "f16"], ids=lambda c: "-".join(map(str, c)))
def test_routed_experts_skip_the_pairs_of_expert_minus_one(case, interpret, check):
    """Pairs marked -1 (under expert parallelism, routed to another device's experts) add nothing:
    the kernel equals the reference, and both equal the same routing with those pairs' weights 0;
    a call whose pairs are all -1 gives zeros."""
    dtype, tokens, top_k, num_experts, hidden, width, block_m, routing = case
    dtype = DTYPES[dtype]
    rng = _rng("experts-skip", case)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    routed = _routing(rng, tokens, top_k, num_experts, routing)
    skipped = rng.random(routed.shape) < 0.5
    experts = jnp.asarray(np.where(skipped, -1, routed), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (tokens, top_k)), dtype)
    gate_up = jnp.asarray(0.1 * rng.standard_normal((num_experts, hidden, 2 * width)), dtype)
    down = jnp.asarray(0.1 * rng.standard_normal((num_experts, width, hidden)), dtype)
    zero_weighted = pk.routed_experts_reference(x, jnp.asarray(routed, jnp.int32),
                                                jnp.where(jnp.asarray(skipped), 0, weights).astype(dtype), gate_up, down)
    reference = pk.routed_experts_reference(x, experts, weights, gate_up, down)
    # (bit-equal on a CPU; a GPU's grouped matmul sums groups of other sizes in another order)
    check(reference, zero_weighted, dtype)
    out = pk_gpu.routed_experts(x, experts, weights, gate_up, down, interpret=interpret, block_m=block_m)
    check(out, _reference(pk.routed_experts_reference, x, experts, weights, gate_up, down), dtype)
    none = pk_gpu.routed_experts(x, jnp.full_like(experts, -1), weights, gate_up, down, interpret=interpret,
                                 block_m=block_m)
    np.testing.assert_array_equal(np.asarray(none, np.float32), 0)


# MXFP4 expert weights (gpt-oss): (dtype, tokens, top_k, experts, hidden, expert width, block_m,
# routing, which weights are MXFP4, variant, tuning); the variant adds gpt-oss's biases and
# clamped SwiGLU, or marks about half the pairs -1. Hidden 96 and expert width 32 take one scale
# group per step, the others two or four (or one, by block_k). One token's block_k 32: the rule's
# 4 gate|up and 2 down shares (the down bias added once), or one share (gated in the kernel).
# One token's MXFP4 products are summed elementwise (gemv) unless the tuning says otherwise.
MXFP4_CASES = [("f32", 1, 2, 8, 64, 32, 16, "random", "both", "plain", {}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "both", "gpt-oss", {}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "both", "gpt-oss", {"block_k": 32}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "both", "gpt-oss", {"block_k": 32, "split_k": 1}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "both", "skip", {"gemv": False}),
               ("f32", 1, 3, 8, 96, 64, 16, "random", "gate_up", "gpt-oss", {"block_k": 32, "gemv": True}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "both", "skip", {}),
               ("bf16", 1, 4, 32, 128, 64, 16, "random", "down", "skip", {"split_k": 2, "block_k": 32}),
               ("bf16", 3, 4, 8, 256, 96, 16, "random", "both", "skip", {"split_k": 3, "block_k": 32}),
               ("f32", 17, 2, 4, 64, 32, 16, "one-expert", "gate_up", "plain", {}),
               ("bf16", 33, 4, 8, 128, 64, 32, "skewed", "both", "skip", {"block_k": 32}),
               ("f32", 16, 8, 16, 96, 64, 64, "random", "down", "gpt-oss", {}),
               ("bf16", 5, 3, 6, 96, 32, 16, "random", "both", "skip", {}),
               ("f32", 40, 4, 8, 128, 64, 16, "skewed", "both", "gpt-oss", {"block_n": 32, "block_k": 64}),
               ("bf16", 17, 2, 4, 64, 32, 16, "one-expert", "down", "plain", {})]


def _mxfp4(rng, num_experts: int, k: int, n: int) -> pk.Mxfp4Weight:
    """A random MXFP4 weight [E, K, N]: any codes, scales 2^-9 .. 2^-1 (values within +-3)."""
    return pk.Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (num_experts, k // 2, n), dtype=np.uint8)),
                          jnp.asarray(rng.integers(118, 127, (num_experts, k // 32, n), dtype=np.uint8)))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_dequantize_mxfp4_matches_the_checkpoint_decoder(dtype):
    """The checkpoint's [E, N, K/32, 16] / [E, N, K/32] bytes, laid out as the kernels read them,
    decode to dflash_jax.loading.mxfp4's values bit for bit over every code and every scale in [2, 254]
    (up to 6 * 2^127, which overflows to inf in both)."""
    from dflash_jax.loading import mxfp4
    rng = _rng("mxfp4-dequantize", dtype)
    num_experts, n, k = 3, 40, 256
    blocks = rng.integers(0, 256, (num_experts, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(2, 255, (num_experts, n, k // 32), dtype=np.uint8)
    scales[0, 0, :2] = 2, 254
    with np.errstate(over="ignore"):
        expected = jnp.asarray(mxfp4.dequantize_pair(blocks, scales), DTYPES[dtype])
    w = pk.Mxfp4Weight(jnp.asarray(blocks.reshape(num_experts, n, k // 2).transpose(0, 2, 1)),
                       jnp.asarray(scales.transpose(0, 2, 1)))
    assert w.shape == (num_experts, k, n)
    out = jax.jit(pk.dequantize_mxfp4, static_argnums=1)(w, DTYPES[dtype])
    assert out.dtype == DTYPES[dtype] and out.shape == expected.shape
    bits = {"f32": np.uint32, "bf16": np.uint16}[dtype]
    np.testing.assert_array_equal(np.asarray(out).view(bits), np.asarray(expected).view(bits))
    assert np.isinf(np.asarray(out, np.float32)).any() and (np.asarray(out, np.float32) == 0).any()


@pytest.mark.parametrize("case", MXFP4_CASES,
                         ids=lambda c: "-".join([*map(str, c[:10]), *(f"{k}{v}" for k, v in c[10].items())]))
def test_routed_experts_mxfp4(case, interpret, check):
    """MXFP4 weights decoded in the kernels' weight loads: the kernel equals the reference, which
    dequantises them first; pairs of expert -1 add nothing, and a call of only such pairs gives 0."""
    dtype, tokens, top_k, num_experts, hidden, width, block_m, routing, which, variant, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("experts-mxfp4", case[:10])
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    experts = _routing(rng, tokens, top_k, num_experts, routing)
    if variant == "skip":
        experts = np.where(rng.random(experts.shape) < 0.5, -1, experts)
    experts = jnp.asarray(experts, jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (tokens, top_k)), dtype)
    gate_up, down = _mxfp4(rng, num_experts, hidden, 2 * width), _mxfp4(rng, num_experts, width, hidden)
    if which == "down":
        gate_up = pk.dequantize_mxfp4(gate_up, dtype)
    if which == "gate_up":
        down = pk.dequantize_mxfp4(down, dtype)
    args, kw = (x, experts, weights, gate_up, down), {}
    if variant == "gpt-oss":
        args += (jnp.asarray(rng.normal(0, 2, (num_experts, 2 * width)), dtype),
                 jnp.asarray(rng.normal(0, 1, (num_experts, hidden)), dtype))
        kw = dict(swiglu_limit=7.0, swiglu_alpha=1.702)
    out = pk_gpu.routed_experts(*args, interpret=interpret, block_m=block_m, **tuning, **kw)
    check(out, _reference(pk.routed_experts_reference, *args, **kw), dtype)
    if variant == "skip":
        none = pk_gpu.routed_experts(x, jnp.full_like(experts, -1), *args[2:], interpret=interpret, block_m=block_m,
                                     **tuning)
        np.testing.assert_array_equal(np.asarray(none, np.float32), 0)


def test_reduction_splits_fill_the_sms_for_mxfp4_decode_only():
    """gpt-oss-20b's gate|up at one token (4 experts x 45 column blocks, 45 steps): 5 shares, 900
    programs for 132 SMs; 8 tokens (~21 experts): 1; dense weights: always 1; never more shares
    than steps."""
    from pallas_kernels.gpu.routed_experts import reduction_splits
    assert reduction_splits(4, 32, 45, 45, 132, mxfp4=True) == 5
    assert reduction_splits(32, 32, 45, 45, 132, mxfp4=True) == 1
    assert reduction_splits(4, 32, 45, 45, 132, mxfp4=False) == 1
    assert reduction_splits(1, 8, 1, 3, 132, mxfp4=True) == 3


def test_mxfp4_reference_tells_the_nibbles_and_the_scales_apart():
    """The MXFP4 checks can fail: with the nibbles of each byte swapped, or the scales of every other
    group doubled, the reference's output moves far beyond the tests' tolerance."""
    rng = _rng("mxfp4-mutations")
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    experts = jnp.asarray(_routing(rng, 4, 2, 4, "random"), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (4, 2)), jnp.float32)
    gate_up, down = _mxfp4(rng, 4, 64, 64), _mxfp4(rng, 4, 32, 64)
    odd_groups = jnp.arange(gate_up.scales.shape[1])[None, :, None] % 2 == 1
    mutants = {"swapped nibbles": gate_up._replace(blocks=(gate_up.blocks >> 4) | (gate_up.blocks << 4)),
               "scales off by one": gate_up._replace(scales=gate_up.scales + odd_groups.astype(jnp.uint8))}
    ref = np.asarray(pk.routed_experts_reference(x, experts, weights, gate_up, down), np.float64)
    for name, mutant in mutants.items():
        out = np.asarray(pk.routed_experts_reference(x, experts, weights, mutant, down), np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) > 0.1, name


@pytest.mark.parametrize("counting", [True, False], ids=["counted", "sorted"])
def test_expert_tiles_hold_each_pair_once_in_its_experts_tiles(counting, monkeypatch):
    """Every pair in exactly one row, each expert's pairs in token order in tiles of that expert
    alone, padding -1, tiles past the last expert's marked -1 (they stream nothing): the same
    layout whether the ranks are counted (short inputs) or sorted (long prefills)."""
    from pallas_kernels import routed_experts  # where expert_tiles reads COUNTING_LIMIT
    monkeypatch.setattr(routed_experts, "COUNTING_LIMIT", 1 << 30 if counting else 0)
    rng = _rng("tiles")
    experts = jnp.asarray(_routing(rng, 37, 4, 10, "skewed"), jnp.int32)
    rows, tile_expert = (np.asarray(a) for a in routed_experts.expert_tiles(experts, 10, 16))
    assert sorted(rows[rows >= 0].tolist()) == list(range(37 * 4))
    flat = np.asarray(experts).reshape(-1)
    for tile, expert in enumerate(tile_expert):
        held = rows[tile * 16:(tile + 1) * 16]
        if expert < 0:
            assert (held < 0).all()
        else:
            assert (flat[held[held >= 0]] == expert).all() and (held >= 0).any()
    for expert in range(10):  # token order within an expert
        pairs = rows[np.isin(np.arange(len(rows)) // 16, np.flatnonzero(tile_expert == expert))]
        assert pairs[pairs >= 0].tolist() == np.flatnonzero(flat == expert).tolist()
    assert len(tile_expert) == -(-37 * 4 // 16) + 10


@pytest.mark.parametrize("counting", [True, False], ids=["counted", "sorted"])
def test_expert_tiles_leave_out_the_pairs_of_expert_minus_one(counting, monkeypatch):
    """Pairs of expert -1 are in no row; the others are laid out as without them (each expert's
    pairs in token order, in tiles of that expert alone), counted or sorted alike."""
    from pallas_kernels import routed_experts
    monkeypatch.setattr(routed_experts, "COUNTING_LIMIT", 1 << 30 if counting else 0)
    rng = _rng("tiles-skip")
    routed = _routing(rng, 37, 4, 10, "skewed")
    flat = np.where(rng.random(routed.shape) < 0.4, -1, routed).reshape(-1)
    rows, tile_expert = (np.asarray(a) for a in routed_experts.expert_tiles(jnp.asarray(flat.reshape(37, 4)), 10, 16))
    assert sorted(rows[rows >= 0].tolist()) == np.flatnonzero(flat >= 0).tolist()
    for expert in range(10):
        pairs = rows[np.isin(np.arange(len(rows)) // 16, np.flatnonzero(tile_expert == expert))]
        assert pairs[pairs >= 0].tolist() == np.flatnonzero(flat == expert).tolist()



@pytest.mark.parametrize("tuning", [{"num_splits": 1}, {"block_k": 16}], ids=["one-launch", "four-shares"])
def test_route_breaks_ties_to_the_lower_expert_as_top_k_does(interpret, tuning):
    """Experts with equal router columns tie exactly: the kernel lists them in lax.top_k's order
    (the lower id first), as the reference does, weights equal."""
    rng = _rng("route-ties")
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    router = jnp.asarray(np.repeat(rng.standard_normal((64, 8)) / 8, 2, axis=1), jnp.float32)  # e and e ^ 1 tie
    kw = dict(top_k=6, norm_topk_prob=True, eps=1e-6)
    _, experts, weights = pk_gpu.route(x, jnp.ones(64), router, interpret=interpret, **kw, **tuning)
    _, ref_experts, ref_weights = pk.route_reference(x, jnp.ones(64), router, **kw)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(ref_experts))
    assert (np.asarray(experts)[:, ::2] % 2 == 0).all()  # each tied pair, lower id first
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6)


def test_token_tiles_give_each_pair_of_one_token_its_own_tile():
    """One token's k pairs: tile j holds pair j in its first row and nothing else, its expert the
    pair's (-1 tiles between used ones); more than one token is refused."""
    from pallas_kernels.routed_experts import token_tiles
    rows, tile_expert = (np.asarray(a) for a in token_tiles(jnp.asarray([[5, -1, 0, 7]], jnp.int32), 16))
    assert tile_expert.tolist() == [5, -1, 0, 7] and rows.shape == (64,)
    assert rows[::16].tolist() == [0, 1, 2, 3] and (np.delete(rows, np.arange(0, 64, 16)) == -1).all()
    with pytest.raises(ValueError, match="one token"):
        token_tiles(jnp.zeros((2, 4), jnp.int32), 16)


# MoE routing (norm, router, softmax, top k): (dtype, tokens, hidden, experts, top_k, router bias,
# renormalised, skew: None for the router's top k, else hashed independent draws, tuning). By
# default the router is split into shares (two launches); num_splits 1 is the one launch.
ROUTE_CASES = [("f32", 1, 64, 16, 4, False, True, None, {"num_splits": 1}),
               ("bf16", 1, 128, 128, 8, False, True, None, {}),
               ("f32", 37, 96, 12, 3, True, False, None, {}),
               ("bf16", 20, 64, 32, 4, True, True, None, {"num_splits": 1}),
               ("f32", 16, 64, 256, 8, False, True, None, {}),
               ("bf16", 5, 64, 32, 8, False, True, 0.0, {"num_splits": 1}),
               ("f32", 19, 96, 20, 4, True, False, 1.0, {}),
               ("f16", 3, 32, 8, 2, False, True, None, {"num_splits": 1}),
               ("f16", 9, 128, 24, 3, True, True, None, {"block_k": 32}),
               ("bf16", 1, 2048, 128, 8, False, True, 0.0, {}),  # Qwen3-30B-A3B's decode: 32 shares
               ("f32", 37, 96, 12, 3, True, False, None, {"num_splits": 1}),
               ("bf16", 33, 256, 64, 6, True, True, 1.0, {"block_k": 16, "num_splits": 4})]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(map(str, c[:8])) + (f"-{c[8]}" if c[8] else ""))
def test_route(case, interpret, check):
    """The kernel's h equals the reference's; its weights are the reference's softmax at its own
    experts; in f32 the experts are the reference's, in 16-bit floats (where an ulp of a logit can
    reorder near-ties) they carry the reference's top-k mass within the tolerance; drawn
    independently, they are the draw from the kernel's own h, exactly."""
    dtype, tokens, hidden, num_experts, top_k, has_bias, norm, skew, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("route", case[:8])
    x = jnp.asarray(3 * rng.standard_normal((tokens, hidden)), dtype)
    norm_weight = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    router = jnp.asarray(rng.standard_normal((hidden, num_experts)) / np.sqrt(hidden), dtype)
    bias = jnp.asarray(0.3 * rng.standard_normal(num_experts), dtype) if has_bias else None
    kw = dict(top_k=top_k, norm_topk_prob=norm, eps=1e-6, skew=skew)
    h, experts, weights = pk_gpu.route(x, norm_weight, router, bias, interpret=interpret, **kw, **tuning)
    ref_h, ref_experts, ref_weights = pk.route_reference(x, norm_weight, router, bias, **kw)
    assert experts.shape == weights.shape == (tokens, top_k) and experts.dtype == jnp.int32
    assert h.dtype == weights.dtype == dtype
    check(h, ref_h, dtype)
    logits = np.asarray(ref_h, np.float64) @ np.asarray(router, np.float64)
    if has_bias:
        logits = logits + np.asarray(bias, np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    experts = np.asarray(experts)
    assert all(len(set(row)) == top_k for row in experts.tolist()) and ((experts >= 0) & (experts < num_experts)).all()
    chosen = np.take_along_axis(probs, experts, axis=1)
    expected = chosen / chosen.sum(axis=1, keepdims=True) if norm else chosen
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(weights, np.float64), expected, rtol=tol, atol=tol)
    if skew is not None:
        from pallas_kernels.routing import independent_experts
        np.testing.assert_array_equal(experts, np.asarray(independent_experts(h, num_experts, top_k, skew)))
    elif dtype == jnp.float32:
        np.testing.assert_array_equal(experts, np.asarray(ref_experts))
    else:
        best = np.take_along_axis(probs, np.asarray(ref_experts), axis=1).sum(axis=1)
        assert (chosen.sum(axis=1) >= best - tol).all()


def test_route_splits_cover_the_sms_and_bad_tilings_are_refused():
    from pallas_kernels.gpu.routing import route_splits
    assert route_splits(1, 16, 132) == 16    # Qwen3-30B-A3B's decode: each router step its own program
    assert route_splits(16, 45, 132) == 45   # gpt-oss-20b's 8-token verify (2880 / 64)
    assert route_splits(512, 16, 132) == 4   # a prefill's 32 row programs
    assert route_splits(640, 45, 132) == 3   # 40 row programs: 3 divides 45
    assert route_splits(33, 45, 132) == 15   # 44 wanted: the largest divisor of 45 below
    assert route_splits(4096, 16, 132) == 1
    x, norm_weight, router = S((1, 2048), BF), S((2048,), BF), S((2048, 128), BF)
    kw = dict(top_k=8, norm_topk_prob=True, eps=1e-6)
    for num_splits in (3, 0, -1, 32):
        with pytest.raises(ValueError, match=f"num_splits must divide the 16 steps of block_k 128.*got {num_splits}"):
            jax.eval_shape(functools.partial(pk_gpu.route, **kw, block_k=128, num_splits=num_splits), x, norm_weight,
                           router)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        jax.eval_shape(functools.partial(pk_gpu.route, **kw, block_k=48), x, norm_weight, router)

# --------------------------------------------------------------------------------------------
# fused_matmul: [RMSNorm] -> x @ w -> [SwiGLU] -> [+ residual] for decode/verify-sized row counts.

# (dtype, leading shape of x, K, output columns N, norm, gated, residual, tuning)
MATMUL_CASES = [
    ("f32", (1,), 256, 96, True, False, False, {}),
    ("bf16", (1, 1), 512, 192, True, False, False, {}),
    ("bf16", (2, 5), 256, 64, True, True, True, {}),
    ("f32", (3, 4), 256, 80, False, False, True, {"num_splits": 2}),
    ("bf16", (17,), 512, 100, True, True, True, {"num_splits": 2}),
    ("bf16", (2, 16), 1024, 128, False, False, True, {"block_n": 32, "block_k": 128}),
    ("f16", (70,), 256, 64, True, False, True, {}),
    ("bf16", (4, 16), 256, 48, False, True, False, {"num_splits": 1, "block_n": 16}),
    ("f32", (2, 16), 256, 96, True, True, True, {}),
    # K that the 256-deep tiles (128 in f32) do not divide: the last tile masked
    ("bf16", (1,), 320, 96, True, False, False, {}),
    ("f32", (3,), 208, 48, True, True, True, {}),
    ("bf16", (5,), 336, 64, True, False, True, {"num_splits": 2}),
    ("bf16", (2,), 80, 40, False, False, False, {"block_k": 32}),
]


@pytest.mark.parametrize("case", MATMUL_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_fused_matmul(case, interpret, check):
    """Ragged row counts (1, 5, 17, 70 rows), columns that do not fill a tile, split K, K that
    the tiles do not divide."""
    dtype, lead, k, n, norm, gated, residual, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("fused_matmul", case)
    x = jnp.asarray(3 * rng.standard_normal((*lead, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, 2 * n if gated else n)) / np.sqrt(k), dtype)
    kw = dict(norm_weight=jnp.asarray(rng.uniform(0.5, 1.5, k), dtype) if norm else None, gated=gated,
              residual=jnp.asarray(rng.standard_normal((*lead, n)), dtype) if residual else None)
    out = pk_gpu.fused_matmul(x, w, interpret=interpret, **kw, **tuning)
    ref = _reference(lambda x, w, norm_weight, residual: pk.fused_matmul_reference(
        x, w, norm_weight=norm_weight, residual=residual, gated=gated), x, w, kw["norm_weight"],
        kw["residual"])
    assert out.dtype == dtype
    check(out, ref, dtype)


# --------------------------------------------------------------------------------------------
# combine_splits: the log-sum-exp merge of a split context (the attention tests above run it
# inside the kernels; here it meets its reference alone, with splits that saw nothing).

MERGE_CASES = [
    ("bf16", 16, (1, 16, 8, 4), 128, {}),  # Qwen3-8B verify at bs 1: 16 splits
    ("bf16", 2, (3, 16, 8, 4), 128, {}),
    ("f32", 3, (2, 5, 3, 2), 64, {}),  # a split count and row count that are not powers of two
    ("f16", 5, (7,), 16, {"block_rows": 4, "num_warps": 2}),
    ("bf16", 1, (2, 3), 128, {"block_rows": 1}),
    ("f32", 64, (1, 1, 2, 8), 128, {}),
]


@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_combine_splits(case, interpret, check):
    """A third of the (split, row) partials saw no key (lse -inf, rows zero, as the attention
    kernels write them) and the first row was seen by no split (it must come out as zeros).
    A missing row mask would not show here: interpret mode clamps reads and drops writes outside
    the arrays."""
    dtype, splits, lead, head_dim, tuning = case
    dtype = DTYPES[dtype]
    rng = _rng("combine_splits", case)
    lse = 8 * rng.standard_normal((splits, *lead)).astype(np.float32)
    lse[rng.random(lse.shape) < 1 / 3] = -np.inf
    lse.reshape(splits, -1)[:, 0] = -np.inf
    o = rng.standard_normal((splits, *lead, head_dim)) * np.isfinite(lse)[..., None]
    o, lse = jnp.asarray(o, dtype), jnp.asarray(lse)
    out = pk_gpu.combine_splits(o, lse, interpret=interpret, **tuning)
    ref = _reference(pk.combine_splits_reference, o, lse)
    assert out.dtype == dtype and not np.asarray(out).reshape(-1, head_dim)[0].any()
    check(out, ref, dtype)


def test_combine_splits_at_extreme_log_sum_exps(interpret, check):
    """The merge weighs each split by 2^(lse - the row's largest lse): split log-sum-exps of 200
    (2^200 overflows float32) or -300 (2^-300 underflows) still give the weighted mean, 5/3
    for weights 1 and 1/2 on values 1 and 3, not NaN or zeros."""
    o = jnp.broadcast_to(jnp.asarray([1.0, 3.0])[:, None, None], (2, 4, 16))
    for top in (200.0, -300.0):
        lse = jnp.broadcast_to(jnp.asarray([top, top - 1.0])[:, None], (2, 4))
        out = pk_gpu.combine_splits(o, lse, interpret=interpret)
        check(out, jnp.full((4, 16), 5 / 3), jnp.float32)


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


def _write_shapes(batch=2, q_len=16, kv_heads=8, head_dim=128, rotary_dim=None):
    """norm_rope_write's arguments less the norm weight: k, v, cos, sin, positions, pages, table."""
    kv = S((batch, q_len, kv_heads, head_dim), BF)
    pages = S((200, 16, kv_heads, head_dim), BF)
    table = S((batch, q_len, (rotary_dim or head_dim) // 2), BF)
    return (kv, kv, table, table, S((batch, q_len), jnp.int32), pages, pages, S((batch, 64), jnp.int32))


def _mxfp4_shapes(num_experts: int, k: int, n: int, dtype=jnp.uint8) -> pk.Mxfp4Weight:
    """An MXFP4 expert weight of logical shape [E, K, N], as shapes."""
    return pk.Mxfp4Weight(S((num_experts, k // 2, n), dtype), S((num_experts, k // 32, n), dtype))


def _without_norms(kernel, **static):
    """``kernel`` with its norm weight(s) None (LLaMA's q and k are not normed)."""
    if kernel is pk_gpu.norm_rope_write:
        return lambda k, v, *rest: kernel(k, v, None, *rest, **static)
    return lambda qkv, *rest: kernel(qkv, None, None, *rest, **static)


LOWERINGS = {
    "decode": (pk_gpu.paged_verify_attention, _attention_shapes(q_len=1), {}),
    "verify_window": (pk_gpu.paged_verify_attention, _attention_shapes(), {"sliding_window": 64}),
    "verify_one_split": (pk_gpu.paged_verify_attention, _attention_shapes(batch=32), {}),
    "prefill": (pk_gpu.paged_verify_attention, _attention_shapes(batch=1, q_len=1000), {}),
    "verify_f32": (pk_gpu.paged_verify_attention, _attention_shapes(dtype=jnp.float32), {}),
    "verify_group_5": (pk_gpu.paged_verify_attention, _attention_shapes(q_heads=40), {}),
    "verify_sinks_window": (lambda q, k, v, t, s, sinks: pk_gpu.paged_verify_attention(q, k, v, t, s,
                                                                                       sliding_window=128, sinks=sinks),
                            (*_attention_shapes(q_heads=64, head_dim=64), S((64,), BF)), {}),
    "draft": (pk_gpu.paged_draft_attention, _draft_shapes(), {}),
    "draft_causal_window": (pk_gpu.paged_draft_attention, _draft_shapes(batch=32),
                            {"causal": True, "sliding_window": 32}),
    "draft_f32_two_sided_window": (pk_gpu.paged_draft_attention, _draft_shapes(dtype=jnp.float32),
                                   {"sliding_window": 8}),
    "draft_block_24": (pk_gpu.paged_draft_attention, _draft_shapes(block=24), {}),
    "draft_sinks": (lambda q, k, v, t, c, bk, bv, bl, sinks: pk_gpu.paged_draft_attention(q, k, v, t, c, bk, bv, bl,
                                                                                          sinks=sinks),
                    (*_draft_shapes(), S((32,), BF)), {}),
    "verify_f16_head_dim_64_page_32": (pk_gpu.paged_verify_attention,
                                       _attention_shapes(head_dim=64, page_size=32, dtype=jnp.float16), {}),
    "verify_tuned": (pk_gpu.paged_verify_attention, _attention_shapes(),
                     {"pages_per_block": 1, "block_t": 16, "num_splits": 2, "pallas_merge": True}),
    "norm_rope_write": (pk_gpu.norm_rope_write, (*_write_shapes()[:2], S((128,), BF), *_write_shapes()[2:]),
                        {"eps": 1e-6}),
    "norm_rope_write_unnormed_partial": (_without_norms(pk_gpu.norm_rope_write, eps=1e-6),
                                         _write_shapes(kv_heads=4, head_dim=256, rotary_dim=64), {}),
    "qkv_norm_rope_write": (pk_gpu.qkv_norm_rope_write,
                            (S((2, 16, 48 * 128), BF), S((128,), BF), S((128,), BF), *_write_shapes()[2:]),
                            {"num_heads": 32, "num_kv_heads": 8, "eps": 1e-6}),
    "qkv_norm_rope_write_unnormed": (_without_norms(pk_gpu.qkv_norm_rope_write, num_heads=32, num_kv_heads=8, eps=1e-6),
                                     (S((2, 16, 48 * 128), BF), *_write_shapes()[2:]), {}),
    "qkv_norm_rope": (pk_gpu.qkv_norm_rope, (S((2, 16, 48 * 128), BF), S((128,), BF), S((128,), BF),
                                             S((2, 16, 64), BF), S((2, 16, 64), BF)),
                      {"num_heads": 32, "num_kv_heads": 8, "eps": 1e-6}),
    "qkv_norm_rope_partial_head_dim_256": (pk_gpu.qkv_norm_rope,
                                           (S((2, 16, 32 * 256), BF), S((256,), BF), S((256,), BF),
                                            S((2, 16, 32), BF), S((2, 16, 32), BF)),
                                           {"num_heads": 24, "num_kv_heads": 4, "eps": 1e-6}),
    "routed_experts_decode": (pk_gpu.routed_experts, (S((1, 2048), BF), S((1, 8), jnp.int32), S((1, 8), BF),
                                                      S((128, 2048, 1536), BF), S((128, 768, 2048), BF)), {}),
    "routed_experts_verify_f32": (pk_gpu.routed_experts, (S((16, 256), jnp.float32), S((16, 4), jnp.int32),
                                                          S((16, 4), jnp.float32), S((8, 256, 128), jnp.float32),
                                                          S((8, 64, 256), jnp.float32)), {"block_m": 32}),
    "routed_experts_gpt_oss": (functools.partial(pk_gpu.routed_experts, swiglu_limit=7.0),
                               (S((4, 128), BF), S((4, 4), jnp.int32), S((4, 4), BF), S((32, 128, 256), BF),
                                S((32, 128, 128), BF), S((32, 256), BF), S((32, 128), BF)), {}),
    # gpt-oss-20b's experts in MXFP4: decode, and verify with only gate|up quantised
    "routed_experts_mxfp4_decode": (functools.partial(pk_gpu.routed_experts, swiglu_limit=7.0),
                                    (S((1, 2880), BF), S((1, 4), jnp.int32), S((1, 4), BF),
                                     _mxfp4_shapes(32, 2880, 5760), _mxfp4_shapes(32, 2880, 2880),
                                     S((32, 5760), BF), S((32, 2880), BF)), {}),
    "routed_experts_mxfp4_decode_tensor_cores": (functools.partial(pk_gpu.routed_experts, swiglu_limit=7.0,
                                                                   gemv=False),
                                                 (S((1, 2880), BF), S((1, 4), jnp.int32), S((1, 4), BF),
                                                  _mxfp4_shapes(32, 2880, 5760), _mxfp4_shapes(32, 2880, 2880),
                                                  S((32, 5760), BF), S((32, 2880), BF)), {}),
    "routed_experts_mxfp4_verify": (pk_gpu.routed_experts, (S((16, 2880), BF), S((16, 4), jnp.int32), S((16, 4), BF),
                                                            _mxfp4_shapes(32, 2880, 5760), S((32, 2880, 2880), BF)),
                                    {"block_m": 32}),
    "routed_experts_mxfp4_f32": (pk_gpu.routed_experts, (S((16, 256), jnp.float32), S((16, 4), jnp.int32),
                                                         S((16, 4), jnp.float32), _mxfp4_shapes(8, 256, 128),
                                                         _mxfp4_shapes(8, 64, 256)), {"block_k": 32}),
    "route_decode": (functools.partial(pk_gpu.route, top_k=8, norm_topk_prob=True, eps=1e-6),
                     (S((1, 2048), BF), S((2048,), BF), S((2048, 128), BF)), {}),
    "route_decode_one_launch": (functools.partial(pk_gpu.route, top_k=8, norm_topk_prob=True, eps=1e-6, num_splits=1),
                                (S((1, 2048), BF), S((2048,), BF), S((2048, 128), BF)), {}),
    "route_prefill_rows_drawn_in_shares": (functools.partial(pk_gpu.route, top_k=8, norm_topk_prob=True, eps=1e-6,
                                                             skew=0.0),
                                           (S((33, 2880), BF), S((2880,), BF), S((2880, 32), BF)), {}),
    "route_verify_256_experts_drawn": (functools.partial(pk_gpu.route, top_k=8, norm_topk_prob=True, eps=1e-6,
                                                         skew=1.0),
                                       (S((16, 2048), BF), S((2048,), BF), S((2048, 256), BF)), {}),
    "route_gpt_oss_f32": (functools.partial(pk_gpu.route, top_k=4, norm_topk_prob=True, eps=1e-5),
                          (S((8, 2880), jnp.float32), S((2880,), jnp.float32), S((2880, 32), jnp.float32),
                           S((32,), jnp.float32)), {}),
    "combine_splits": (pk_gpu.combine_splits, (S((16, 1, 16, 8, 4, 128), BF), S((16, 1, 16, 8, 4), jnp.float32)), {}),
    "fused_matmul_qkv": (lambda x, w, nw: pk_gpu.fused_matmul(x, w, norm_weight=nw),
                         (S((1, 1, 4096), BF), S((4096, 6144), BF), S((4096,), BF)), {}),
    "fused_matmul_qkv_gpt_oss_masked_k": (lambda x, w, nw: pk_gpu.fused_matmul(x, w, norm_weight=nw),
                                          (S((1, 1, 2880), BF), S((2880, 5120), BF), S((2880,), BF)), {}),
    "fused_matmul_gated_split": (lambda x, w, nw: pk_gpu.fused_matmul(x, w, norm_weight=nw, gated=True, num_splits=4),
                                 (S((2, 16, 4096), BF), S((4096, 2 * 1024), BF), S((4096,), BF)), {}),
    "fused_matmul_residual": (lambda x, w, r: pk_gpu.fused_matmul(x, w, residual=r),
                              (S((8, 1, 12288), BF), S((12288, 4096), BF), S((8, 1, 4096), BF)), {}),
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
    ("q head_dim must be a power of two >= 16, got 8", lambda: _attention_shapes(head_dim=8)),
    ("q heads", lambda: _attention_shapes(q_heads=20)),
    ("k_pages/v_pages dtype", lambda: (S((2, 16, 32, 128), jnp.float32), *_attention_shapes()[1:])),
    ("page_size", lambda: _attention_shapes(page_size=24)),
    ("page_table", lambda: (*_attention_shapes()[:3], S((2, 64), jnp.int64 if jax.config.x64_enabled
                                                         else jnp.int16), S((2,), jnp.int32))),
    ("start", lambda: (*_attention_shapes()[:4], S((3,), jnp.int32))),
]


@pytest.mark.parametrize("match,shapes", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_verify_rejects_bad_args(match, shapes):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(pk_gpu.paged_verify_attention, *shapes())


def test_attention_block_rule():
    """Qwen3-8B verify (16 tokens x GQA 4 = 64 rows): a batch filling every SM unsplit gets
    64-token tiles (two programs per SM); smaller batches, and the draft kernel with its block
    K/V in shared memory, keep 128-token tiles and split the context instead (on an H100/H200,
    whatever GPU runs the test; an A100 has no room for two programs per SM)."""
    shape = dict(q_len=16, group=4, head_dim=128, page_size=16, pages_per_seq=2048, kv_heads=8,
                 limits=pk_tuning.HOPPER)
    full = pk_tuning.attention_blocks(batch=32, **shape)
    assert (full.pages_per_block, full.num_splits, full.num_stages) == (4, 1, 3)
    small = pk_tuning.attention_blocks(batch=8, **shape)
    assert (small.pages_per_block, small.num_splits) == (8, 2)
    draft = pk_tuning.attention_blocks(batch=32, extra_smem_bytes=2 * 16 * 128 * 2, **shape)
    assert (draft.pages_per_block, draft.num_splits) == (8, 1)
    # two programs of 112 KB plus a 2 KB draft block would need 230 KB with CUDA's 1 KB each
    short_block = pk_tuning.attention_blocks(batch=32, extra_smem_bytes=2 * 4 * 128 * 2, **shape)
    assert short_block.pages_per_block == 8
    a100 = pk_tuning.attention_blocks(batch=32, **{**shape, "limits": pk_tuning.GpuLimits(108, 164 * 1024)})
    assert (a100.pages_per_block, a100.num_splits, a100.num_stages) == (8, 1, 2)


def test_split_merge_rule():
    """The Pallas merge takes many splits (bs 1 on a 32k table: 16; on a short one: 14) or many
    partial rows (bs 8: 2 splits of 4096 rows); XLA keeps the small merges it fuses with their
    neighbours (3 splits of 512 rows; decode: 32 rows) and there is none without a split."""
    shape = dict(q_len=16, group=4, head_dim=128, page_size=16, kv_heads=8, limits=pk_tuning.HOPPER)
    merge = lambda **kw: (lambda b: (b.num_splits, b.pallas_merge))(  # noqa: E731
        pk_tuning.attention_blocks(**{**shape, **kw}))
    assert merge(batch=1, pages_per_seq=2048) == (16, True)
    assert merge(batch=8, pages_per_seq=2048) == (2, True)
    assert merge(batch=1, pages_per_seq=56) == (14, True)
    assert merge(batch=1, pages_per_seq=56, num_splits=3) == (3, False)
    assert merge(batch=1, pages_per_seq=56, num_splits=3, q_len=1) == (3, False)
    assert merge(batch=1, pages_per_seq=2048, q_len=1) == (33, True)
    assert merge(batch=32, pages_per_seq=2048) == (1, False)
    assert merge(batch=1, pages_per_seq=56, num_splits=3, pallas_merge=True) == (3, True)


def test_tiling_decisions_at_the_rules_boundaries(monkeypatch):
    """Decisions of ``attention_blocks`` at the edges of its rules (each value is what it chose
    when it was measured; a change here is a change of tiling, to be measured again):
    query tiles counted rounded up (37 tokens: two tiles, 8 splits), KV tiles of a table that is
    not a whole number of them rounded up (9 pages: 3 splits), f32 at head_dim 256 on 64-row
    query tiles, a small GPU halving KV tiles only down to 64 tokens, three stages from 32 rows
    on, the Pallas merge from 8 splits on; and the draft kernel counting its block's K/V as the
    power-of-two tile it loads (65 tokens: 128)."""
    shape = dict(head_dim=128, page_size=16, kv_heads=8, limits=pk_tuning.HOPPER)
    blocks = lambda **kw: pk_tuning.attention_blocks(**{**shape, **kw})  # noqa: E731
    assert blocks(q_len=37, group=4, pages_per_seq=256, batch=1).num_splits == 8
    assert blocks(q_len=1, group=8, pages_per_seq=9, batch=1).num_splits == 3
    assert blocks(q_len=16, group=8, head_dim=256, pages_per_seq=64, batch=1, itemsize=4).block_t == 8
    small_gpu = pk_tuning.GpuLimits(58, 100 * 1024)
    assert blocks(q_len=16, group=4, head_dim=256, pages_per_seq=64, batch=8, limits=small_gpu).pages_per_block == 2
    assert blocks(q_len=8, group=4, pages_per_seq=64, batch=8).num_stages == 3
    assert blocks(q_len=1, group=4, pages_per_seq=64, batch=1, num_splits=8).pallas_merge

    import pallas_kernels.gpu.draft_attention as draft_module

    seen, choose = [], draft_module.choose_blocks
    monkeypatch.setattr(draft_module, "choose_blocks", lambda q, k, table, extra, **kw: (
        seen.append(extra), choose(q, k, table, extra, **kw))[1])
    jax.eval_shape(pk_gpu.paged_draft_attention, *_draft_shapes(block=65))
    assert seen == [2 * 128 * 128 * 2]


def test_short_table_rule():
    """A page table too short for 8 splits of two 128-token tiles (bs 1-2 at contexts up to ~2k)
    takes 64-token tiles, one or more per split; a longer table, an explicit split count, tiles
    already of 64 tokens (f32) and a large batch keep the plain rule."""
    shape = dict(q_len=16, group=4, head_dim=128, page_size=16, kv_heads=8, limits=pk_tuning.HOPPER)
    blocks = lambda **kw: (lambda b: (b.pages_per_block * kw.get("page_size", 16), b.num_splits))(  # noqa: E731
        pk_tuning.attention_blocks(**{**shape, **kw}))
    assert blocks(batch=1, pages_per_seq=56) == (64, 14)  # 896 tokens: 3 splits of 128-token tiles before
    assert blocks(batch=1, pages_per_seq=56, q_len=1) == (64, 14)
    assert blocks(batch=2, pages_per_seq=56) == (64, 8)
    assert blocks(batch=1, pages_per_seq=128) == (128, 8)  # 2048 tokens: 8 splits of two tiles
    assert blocks(batch=1, pages_per_seq=56, num_splits=3) == (128, 3)
    assert blocks(batch=1, pages_per_seq=56, itemsize=4) == (64, 7)
    assert blocks(batch=8, pages_per_seq=56) == (128, 2)
    assert blocks(batch=1, pages_per_seq=14, page_size=64) == (64, 14)
    assert blocks(batch=1, pages_per_seq=7, page_size=128) == (128, 3)


class _Device:
    """A stand-in for a jax device, as the tiling rules read one."""

    def __init__(self, platform="gpu", version="cuda 12080", capability="9.0", kind="NVIDIA H100 80GB HBM3", sms=132):
        self.platform, self.compute_capability, self.device_kind, self.core_count = platform, capability, kind, sms
        self.client = types.SimpleNamespace(platform_version=version)


def test_kernels_run_on_nvidia_gpus_of_compute_capability_8_or_newer():
    assert pk_tuning.kernel_device_problem(_Device()) is None
    assert pk_tuning.kernel_device_problem(_Device(capability="8.0", kind="NVIDIA A100-SXM4-80GB")) is None
    assert "not a GPU" in pk_tuning.kernel_device_problem(_Device(platform="cpu"))
    assert "runs rocm 60200" in pk_tuning.kernel_device_problem(_Device(version="rocm 60200"))
    assert "Tesla T4 has compute capability 7.5" in pk_tuning.kernel_device_problem(
        _Device(capability="7.5", kind="Tesla T4"))


# Qwen3-8B's attention (bf16), and f32 at head_dim 64 (the tests' dtype), for verify, decode,
# the draft (its block K/V in shared memory) and a full batch at block 8.
_RULE_CASES = [dict(q_len=q_len, group=4, head_dim=head_dim, page_size=16, pages_per_seq=2048, batch=batch,
                    kv_heads=8, itemsize=itemsize, extra_smem_bytes=extra * 2 * 16 * head_dim * itemsize)
               for q_len, batch, extra in ((16, 1, 0), (1, 8, 0), (16, 8, 1), (8, 32, 0), (16, 32, 0))
               for head_dim, itemsize in ((128, 2), (64, 4))]


# Shared memory per SM, KB (CUDA C++ Programming Guide, "Compute Capabilities"); 11.0 is not in
# the rules' table and gets the smallest.
_SMEM_KB = {(8, 0): 164, (8, 6): 100, (8, 7): 164, (8, 9): 100, (9, 0): 228, (10, 0): 228, (10, 3): 228,
            (12, 0): 100, (12, 1): 100, (11, 0): 100}


@pytest.mark.parametrize("capability", sorted(_SMEM_KB), ids=lambda c: "%d.%d" % c)
def test_tiling_rules_fit_each_gpus_shared_memory(capability):
    """Every config the rules pick plans at most the GPU's budget (Triton takes the plan + < 1 KB,
    measured) and keeps two stages where a 64-token tile allows."""
    limits = pk_tuning.device_limits(_Device(capability="%d.%d" % capability, sms=108))
    assert limits == pk_tuning.GpuLimits(num_sms=108, smem_per_sm=_SMEM_KB[capability] * 1024)
    for case in _RULE_CASES:
        blocks = pk_tuning.attention_blocks(limits=limits, **case)
        rows = blocks.block_t * case["group"]
        stage = 2 * blocks.pages_per_block * 16 * case["head_dim"] * case["itemsize"]
        planned = blocks.num_stages * stage + rows * case["head_dim"] * case["itemsize"] + case["extra_smem_bytes"]
        assert planned <= limits.smem_budget, (case, blocks)
        assert blocks.num_stages >= 2 or blocks.pages_per_block * 16 <= 64, (case, blocks)
    for m, k, n, gated in ((1, 4096, 6144, False), (16, 4096, 12288, True), (16, 12288, 4096, False)):
        blocks = matmul_blocks(m, k, n, 2, gated=gated, limits=limits)
        stage = (blocks.block_m + (2 if gated else 1) * blocks.block_n) * blocks.block_k * 2
        assert blocks.num_stages * stage <= limits.smem_budget


def test_split_count_follows_the_sm_count():
    """Decode at bs 1 (8 programs of 16 rows, two per SM): the context splits fill the GPU."""
    shape = dict(q_len=1, group=4, head_dim=128, page_size=16, pages_per_seq=2048, batch=1, kv_heads=8)
    splits = [pk_tuning.attention_blocks(limits=pk_tuning.GpuLimits(sms, 228 * 1024), **shape).num_splits
              for sms in (132, 58)]
    assert splits == [2 * 132 // 8, 2 * 58 // 8]


def test_limits_and_support_over_every_device(monkeypatch):
    """A host with several GPUs: the tiles fit the smallest, and one GPU the kernels cannot use
    turns them off (a computation may run on any of them)."""
    monkeypatch.setattr(pk_tuning.jax, "local_devices", lambda: [_Device(), _Device(capability="8.0", sms=108)])
    assert pk_tuning.gpu_limits.__wrapped__() == pk_tuning.GpuLimits(108, 164 * 1024)
    assert pk_tuning.kernel_device_problem() is None
    monkeypatch.setattr(pk_tuning.jax, "local_devices", lambda: [_Device(), _Device(capability="7.5", kind="Tesla T4")])
    assert "Tesla T4 has compute capability 7.5" in pk_tuning.kernel_device_problem()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU the rules plan for that GPU")
def test_hopper_limits_on_cpu():
    """On CPU (interpret mode and the CUDA lowering) the rules plan for an H100/H200."""
    assert pk_tuning.gpu_limits() == pk_tuning.HOPPER == pk_tuning.device_limits(_Device(platform="cpu"))


def test_tiling_rule_shrinks_the_kv_tile_to_fit_and_names_the_page_size():
    """Where 64 tokens of K/V do not fit beside the query tile (f32 at head_dim 256 with a draft
    block), the rule halves the tile; where one page alone does not fit, it says so."""
    shape = dict(q_len=16, group=4, head_dim=256, pages_per_seq=64, batch=1, kv_heads=8, itemsize=4,
                 limits=pk_tuning.HOPPER)
    blocks = pk_tuning.attention_blocks(page_size=16, extra_smem_bytes=2 * 16 * 256 * 4, **shape)
    assert blocks.pages_per_block == 2 and blocks.num_stages == 1
    with pytest.raises(ValueError, match="take a smaller page_size"):
        pk_tuning.attention_blocks(page_size=128, **shape)
    with pytest.raises(ValueError, match="take a 2-byte dtype, a shorter draft block or a smaller block_t"):
        pk_tuning.attention_blocks(page_size=16, extra_smem_bytes=2 * 16 * 256 * 4,
                                   **{**shape, "limits": pk_tuning.GpuLimits(58, 100 * 1024)})
    jax.eval_shape(pk_gpu.paged_draft_attention, *_draft_shapes(head_dim=256, dtype=jnp.float32))


def test_rejects_bad_tuning_and_block_shapes():
    with pytest.raises(ValueError, match="block_t"):
        jax.eval_shape(functools.partial(pk_gpu.paged_verify_attention, block_t=3),
                       *_attention_shapes())
    with pytest.raises(ValueError, match="pages_per_block"):
        jax.eval_shape(functools.partial(pk_gpu.paged_verify_attention, pages_per_block=3),
                       *_attention_shapes())
    shapes = list(_draft_shapes())
    shapes[5] = S((2, 8, 8, 128), BF)
    with pytest.raises(ValueError, match="block_k"):
        jax.eval_shape(pk_gpu.paged_draft_attention, *shapes)
    weight = S((128,), BF)
    cos, sin, positions, *pages = _write_shapes()[2:]
    with pytest.raises(ValueError, match="block_rows"):
        jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope, num_heads=32, num_kv_heads=8, eps=1e-6, block_rows=48),
                       S((2, 16, 48 * 128), BF), weight, weight, cos, sin)
    k, v = _write_shapes()[:2]
    with pytest.raises(ValueError, match="k_pages"):
        jax.eval_shape(functools.partial(pk_gpu.norm_rope_write, eps=1e-6), k, v, weight, cos, sin, positions,
                       S((200, 16, 4, 128), BF), pages[1], pages[2])
    qkv_kw = dict(num_heads=32, num_kv_heads=8, eps=1e-6)
    with pytest.raises(ValueError, match="qkv must be"):
        jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope_write, **qkv_kw), S((2, 16, 47 * 128), BF),
                       weight, weight, cos, sin, positions, *pages)
    # rotary tables: [B, T, R/2] with R/2 a power of two dividing head_dim / 2
    for table, match in [(S((2, 16, 48), BF), "power of two dividing head_dim / 2 = 64"),
                         (S((2, 16, 128), BF), "power of two dividing head_dim / 2 = 64"),
                         (S((2, 15, 64), BF), r"cos and sin must be \[batch, T, rotary_dim / 2\]")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope, **qkv_kw), S((2, 16, 48 * 128), BF), weight, weight,
                           table, table)
    with pytest.raises(ValueError, match="both be given or both be None"):
        jax.eval_shape(lambda *a: pk_gpu.qkv_norm_rope(a[0], a[1], None, *a[2:], **qkv_kw), S((2, 16, 48 * 128), BF),
                       weight, cos, sin)
    for match, x, w, kw in [("K", S((1, 100), BF), S((100, 64), BF), {}),
                            ("w", S((1, 64), BF), S((32, 64), BF), {}),
                            ("dtype", S((1, 64), BF), S((64, 64), jnp.float32), {}),
                            ("gated", S((1, 64), BF), S((64, 65), BF), {"gated": True}),
                            ("norm_weight", S((1, 64), BF), S((64, 32), BF), {"norm_weight": S((32,), BF)}),
                            ("residual", S((2, 64), BF), S((64, 32), BF), {"residual": S((2, 64), BF)}),
                            ("block_k", S((2, 64), BF), S((64, 32), BF), {"block_k": 48})]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.fused_matmul, **kw), x, w)
    with pytest.raises(ValueError, match="k_norm_weight"):
        jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope_write, **qkv_kw), S((2, 16, 48 * 128), BF),
                       weight, S((64,), BF), cos, sin, positions, *pages)
    with pytest.raises(ValueError, match="qkv must be"):
        jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope, **qkv_kw), S((2, 16, 47 * 128), BF),
                       weight, weight, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        jax.eval_shape(functools.partial(pk_gpu.qkv_norm_rope_write, **qkv_kw), S((2, 16, 48 * 128), BF),
                       weight, weight, cos, sin, S((2, 15), jnp.int32), *pages)


def test_rejects_launch_settings_and_empty_inputs_by_name():
    """What the GPU compiler would reject (a num_warps that is not a power of two aborts the
    process there), what cannot fit in shared memory, and empty inputs: ValueError naming them."""
    verify = pk_gpu.paged_verify_attention
    for kw, match in [({"num_warps": 3}, "num_warps must be a power of two"), ({"num_warps": 0}, "num_warps"),
                      ({"num_stages": 0}, "num_stages"), ({"block_t": 0}, "block_t must be >= 1"),
                      ({"pages_per_block": 0}, "pages_per_block must be >= 1"),
                      ({"sliding_window": 2.5}, "sliding_window must be an int"),
                      ({"num_warps": 64}, r"num_warps must be a power of two in \[1, 32\]"),
                      ({"block_t": 1}, r"block_t \* group must be a power of two >= 16, got 1 \* 4")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(verify, **kw), *_attention_shapes())
    with pytest.raises(ValueError, match="q block length T must be <= 128, got 129"):
        jax.eval_shape(pk_gpu.paged_draft_attention, *_draft_shapes(block=129))
    q, k_pages, v_pages, page_table, start = _attention_shapes()
    with pytest.raises(ValueError, match="at least one query token"):
        jax.eval_shape(verify, S((2, 0, *q.shape[2:]), q.dtype), k_pages, v_pages, page_table, start)
    with pytest.raises(ValueError, match="sliding_window must be an int"):
        pk.paged_verify_attention_reference(*(jnp.zeros(x.shape, x.dtype) for x in _attention_shapes()),
                                            sliding_window=0)
    jax.eval_shape(functools.partial(verify, sliding_window=np.int64(8)), *_attention_shapes())  # numpy ints too
    for shapes in (_attention_shapes(pages_per_seq=0), _attention_shapes(num_pages=0)):
        with pytest.raises(ValueError, match="at least one page"):
            jax.eval_shape(verify, *shapes)
    # stages beyond shared memory, given by hand: 4 x 128 KB of K/V tiles (2 x 64 KB fit)
    with pytest.raises(ValueError, match="num_stages=4 KV stages .131072 B each"):
        jax.eval_shape(functools.partial(verify, pages_per_block=16, num_stages=4), *_attention_shapes())
    jax.eval_shape(functools.partial(verify, pages_per_block=8, num_stages=3), *_attention_shapes())
    with pytest.raises(ValueError, match="num_stages=4 stages of x and weight tiles"):
        jax.eval_shape(functools.partial(pk_gpu.fused_matmul, block_n=256, block_k=256, num_stages=4),
                       S((16, 1024), BF), S((1024, 512), BF))
    # f32, head_dim 256, a 128-token block: its own K/V alone is 256 KB of shared memory
    f32 = lambda shape, dtype=jnp.float32: S(shape, dtype)  # noqa: E731
    with pytest.raises(ValueError, match="exceed the .* shared memory"):
        jax.eval_shape(pk_gpu.paged_draft_attention, f32((1, 128, 4, 256)), f32((8, 16, 1, 256)), f32((8, 16, 1, 256)),
                       f32((1, 4), jnp.int32), f32((1,), jnp.int32), f32((1, 128, 1, 256)), f32((1, 128, 1, 256)))
    write = functools.partial(pk_gpu.norm_rope_write, eps=1e-6)
    k, v, *rest = _write_shapes()
    with pytest.raises(ValueError, match="num_warps"):
        jax.eval_shape(functools.partial(write, num_warps=3), k, v, S((128,), BF), *rest)
    for kw, match in [({"num_warps": 6}, "num_warps"), ({"block_m": 24}, "block_m must be a power of two"),
                      ({"block_n": 0}, "block_n must be >= 1"), ({"num_splits": 0}, "num_splits must be >= 1")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.fused_matmul, **kw), S((2, 64), BF), S((64, 32), BF))
    with pytest.raises(ValueError, match="at least one row"):
        jax.eval_shape(pk_gpu.fused_matmul, S((0, 64), BF), S((64, 32), BF))
    o, lse = S((4, 2, 64), BF), S((4, 2), jnp.float32)
    for shapes, kw, match in [((o, S((4, 3), jnp.float32)), {}, "lse .splits, .... with o's leading shape"),
                              ((o, S((4, 2), BF)), {}, "lse must be float32"),
                              ((S((4, 2, 48), BF), lse), {}, "head_dim must be a power of two"),
                              ((o, lse), {"block_rows": 3}, "block_rows must be a power of two"),
                              ((o, lse), {"num_warps": 3}, "num_warps"),
                              ((S((4, 0, 64), BF), S((4, 0), jnp.float32)), {}, "at least one split and one row")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.combine_splits, **kw), *shapes)
    # a tile too large for shared memory is refused here, not by the GPU at launch
    with pytest.raises(ValueError, match="one stage of x and weight tiles .294912 B.* exceeds"):
        jax.eval_shape(functools.partial(pk_gpu.fused_matmul, block_k=512, block_n=128),
                       S((2, 1024), jnp.float32), S((1024, 256), jnp.float32))
    # a given num_splits picks a K tile whose steps it divides (256 would leave one step for 2)
    jax.eval_shape(functools.partial(pk_gpu.fused_matmul, num_splits=2), S((2, 256), BF), S((256, 64), BF))
    moe = (S((4, 64), BF), S((4, 2), jnp.int32), S((4, 2), BF), S((8, 64, 64), BF), S((8, 32, 64), BF))
    for changed, kw, match in [((), {"block_m": 8}, "block_m must be a power of two >= 16"),
                               ((), {"block_n": 24}, "block_n must be a power of two >= 16 that divides 32, got 24"),
                               ((), {"block_k": 8}, "block_k must be a power of two >= 16 that divides 64, got 8"),
                               ((), {"block_n": 128}, "block_n must be a power of two >= 16 that divides 32, got 128"),
                               ((), {"num_warps": 3}, "num_warps"),
                               ({4: S((8, 32, 48), BF)}, {}, r"must be \[E, H, 2I\] and \[E, I, H\]"),
                               ({1: S((4, 2), jnp.float32)}, {}, "integer expert ids"),
                               ({2: S((4, 3), BF)}, {}, r"experts and weights must be \[N, k\]"),
                               ({3: S((8, 64, 64), jnp.float32)}, {}, "share a float32/bfloat16/float16 dtype"),
                               ({0: S((4, 40), BF), 3: S((8, 40, 64), BF), 4: S((8, 32, 40), BF)}, {},
                                "multiples of 16")]:
        shapes = [changed.get(i, shape) for i, shape in enumerate(moe)] if changed else moe
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.routed_experts, **kw), *shapes)


def test_routed_experts_rejects_bad_mxfp4_weights():
    """MXFP4 weights of the wrong dtype or layout, or a K tile that splits a scale group: ValueError
    naming the problem; the shared-memory check counts their packed bytes, not bf16's."""
    mx = _mxfp4_shapes
    x, experts, weights = S((4, 64), BF), S((4, 2), jnp.int32), S((4, 2), BF)
    for gate_up, down, kw, match in [
            (mx(8, 64, 64, jnp.int8), mx(8, 32, 64), {}, "gate_up: MXFP4 blocks and scales must be uint8, got int8"),
            (mx(8, 64, 64), pk.Mxfp4Weight(S((8, 16, 64), jnp.uint8), S((8, 2, 64), jnp.uint8)), {},
             r"down: MXFP4 scales must be \[E, K/32, N\] = \[8, 1, 64\]"),
            (pk.Mxfp4Weight(S((8, 24, 64), jnp.uint8), S((8, 1, 64), jnp.uint8)), mx(8, 32, 64), {},
             "gate_up: MXFP4 blocks must be .E, K/2, N. with K a multiple of 32, got .8, 24, 64."),
            (pk.Mxfp4Weight(S((8, 64), jnp.uint8), S((8, 64), jnp.uint8)), mx(8, 32, 64), {}, "K a multiple of 32"),
            (mx(8, 128, 64), mx(8, 32, 64), {}, r"must be \[E, H, 2I\] and \[E, I, H\]"),
            (mx(8, 64, 64), S((8, 32, 64), jnp.float32), {}, "share a float32/bfloat16/float16 dtype .* bfloat16, "
             "mxfp4, float32"),
            (mx(8, 64, 64), mx(8, 32, 64), {"block_k": 16}, "routed_experts_gate_up: block_k must be a power of "
             "two >= 32 that divides 64 .whole MXFP4 scale groups., got 16"),
            (mx(8, 64, 64), mx(8, 32, 64), {"gemv": True}, "gemv runs MXFP4 weights at one token, got 4 tokens")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(pk_gpu.routed_experts, **kw), x, experts, weights, gate_up, down)
    # two stages of bf16 gate|up tiles (2 x 256 x 128 x 2 B) overflow Hopper's budget; MXFP4's fit
    big = (S((4, 256), BF), experts, weights)
    kw = dict(block_n=128, block_k=256, num_stages=2)
    with pytest.raises(ValueError, match="routed_experts_gate_up: num_stages=2 stages of 139264 B"):
        jax.eval_shape(functools.partial(pk_gpu.routed_experts, **kw), *big, S((8, 256, 512), BF), S((8, 256, 256), BF))
    jax.eval_shape(functools.partial(pk_gpu.routed_experts, **kw), *big, mx(8, 256, 512), mx(8, 256, 256))
    with pytest.raises(ValueError, match="gemv runs MXFP4 weights at one token, got 1 tokens and dense gate_up, "
                                         "dense down"):
        jax.eval_shape(functools.partial(pk_gpu.routed_experts, gemv=True), S((1, 64), BF), S((1, 2), jnp.int32),
                       S((1, 2), BF), S((8, 64, 64), BF), S((8, 32, 64), BF))

def test_write_pages_drops_page_ids_outside_the_pool():
    """Like the kernels: a page id outside [0, num_pages), negative included, writes nothing."""
    pages = jnp.zeros((3, 2, 1, 1))
    table = jnp.array([[-1, 1]], jnp.int32)
    out = pk.write_pages(pages, table, jnp.array([[0, 1, 2]], jnp.int32), jnp.ones((1, 3, 1, 1)))
    assert np.asarray(out[:, :, 0, 0]).tolist() == [[0, 0], [1, 0], [0, 0]]

"""The TPU kernels (``pallas_kernels.tpu``) against their references in TPU interpret mode
(``pltpu.InterpretParams``: DMAs and semaphores simulated on the CPU), and compiled ahead of time
for real TPU generations by libtpu's compiler (no TPU needed; ``pip install -e ".[tpu]"``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import tpu as pk_tpu


def paged_case(seed, batch, q_len, q_heads, kv_heads, head_dim, page_size, pages_per_seq, dtype):
    """Random queries over a NaN-poisoned pool with permuted page tables. Sequence b has
    ``real[b]`` real query tokens from ``start[b]``; its table names pages up to them and holds the
    pool's sentinel beyond, where the padded queries past ``real[b]`` (as in a ragged prefill)
    reach. Also returns the table the references read: theirs needs a page in the pool wherever a
    query can see (they gather whole tables), so there the sentinel names the sequence's first page."""
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_seq + 3
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, q_len, q_heads, head_dim), dtype)
    k_pages = jax.random.normal(keys[1], (num_pages, page_size, kv_heads, head_dim), dtype)
    v_pages = jax.random.normal(keys[2], (num_pages, page_size, kv_heads, head_dim), dtype)
    real = rng.integers(1, q_len + 1, batch)
    start = rng.integers(0, pages_per_seq * page_size - q_len, batch)
    table = np.full((batch, pages_per_seq), num_pages, np.int32)
    order = rng.permutation(num_pages)
    for b in range(batch):
        used = -(-(start[b] + real[b]) // page_size)
        table[b, :used], order = order[:used], order[used:]
    unused = jnp.asarray(order)
    k_pages, v_pages = (pages.at[unused].set(jnp.nan) for pages in (k_pages, v_pages))
    reference_table = np.where(table == num_pages, table[:, :1], table)
    return q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(start, jnp.int32), real, jnp.asarray(reference_table)


def assert_real_rows_close(out, ref, real, dtype):
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for b, n in enumerate(real):
        np.testing.assert_allclose(np.asarray(out[b, :n], np.float32), np.asarray(ref[b, :n], np.float32),
                                   rtol=tol, atol=tol)


VERIFY_CASES = {  # seed, batch, q_len, q_heads, kv_heads, head_dim, page_size, pages_per_seq, dtype, window, sinks
    "decode": (1, 3, 1, 4, 2, 32, 4, 6, jnp.float32, None, False),
    "verify-window": (2, 3, 5, 8, 2, 32, 4, 8, jnp.float32, 7, False),
    # 80 tokens x 4 heads: two query tiles, the second padded
    "prefill-tiles": (3, 2, 80, 4, 1, 16, 8, 16, jnp.float32, None, False),
    "bf16-sinks-window": (4, 2, 6, 8, 2, 64, 8, 5, jnp.bfloat16, 9, True),
}


@pytest.mark.parametrize("case", VERIFY_CASES.values(), ids=VERIFY_CASES.keys())
def test_verify_attention_matches_reference(case):
    seed, *shape, dtype, window, with_sinks = case
    q, k_pages, v_pages, table, start, real, reference_table = paged_case(seed, *shape, dtype)
    sinks = jax.random.normal(jax.random.key(seed + 7), (q.shape[2],), jnp.float32) if with_sinks else None
    ref = pk.paged_verify_attention_reference(q, k_pages, v_pages, reference_table, start, sliding_window=window,
                                              sinks=sinks)
    out = pk_tpu.paged_verify_attention(q, k_pages, v_pages, table, start, sliding_window=window, sinks=sinks,
                                        interpret=True, block_t=64 if q.shape[1] > 64 else None, pages_per_block=3)
    assert_real_rows_close(out, ref, real, dtype)


DRAFT_CASES = {  # seed, batch, block, q_heads, kv_heads, head_dim, page_size, pages_per_seq, dtype, window, causal
    "non-causal": (5, 3, 8, 4, 2, 32, 4, 6, jnp.float32, None, False),
    "causal-window": (6, 3, 8, 4, 2, 32, 4, 8, jnp.float32, 6, True),
    "bf16-window": (7, 2, 16, 8, 4, 64, 16, 3, jnp.bfloat16, 5, False),
}


@pytest.mark.parametrize("case", DRAFT_CASES.values(), ids=DRAFT_CASES.keys())
def test_draft_attention_matches_reference(case):
    seed, batch, block, *shape, dtype, window, causal = case
    q, k_pages, v_pages, table, context, _, reference_table = paged_case(seed, batch, block, *shape, dtype)
    keys = jax.random.split(jax.random.key(seed + 11), 2)
    block_k, block_v = (jax.random.normal(key, (batch, block) + k_pages.shape[2:], dtype) for key in keys)
    block_lens = jnp.asarray(np.random.default_rng(seed).integers(1, block + 1, batch), jnp.int32)
    ref = pk.paged_draft_attention_reference(q, k_pages, v_pages, reference_table, context, block_k, block_v,
                                             block_lens, sliding_window=window, causal=causal)
    out = pk_tpu.paged_draft_attention(q, k_pages, v_pages, table, context, block_k, block_v, block_lens,
                                       sliding_window=window, causal=causal, interpret=True, pages_per_block=2)
    assert_real_rows_close(out, ref, [block] * batch, dtype)


# Compiled for real TPUs ---------------------------------------------------------------------------

libtpu = pytest.importorskip("libtpu", reason='the TPU compiler comes with pip install -e ".[tpu]"')
from pallas_kernels.tpu.compile import compile_for  # noqa: E402


def tpu_device(topology: str):
    from pallas_kernels.tpu.compile import topology_devices
    return topology_devices(topology)[0]


# Qwen3-8B's attention (32 query heads, 8 KV heads of 128) over 2048-token contexts in 16-token
# pages, and gpt-oss-20b's (64 / 8 of 64, a window and sinks).
QWEN3_8B = dict(q_heads=32, kv_heads=8, head_dim=128)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("batch,q_len", [(1, 1), (32, 16), (4, 512)], ids=["decode", "verify", "prefill"])
def test_attention_compiles_for_tpus(topology, batch, q_len):
    device = tpu_device(topology)
    q_heads, kv_heads, head_dim = QWEN3_8B.values()
    pages_per_seq, num_pages = 128, 128 * batch
    pages = ((num_pages, 16, kv_heads, head_dim), jnp.bfloat16)
    shapes = [((batch, q_len, q_heads, head_dim), jnp.bfloat16), pages, pages,
              ((batch, pages_per_seq), jnp.int32), ((batch,), jnp.int32)]
    verify = compile_for(device, pk_tpu.paged_verify_attention, *shapes)
    block = ((batch, 16, kv_heads, head_dim), jnp.bfloat16)
    draft_shapes = [((batch, 16, q_heads, head_dim), jnp.bfloat16)] + shapes[1:] + [block, block, ((batch,), jnp.int32)]
    draft = compile_for(device, pk_tpu.paged_draft_attention, *draft_shapes)
    kv_bytes = 2 * num_pages * 16 * kv_heads * head_dim * 2
    for compiled in (verify, draft):
        memory = compiled.memory_analysis()
        assert memory.argument_size_in_bytes >= kv_bytes
        assert memory.temp_size_in_bytes < kv_bytes / 8  # no page gather, no copy of the pool
        # the kernel's own count: every page the table names, read once
        assert compiled.cost_analysis()["bytes accessed"] >= kv_bytes


def test_oversized_block_is_refused_naming_the_kernel():
    device = tpu_device("v5e:2x2")
    shapes = [((1, 512, 32, 128), jnp.bfloat16), ((4096, 16, 8, 128), jnp.bfloat16),
              ((4096, 16, 8, 128), jnp.bfloat16), ((1, 256), jnp.int32), ((1,), jnp.int32)]
    oversized = lambda *args: pk_tpu.paged_verify_attention(*args, block_t=512, pages_per_block=64)  # noqa: E731
    with pytest.raises(ValueError, match=r"tpu_paged_verify_attention: block_t=512 .* MiB of VMEM.*take smaller"):
        compile_for(device, oversized, *shapes)

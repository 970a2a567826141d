"""Paged attention: the plain-jnp references and the argument checks the kernels of both backends share.

Verify, decode and prefill (``paged_verify_attention_reference``): causal attention of 1..T new
query tokens per sequence over its paged KV. Query ``t`` of sequence ``b`` sits at position
``start[b] + t`` and sees every cached key at a position ``<= start[b] + t`` (and, with a sliding
window ``w``, ``> start[b] + t - w``). The new tokens' K/V must already be written to the pages.

The DFlash draft (``paged_draft_attention_reference``): a block of queries over paged context
K/V plus the block's own K/V. Sequence ``b`` has ``context_lens[b]`` context tokens cached at
positions ``0..context_lens[b]-1``; its block query ``t`` sits at position
``context_lens[b] + t``. Keys: every cached context token, then the block's own K/V
(``block_k``, never written to the cache), of which only the first ``block_lens[b]`` are real (a
block cut short near ``max_new_tokens``). No causal mask unless ``causal=True`` (the z-lab
reference makes sliding-window draft layers causal); a sliding window ``w`` keeps keys with
``|q_pos - k_pos| < w`` (one-sided when causal).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.paging import gather_pages
from pallas_kernels.sizes import is_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def masked_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                         sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention with an explicit mask, grouped-query heads, f32 statistics.

    q: [B, T, Hq, D]; k, v: [B, K, Hkv, D]; visible: [B, T, K] bool. Rows with nothing visible
    return zeros. Invisible keys may hold anything (NaN included): they never reach the output.
    ``sinks`` [Hq] (gpt-oss): a learned logit per query head that joins every row's softmax as a
    key with no value (its weight enters the normaliser only; in scaled-score units).
    """
    batch, num_q, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    any_query_sees = jnp.any(visible, axis=1)[:, :, None, None]  # [B, K, 1, 1]
    k = jnp.where(any_query_sees, k, 0).astype(jnp.float32)
    v = jnp.where(any_query_sees, v, 0).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(batch, num_q, kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * (head_dim ** -0.5)
    mask = visible[:, None, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0)), 0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    weights = weights / jnp.where(denom > 0, denom, 1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
    return out.reshape(batch, num_q, q_heads, head_dim).astype(q.dtype)


def check_sliding_window(sliding_window) -> None:
    """ValueError unless the window is None (no window) or an integer >= 1 (numpy's included)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or
                                       not isinstance(sliding_window, numbers.Integral) or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")


def paged_verify_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     page_table: jax.Array, start: jax.Array, *,
                                     sliding_window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """q [B, T, Hq, D]; k/v_pages [P, S, Hkv, D]; page_table [B, pages_per_seq]; start [B];
    sinks [Hq] or None (``masked_gqa_attention``). Page ids must lie in [0, P) wherever a query
    can see them (the kernels never read outside the pages, but give unspecified values for
    other ids)."""
    check_sliding_window(sliding_window)
    keys = gather_pages(k_pages, page_table)
    values = gather_pages(v_pages, page_table)
    q_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]  # [B, T]
    k_pos = jnp.arange(keys.shape[1])
    visible = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    return masked_gqa_attention(q, keys, values, visible, sinks)


def paged_draft_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                    page_table: jax.Array, context_lens: jax.Array,
                                    block_k: jax.Array, block_v: jax.Array,
                                    block_lens: jax.Array | None = None, *,
                                    sliding_window: int | None = None,
                                    causal: bool = False, sinks: jax.Array | None = None) -> jax.Array:
    """q, block_k/v: [B, T, H*, D]; pages [P, S, Hkv, D]; page_table [B, n]; lens [B] int32;
    sinks [Hq] or None (``masked_gqa_attention``)."""
    check_sliding_window(sliding_window)
    batch, block = q.shape[:2]
    if block_lens is None:
        block_lens = jnp.full((batch,), block, jnp.int32)
    ctx_k = gather_pages(k_pages, page_table)
    ctx_v = gather_pages(v_pages, page_table)
    keys = jnp.concatenate([ctx_k, block_k.astype(ctx_k.dtype)], axis=1)
    values = jnp.concatenate([ctx_v, block_v.astype(ctx_v.dtype)], axis=1)
    ctx_slots = ctx_k.shape[1]
    t = jnp.arange(block)
    q_pos = context_lens[:, None] + t[None, :]                                   # [B, T]
    ctx_pos = jnp.broadcast_to(jnp.arange(ctx_slots), (batch, ctx_slots))
    blk_pos = context_lens[:, None] + t[None, :]
    k_pos = jnp.concatenate([ctx_pos, blk_pos], axis=1)                           # [B, K]
    k_real = jnp.concatenate([ctx_pos < context_lens[:, None],
                              t[None, :] < block_lens[:, None]], axis=1)          # [B, K]
    visible = jnp.broadcast_to(k_real[:, None, :], (batch, block, k_pos.shape[1]))
    if causal:
        visible &= k_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        distance = q_pos[:, :, None] - k_pos[:, None, :]
        visible &= distance < sliding_window
        if not causal:
            visible &= -distance < sliding_window
    return masked_gqa_attention(q, keys, values, visible, sinks)


def check_paged_args(q, k_pages, v_pages, page_table, lens, lens_name: str) -> None:
    """ValueError naming the argument for shapes/dtypes the kernels do not handle."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, T, q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_pages, page_size, kv_heads, head_dim], "
                         f"got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    batch, _, q_heads, head_dim = q.shape
    _, page_size, kv_heads, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"k_pages head_dim {kv_dim} != q head_dim {head_dim}")
    if not is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"q head_dim must be a power of two >= 16, got {head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k_pages kv_heads ({kv_heads})")
    if not is_power_of_2(page_size):
        raise ValueError(f"k_pages page_size must be a power of two, got {page_size}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"k_pages/v_pages dtype ({k_pages.dtype}, {v_pages.dtype}) must equal "
                         f"q dtype {q.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [batch={batch}, pages_per_seq], got "
                         f"{page_table.dtype} {page_table.shape}")
    if page_table.shape[1] == 0 or k_pages.shape[0] == 0:
        raise ValueError(f"page_table must list at least one page per sequence and k_pages hold at least "
                         f"one page, got page_table {page_table.shape} and k_pages {k_pages.shape}")
    if lens.shape != (batch,) or not jnp.issubdtype(lens.dtype, jnp.integer):
        raise ValueError(f"{lens_name} must be an integer [batch={batch}] array, got "
                         f"{lens.dtype} {lens.shape}")

"""The one place that chooses between Pallas kernels and their plain-jnp references.

``impl`` is a static choice threaded through every forward:
- ``"auto"``: kernels on GPU, references elsewhere;
- ``"reference"``: plain jnp everywhere;
- ``"pallas"``: kernels, compiled (GPU only);
- ``"interpret"``: kernels in Pallas interpret mode (any backend; slow, for tests).
"""

from __future__ import annotations

from typing import Literal

import jax

import pallas_kernels as pk

AttentionImpl = Literal["auto", "reference", "pallas", "interpret"]
IMPLS = ("auto", "reference", "pallas", "interpret")


def resolve_impl(impl: AttentionImpl) -> str:
    """Turn ``auto`` into a concrete choice and reject combinations that cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas" if backend == "gpu" else "reference"
    if impl == "pallas" and backend != "gpu":
        raise ValueError(f"attention impl 'pallas' needs a GPU (backend is '{backend}'); "
                         "use 'interpret' to run the kernels on CPU or 'reference'")
    return impl


def _kernel_kwargs(impl: str) -> dict:
    return {"interpret": impl == "interpret"}


def verify_attention(q, k_pages, v_pages, page_table, start, *, sliding_window, impl):
    """Causal attention of new tokens (already written to the pages) at start[b] + t."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return pk.paged_verify_attention_reference(q, k_pages, v_pages, page_table, start,
                                                   sliding_window=sliding_window)
    return pk.paged_verify_attention(q, k_pages, v_pages, page_table, start,
                                     sliding_window=sliding_window, **_kernel_kwargs(impl))


def draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v, block_lens, *,
                    sliding_window, causal, impl):
    """Draft block attention over paged context K/V plus the block's own K/V."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return pk.paged_draft_attention_reference(q, k_pages, v_pages, page_table, context_lens,
                                                  block_k, block_v, block_lens,
                                                  sliding_window=sliding_window, causal=causal)
    return pk.paged_draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v,
                                    block_lens, sliding_window=sliding_window, causal=causal,
                                    **_kernel_kwargs(impl))


def norm_rope(x, weight, positions, *, eps, theta, impl):
    """Per-head RMSNorm + RoPE of x [B, T, heads, head_dim]."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return pk.norm_rope_reference(x, weight, positions, eps=eps, theta=theta)
    return pk.norm_rope(x, weight, positions, eps=eps, theta=theta, **_kernel_kwargs(impl))


def write_kv(k, v, k_norm, positions, k_pages, v_pages, page_table, *, eps, theta, impl):
    """Store norm_rope(k) and v at ``positions`` [B, T]; returns the updated (k_pages, v_pages)."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return pk.norm_rope_write_reference(k, v, k_norm, positions, k_pages, v_pages, page_table,
                                            eps=eps, theta=theta)
    return pk.norm_rope_write(k, v, k_norm, positions, k_pages, v_pages, page_table,
                              eps=eps, theta=theta, **_kernel_kwargs(impl))

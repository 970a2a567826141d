"""The one place that chooses between Pallas kernels and their plain-jnp references.

``impl`` is a static choice threaded through every forward:
- ``"auto"``: on an NVIDIA GPU of compute capability >= 8.0, the kernels that beat XLA there
  (``AUTO_KERNELS``); references elsewhere (CPU, ROCm, older GPUs);
- ``"reference"``: plain jnp everywhere;
- ``"pallas"``: every kernel, compiled (such a GPU only; a clear error elsewhere);
- ``"interpret"``: every kernel in Pallas interpret mode (any backend; slow, for tests).
"""

from __future__ import annotations

from typing import Literal

import pallas_kernels as pk
from pallas_kernels import tuning as pk_tuning
from pallas_kernels.verify_attention import padded_group

AttentionImpl = Literal["auto", "reference", "pallas", "interpret"]
IMPLS = ("auto", "reference", "pallas", "interpret")


# What "auto" runs as a kernel on GPU, per operation. Measured (benchmarks/RESULTS.md): the paged
# attention kernels beat XLA and cuDNN at every size (H100 and H200). The norm+RoPE kernels that
# write pages (the draft's context K/V, and a target layer's whole attention input in one launch,
# qkv_norm_rope_write) beat XLA's fusions since their rotary tables come precomputed (H200,
# 2026-11-22, bs-1 decode 4.61-4.70 vs 4.79-4.88 ms, bs-1 DFlash step 5.90-5.93 vs 6.10-6.21; with
# the trigonometry in the kernel they had lost). The draft block's qkv_norm_rope is level with XLA
# (H200, 2026-11-22, bs-1 DFlash step 5.76-5.81 vs 5.77-5.79 ms), and the projection kernel with
# its norm/gate/residual fused loses (H100, 2026-11-22: bs-8 decode 7.02 vs 6.48 ms, bs-1 DFlash
# step 8.97 vs 8.29), so auto keeps XLA for both. "pallas" forces every kernel.
# benchmarks/ab_kernels.py re-measures one op on vs off.
AUTO_KERNELS = {"verify_attention": True, "draft_attention": True, "write_kv": True,
                "qkv_norm_rope_write": True, "qkv_norm_rope": False, "fused_matmul": False}


def resolve_impl(impl: AttentionImpl, op: str) -> str:
    """Turn ``auto`` into a concrete choice for ``op`` and reject combinations that cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if AUTO_KERNELS[op] and pk_tuning.kernel_device_problem() is None else "reference"
    if impl == "pallas" and (problem := pk_tuning.kernel_device_problem()) is not None:
        raise ValueError(f"attention impl 'pallas' cannot run here: {problem}; use 'reference' "
                         "(or 'interpret', the kernels interpreted, slow)")
    return impl


def _kernel_kwargs(impl: str) -> dict:
    return {"interpret": impl == "interpret"}


def verify_attention(q, k_pages, v_pages, page_table, start, *, sliding_window, impl):
    """Causal attention of new tokens (already written to the pages) at start[b] + t."""
    impl = resolve_impl(impl, "verify_attention")
    if impl == "reference":
        return pk.paged_verify_attention_reference(q, k_pages, v_pages, page_table, start,
                                                   sliding_window=sliding_window)
    return pk.paged_verify_attention(q, k_pages, v_pages, page_table, start,
                                     sliding_window=sliding_window, **_kernel_kwargs(impl))


def draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v, block_lens, *,
                    sliding_window, causal, impl):
    """Draft block attention over paged context K/V plus the block's own K/V."""
    impl = resolve_impl(impl, "draft_attention")
    if impl == "reference":
        return pk.paged_draft_attention_reference(q, k_pages, v_pages, page_table, context_lens,
                                                  block_k, block_v, block_lens,
                                                  sliding_window=sliding_window, causal=causal)
    return pk.paged_draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v,
                                    block_lens, sliding_window=sliding_window, causal=causal,
                                    **_kernel_kwargs(impl))


def qkv_norm_rope(qkv, q_norm, k_norm, positions, *, num_heads, num_kv_heads, eps, theta, impl):
    """The draft block's attention input from its fused projection qkv [B, T, (Hq + 2 Hkv) * D]:
    (norm_rope(q) [B, T, Hq, D], norm_rope(k) [B, T, Hkv, D], v [B, T, Hkv, D])."""
    impl = resolve_impl(impl, "qkv_norm_rope")
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, theta=theta)
    if impl == "reference":
        return pk.qkv_norm_rope_reference(qkv, q_norm, k_norm, positions, **kw)
    return pk.qkv_norm_rope(qkv, q_norm, k_norm, positions, **kw, **_kernel_kwargs(impl))


def write_kv(k, v, k_norm, positions, k_pages, v_pages, page_table, *, eps, theta, impl):
    """Store norm_rope(k) and v at ``positions`` [B, T]; returns the updated (k_pages, v_pages)."""
    impl = resolve_impl(impl, "write_kv")
    if impl == "reference":
        return pk.norm_rope_write_reference(k, v, k_norm, positions, k_pages, v_pages, page_table,
                                            eps=eps, theta=theta)
    return pk.norm_rope_write(k, v, k_norm, positions, k_pages, v_pages, page_table,
                              eps=eps, theta=theta, **_kernel_kwargs(impl))


def qkv_norm_rope_write(qkv, q_norm, k_norm, positions, k_pages, v_pages, page_table, *, num_heads,
                        num_kv_heads, eps, theta, impl):
    """A target layer's attention input from its fused projection qkv [B, T, (Hq + 2 Hkv) * D]:
    returns (norm_rope(q) [B, T, Hq, D], k_pages, v_pages with norm_rope(k) and v stored)."""
    impl = resolve_impl(impl, "qkv_norm_rope_write")
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, theta=theta)
    if impl == "reference":
        return pk.qkv_norm_rope_write_reference(qkv, q_norm, k_norm, positions, k_pages, v_pages,
                                                page_table, **kw)
    return pk.qkv_norm_rope_write(qkv, q_norm, k_norm, positions, k_pages, v_pages, page_table, **kw,
                                  **_kernel_kwargs(impl))


def project(x, w, *, norm_weight=None, eps=1e-6, gated=False, residual=None, impl):
    """A projection with its glue: [rms_norm(x)] @ w [-> silu(gate) * up] [+ residual]."""
    impl = resolve_impl(impl, "fused_matmul")
    kw = dict(norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
    if impl == "reference":
        return pk.fused_matmul_reference(x, w, **kw)
    return pk.fused_matmul(x, w, **kw, **_kernel_kwargs(impl))


def check_kernel_shapes(impl: AttentionImpl, configs, page_size: int, block_size: int, itemsize: int) -> None:
    """Raise before compiling when the attention kernels ``impl`` selects cannot run these
    models in a dtype of ``itemsize`` bytes (the kernels need a power-of-two head_dim >= 16 and
    page size, block <= 128, and one page of K/V beside the draft block in shared memory)."""
    if resolve_impl(impl, "verify_attention") == "reference":
        return
    power_of_two = pk_tuning.is_power_of_2
    problems = []
    for config in configs:
        if not (power_of_two(config.head_dim) and config.head_dim >= 16):
            problems.append(f"head_dim {config.head_dim} (needs a power of two >= 16)")
    if not power_of_two(page_size):
        problems.append(f"page_size {page_size} (needs a power of two)")
    if block_size > 128:
        problems.append(f"block_size {block_size} (the draft kernel takes <= 128)")
    if not problems:
        for config in configs:  # the draft kernel's shared memory (the largest of the attention kernels')
            try:
                pk_tuning.attention_blocks(
                    q_len=block_size, group=padded_group(config.num_heads, config.num_kv_heads),
                    head_dim=config.head_dim, page_size=page_size, pages_per_seq=1, batch=1,
                    kv_heads=config.num_kv_heads, itemsize=itemsize,
                    extra_smem_bytes=2 * block_size * config.head_dim * itemsize)
            except ValueError as error:
                problems.append(f"page_size {page_size} ({error})")
                break
    if resolve_impl(impl, "fused_matmul") != "reference":
        for config in configs:
            widths = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                      "num_heads * head_dim": config.num_heads * config.head_dim}
            problems += [f"{name} {value} (the projection kernel needs a multiple of 16)"
                         for name, value in widths.items() if value % 16]
    if problems:
        raise ValueError(f"the Pallas attention kernels (impl={impl!r}) cannot run {'; '.join(problems)}; "
                         "pass impl='reference' (CLI: --impl reference)")

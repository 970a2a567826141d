"""The one place that chooses between Pallas kernels and their plain-jnp references.

Every operation that has a kernel goes through here: the paged attention of targets and drafts,
the norm + RoPE (+ page write) of q/k/v, the projections, the routed MoE experts.

``impl`` is a static choice threaded through every forward:
- ``"auto"``: on an NVIDIA GPU of compute capability >= 8.0, the GPU kernels that beat XLA there
  (``AUTO_KERNELS``); on a TPU, the TPU kernels (``TPU_KERNELS``); references elsewhere (CPU,
  ROCm, older GPUs) and for the other operations;
- ``"reference"``: plain jnp everywhere;
- ``"pallas"``: every kernel of the backend, compiled (on a TPU the operations without a TPU
  kernel run their references; a clear error off GPUs and TPUs);
- ``"interpret"``: every GPU kernel in Pallas interpret mode (any backend; slow, for tests);
- ``"interpret-tpu"``: the TPU kernels in TPU interpret mode (``pltpu.InterpretParams``: DMAs
  and semaphores simulated on a CPU), the references for the rest.

``resolve_impl`` turns the choice into one of ``KERNEL_CHOICES`` per operation.
"""

from __future__ import annotations

from typing import Literal

import jax

import pallas_kernels as pk
from pallas_kernels import gpu as pk_gpu
from pallas_kernels import tpu as pk_tpu
from pallas_kernels.gpu import tuning as pk_tuning

from dflash_jax.model.collectives import sum_partials

AttentionImpl = Literal["auto", "reference", "pallas", "interpret", "interpret-tpu"]
IMPLS = ("auto", "reference", "pallas", "interpret", "interpret-tpu")
KERNEL_CHOICES = ("reference", "gpu", "gpu-interpret", "tpu", "tpu-interpret")


# What "auto" runs as a kernel on GPU, per operation. Measured (benchmarks/RESULTS.md): the paged
# attention kernels beat XLA and cuDNN at every size (H100 and H200). The norm+RoPE kernels that
# write pages (the draft's context K/V, and a target layer's whole attention input in one launch,
# qkv_norm_rope_write) beat XLA's fusions since their rotary tables come precomputed (H200,
# 2026-11-22, bs-1 decode 4.61-4.70 vs 4.79-4.88 ms, bs-1 DFlash step 5.90-5.93 vs 6.10-6.21; with
# the trigonometry in the kernel they had lost). The draft block's qkv_norm_rope is level with XLA
# (H200, 2026-11-22, bs-1 DFlash step 5.76-5.81 vs 5.77-5.79 ms), and the projection kernel with
# its norm/gate/residual fused loses (H100, 2026-11-22: bs-8 decode 7.02 vs 6.48 ms, bs-1 DFlash
# step 8.97 vs 8.29), so auto keeps XLA for the draft block's norm+RoPE and for most projections:
# it runs the projection kernel only where XLA falls back to a reduce fusion, single-row products
# with a side of at most ``PROJECTION_KERNEL_MAX_WIDTH`` (``projection_kernel_wins``; H200,
# 2026-11-27: Qwen3-30B-A3B bs-1 decode 3.83 ms with the kernel against 5.13 without; a 16-row
# DFlash step and single rows at hidden 4096 lost). The routing kernel stays off: in one launch
# it lost bs-1 decode (H200, 2026-11-30: 4.74 against 4.06 ms); in two it is within the noise at
# one row (Qwen3-30B-A3B decode 4.71 against 4.81 ms, one round), loses a 16-row DFlash step
# (14.41 against 13.89) and, timed alone, trails XLA's chain at every MoE shape (H200,
# 2026-11-30: 19.0 against 16.0 µs at the 30B). The routed-experts kernel reads only the routed
# experts where XLA's ragged_dot reads them all (H200, 2026-11-27, Qwen3-30B-A3B experts: 1 token
# 45 vs 307 µs, 16 tokens 208 vs 414, 512 tokens 391 vs 7124). "pallas" forces every kernel.
# benchmarks/ab_kernels.py re-measures one op on vs off.
AUTO_KERNELS = {"verify_attention": True, "draft_attention": True, "write_kv": True,
                "qkv_norm_rope_write": True, "qkv_norm_rope": False, "fused_matmul": True,
                "routed_experts": True, "route_experts": False, "gated_delta_rule": True}
PROJECTION_KERNEL_MAX_ROWS = 1
PROJECTION_KERNEL_MAX_WIDTH = 3072

# The operations with a Mosaic TPU kernel (pallas_kernels.tpu); "auto" and "pallas" run them on a TPU.
TPU_KERNELS = {"verify_attention": True, "draft_attention": True, "write_kv": True,
               "qkv_norm_rope_write": True, "qkv_norm_rope": True, "fused_matmul": False,
               "routed_experts": True, "route_experts": False, "gated_delta_rule": True}


def on_tpu() -> bool:
    """Whether the programs being traced are for a TPU: jax's default device is one (as when
    ``dflash_jax.aot`` compiles for a TPU topology from another machine), or with none set, its
    default backend is TPUs."""
    device = jax.config.jax_default_device
    platform = getattr(device, "platform", None) or (device if isinstance(device, str) else jax.default_backend())
    return platform == "tpu"


def resolve_impl(impl: AttentionImpl, op: str) -> str:
    """The ``KERNEL_CHOICES`` entry ``impl`` selects for ``op`` on this backend; a clear error
    for combinations that cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    if impl == "interpret":
        return "gpu-interpret"
    if impl == "interpret-tpu":
        return "tpu-interpret" if TPU_KERNELS[op] else "reference"
    if on_tpu():
        return "tpu" if TPU_KERNELS[op] else "reference"
    problem = pk_tuning.kernel_device_problem()
    if impl == "auto":
        return "gpu" if AUTO_KERNELS[op] and problem is None else "reference"
    if problem is not None:
        raise ValueError(f"attention impl 'pallas' cannot run here: {problem} or a TPU; use 'reference' "
                         "(or 'interpret' / 'interpret-tpu', the GPU / TPU kernels interpreted, slow)")
    return "gpu"


def projection_kernel_wins(x, w) -> bool:
    """Whether "auto" runs the projection kernel for x [..., K] @ w [K, N]: a product of at most
    ``PROJECTION_KERNEL_MAX_ROWS`` rows with K or N at most ``PROJECTION_KERNEL_MAX_WIDTH`` (and
    K a multiple of 16, as the kernel needs), which XLA runs as a reduce fusion far from copy
    bandwidth; measured on one device, so not on a shard of a tensor-parallel program (whose
    slices of 8B-wide weights would pass the width test)."""
    rows, k = x.size // x.shape[-1], x.shape[-1]
    on_shard = bool(jax.sharding.get_abstract_mesh().manual_axes)
    return (rows <= PROJECTION_KERNEL_MAX_ROWS and min(w.shape) <= PROJECTION_KERNEL_MAX_WIDTH and k % 16 == 0
            and not on_shard)


def _kernel_kwargs(impl: str) -> dict:
    return {"interpret": impl == "gpu-interpret"}


def verify_attention(q, k_pages, v_pages, page_table, start, *, sliding_window, impl, sinks=None):
    """Causal attention of new tokens (already written to the pages) at start[b] + t; ``sinks``
    [Hq]: per-head sink logits (gpt-oss) or None."""
    impl = resolve_impl(impl, "verify_attention")
    if impl == "reference":
        return pk.paged_verify_attention_reference(q, k_pages, v_pages, page_table, start,
                                                   sliding_window=sliding_window, sinks=sinks)
    if impl.startswith("tpu"):
        return pk_tpu.paged_verify_attention(q, k_pages, v_pages, page_table, start, sliding_window=sliding_window,
                                             sinks=sinks, interpret=impl == "tpu-interpret")
    return pk_gpu.paged_verify_attention(q, k_pages, v_pages, page_table, start,
                                         sliding_window=sliding_window, sinks=sinks, **_kernel_kwargs(impl))


def draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v, block_lens, *,
                    sliding_window, causal, impl):
    """Draft block attention over paged context K/V plus the block's own K/V."""
    impl = resolve_impl(impl, "draft_attention")
    if impl == "reference":
        return pk.paged_draft_attention_reference(q, k_pages, v_pages, page_table, context_lens,
                                                  block_k, block_v, block_lens,
                                                  sliding_window=sliding_window, causal=causal)
    if impl.startswith("tpu"):
        return pk_tpu.paged_draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v,
                                            block_lens, sliding_window=sliding_window, causal=causal,
                                            interpret=impl == "tpu-interpret")
    return pk_gpu.paged_draft_attention(q, k_pages, v_pages, page_table, context_lens, block_k, block_v,
                                        block_lens, sliding_window=sliding_window, causal=causal,
                                        **_kernel_kwargs(impl))


def qkv_norm_rope(qkv, q_norm, k_norm, cos, sin, *, num_heads, num_kv_heads, eps, impl):
    """The draft block's attention input from its fused projection qkv [B, T, (Hq + 2 Hkv) * D]
    and rotary tables cos, sin [B, T, R/2]: (norm_rope(q) [B, T, Hq, D], norm_rope(k) [B, T, Hkv,
    D], v [B, T, Hkv, D]); norms of None are skipped."""
    impl = resolve_impl(impl, "qkv_norm_rope")
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if impl == "reference":
        return pk.qkv_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, **kw)
    if impl.startswith("tpu"):
        return pk_tpu.qkv_norm_rope(qkv, q_norm, k_norm, cos, sin, **kw, interpret=impl == "tpu-interpret")
    return pk_gpu.qkv_norm_rope(qkv, q_norm, k_norm, cos, sin, **kw, **_kernel_kwargs(impl))


def write_kv(k, v, k_norm, cos, sin, positions, k_pages, v_pages, page_table, *, eps, impl):
    """Store norm_rope(k) and v at ``positions`` [B, T]; returns the updated (k_pages, v_pages)."""
    impl = resolve_impl(impl, "write_kv")
    args = (k, v, k_norm, cos, sin, positions, k_pages, v_pages, page_table)
    if impl == "reference":
        return pk.norm_rope_write_reference(*args, eps=eps)
    if impl.startswith("tpu"):
        return pk_tpu.norm_rope_write(*args, eps=eps, interpret=impl == "tpu-interpret")
    return pk_gpu.norm_rope_write(*args, eps=eps, **_kernel_kwargs(impl))


def qkv_norm_rope_write(qkv, q_norm, k_norm, cos, sin, positions, k_pages, v_pages, page_table, *, num_heads,
                        num_kv_heads, eps, impl):
    """A target layer's attention input from its fused projection qkv [B, T, (Hq + 2 Hkv) * D]:
    returns (norm_rope(q) [B, T, Hq, D], k_pages, v_pages with norm_rope(k) and v stored)."""
    impl = resolve_impl(impl, "qkv_norm_rope_write")
    args = (qkv, q_norm, k_norm, cos, sin, positions, k_pages, v_pages, page_table)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if impl == "reference":
        return pk.qkv_norm_rope_write_reference(*args, **kw)
    if impl.startswith("tpu"):
        return pk_tpu.qkv_norm_rope_write(*args, **kw, interpret=impl == "tpu-interpret")
    return pk_gpu.qkv_norm_rope_write(*args, **kw, **_kernel_kwargs(impl))


def project(x, w, *, bias=None, norm_weight=None, eps=1e-6, gated=False, residual=None, sum_over=None, impl):
    """A projection with its glue: [rms_norm(x)] @ w [+ bias] [-> silu(gate) * up] [+ residual].
    The kernel has no bias: with one, it computes the product and the glue runs after it.
    ``sum_over``: a mesh axis over which w is split by rows (tensor parallelism): each shard's
    partial product (rounded to x's dtype, as a product is on one device) is summed in f32 over
    it, then the bias and residual are added once."""
    chosen = resolve_impl(impl, "fused_matmul")
    impl = "reference" if impl == "auto" and not projection_kernel_wins(x, w) else chosen
    if sum_over is not None:
        if gated or norm_weight is not None:
            raise ValueError("a row-parallel projection reads a slice of each row: it cannot norm its input or gate "
                             "its output (those belong to column-parallel projections)")
        if impl == "reference":
            y = pk.fused_matmul_reference(x, w)
        else:
            y = pk_gpu.fused_matmul(x, w, **_kernel_kwargs(impl))
        y = sum_partials(y.astype("float32"), sum_over)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return pk.finish_projection(y.astype(x.dtype), residual, False, x.dtype)
    if impl == "reference":
        return pk.fused_matmul_reference(x, w, norm_weight=norm_weight, eps=eps, bias=bias, gated=gated,
                                         residual=residual)
    if bias is None:
        return pk_gpu.fused_matmul(x, w, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual,
                                   **_kernel_kwargs(impl))
    y = pk_gpu.fused_matmul(x, w, norm_weight=norm_weight, eps=eps, **_kernel_kwargs(impl))
    return pk.finish_projection(y + bias.astype(y.dtype), residual, gated, x.dtype)


def route_experts(x, norm_weight, router, router_bias=None, *, top_k, norm_topk_prob, eps, skew=None, impl):
    """A MoE layer's RMSNorm and routing of rows x [N, H]: (h [N, H], experts [N, k] int32,
    weights [N, k]); ``skew``: experts drawn per row instead (benchmarks, ``pk.routing``)."""
    impl = resolve_impl(impl, "route_experts")
    kw = dict(top_k=top_k, norm_topk_prob=norm_topk_prob, eps=eps, skew=skew)
    if impl == "reference":
        return pk.route_reference(x, norm_weight, router, router_bias, **kw)
    return pk_gpu.route(x, norm_weight, router, router_bias, **kw, **_kernel_kwargs(impl))


def routed_experts(x, experts, weights, gate_up, down, gate_up_bias=None, down_bias=None, *, swiglu_limit=None,
                   swiglu_alpha=1.702, impl):
    """Each token's routed SwiGLU experts, weighted and summed: x [N, H], experts and weights
    [N, k], gate_up [E, H, 2I], down [E, I, H], biases [E, 2I] / [E, H] or None, gpt-oss's
    clamped SwiGLU for a ``swiglu_limit`` -> [N, H]."""
    impl = resolve_impl(impl, "routed_experts")
    kw = dict(swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if impl == "reference":
        return pk.routed_experts_reference(x, experts, weights, gate_up, down, gate_up_bias, down_bias, **kw)
    if impl.startswith("tpu"):
        return pk_tpu.routed_experts(x, experts, weights, gate_up, down, gate_up_bias, down_bias, **kw,
                                     interpret=impl == "tpu-interpret")
    return pk_gpu.routed_experts(x, experts, weights, gate_up, down, gate_up_bias, down_bias, **kw,
                                 **_kernel_kwargs(impl))


RECURRENT_REFERENCE_TOKENS = 16  # up to a verify block: the reference walks tokens; beyond, the chunked form


def gated_delta_rule(q, k, v, g, beta, state, *, with_output=True, with_state=True, impl):
    """The gated delta rule over T tokens from ``state`` (Gated DeltaNet): q, k [B, T, Hk, dk] (raw:
    l2-normalised inside), v [B, T, Hv, dv], g, beta [B, T, Hv] f32, state [B, Hv, dk, dv] f32 ->
    (out [B, T, Hv, dv] or None, new state or None). The reference walks tokens one by one up to
    a verify block's length and runs the chunked form beyond."""
    impl = resolve_impl(impl, "gated_delta_rule")
    kw = dict(with_output=with_output, with_state=with_state)
    if impl == "reference":
        if q.shape[1] <= RECURRENT_REFERENCE_TOKENS:
            return pk.gated_delta_rule_reference(q, k, v, g, beta, state, **kw)
        return pk.chunked_gated_delta_rule_reference(q, k, v, g, beta, state, **kw)
    if impl.startswith("tpu"):
        return pk_tpu.gated_delta_rule(q, k, v, g, beta, state, **kw, interpret=impl == "tpu-interpret")
    return pk_gpu.gated_delta_rule(q, k, v, g, beta, state, **kw, **_kernel_kwargs(impl))

"""Pallas kernels for NVIDIA GPUs (Triton lowering), each with the same arguments and result as its
plain-jnp reference in ``pallas_kernels``; ``tuning`` picks their blocks from the GPU's limits."""

from pallas_kernels.gpu.draft_attention import paged_draft_attention
from pallas_kernels.gpu.fused_matmul import fused_matmul
from pallas_kernels.gpu.gated_delta import gated_delta_rule
from pallas_kernels.gpu.norm_rope import norm_rope_write, qkv_norm_rope, qkv_norm_rope_write
from pallas_kernels.gpu.routed_experts import routed_experts
from pallas_kernels.gpu.routing import route
from pallas_kernels.gpu.split_merge import combine_splits
from pallas_kernels.gpu.verify_attention import paged_verify_attention

__all__ = ["paged_verify_attention", "paged_draft_attention", "gated_delta_rule", "norm_rope_write",
           "qkv_norm_rope", "qkv_norm_rope_write", "routed_experts", "route", "fused_matmul", "combine_splits"]

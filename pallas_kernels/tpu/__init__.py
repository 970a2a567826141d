"""Pallas kernels for TPUs (Mosaic), each with the same arguments and result as its plain-jnp
reference in ``pallas_kernels`` (the references serve both backends)."""

from pallas_kernels.tpu.gated_delta import gated_delta_rule
from pallas_kernels.tpu.norm_rope import norm_rope_write, qkv_norm_rope, qkv_norm_rope_write
from pallas_kernels.tpu.paged_attention import paged_draft_attention, paged_verify_attention
from pallas_kernels.tpu.routed_experts import routed_experts

__all__ = ["paged_verify_attention", "paged_draft_attention", "gated_delta_rule", "norm_rope_write",
           "qkv_norm_rope", "qkv_norm_rope_write", "routed_experts"]

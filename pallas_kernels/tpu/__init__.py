"""Pallas kernels for TPUs (Mosaic), each with the same arguments and result as its plain-jnp
reference in ``pallas_kernels`` (the references serve both backends)."""

from pallas_kernels.tpu.paged_attention import paged_draft_attention, paged_verify_attention

__all__ = ["paged_verify_attention", "paged_draft_attention"]

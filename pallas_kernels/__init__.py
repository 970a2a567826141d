"""Pallas kernels for dflash-jax, grouped by backend, each beside the plain-jnp reference it must match.

- ``pallas_kernels.<operation>`` (``attention``, ``norm_rope``, ``gated_delta``,
  ``routed_experts``, ``routing``, ``fused_matmul``, ``split_merge``, ``paging``): what both backends share, the
  plain-jnp references (``*_reference``), the argument checks and the helpers the model also uses
  (``rms_norm``, ``apply_rope``, ``split_qkv``, ``gather_pages`` / ``write_pages``, ``Mxfp4Weight``),
  exported here; ``sizes``: power-of-two helpers;
- ``pallas_kernels.gpu``: the NVIDIA GPU kernels (Triton lowering), one module per kernel (a
  private kernel and a public jitted wrapper), and ``gpu.tuning``, their blocks from the GPU's limits;
- ``pallas_kernels.tpu``: the TPU kernels (Mosaic), under the same names as the GPU ones.

Page layout everywhere: ``pages[num_pages, page_size, kv_heads, head_dim]`` per layer,
``page_table[batch, pages_per_seq]`` (int32), token at position ``p`` of sequence ``b`` lives
at ``pages[page_table[b, p // page_size], p % page_size]``.
"""

from pallas_kernels.paging import gather_pages, write_pages
from pallas_kernels.norm_rope import (apply_rope, norm_rope_reference, norm_rope_write_reference,
                                      qkv_norm_rope_reference, qkv_norm_rope_write_reference, rms_norm, split_qkv)
from pallas_kernels.split_merge import combine_splits_reference
from pallas_kernels.fused_matmul import finish_projection, fused_matmul_reference
from pallas_kernels.routed_experts import Mxfp4Weight, dequantize_mxfp4, routed_experts_reference
from pallas_kernels.routing import route_reference
from pallas_kernels.attention import paged_draft_attention_reference, paged_verify_attention_reference
from pallas_kernels.gated_delta import chunked_gated_delta_rule_reference, gated_delta_rule_reference

__all__ = [
    "gather_pages",
    "write_pages",
    "apply_rope",
    "rms_norm",
    "norm_rope_reference",
    "norm_rope_write_reference",
    "qkv_norm_rope_reference",
    "qkv_norm_rope_write_reference",
    "split_qkv",
    "combine_splits_reference",
    "finish_projection",
    "fused_matmul_reference",
    "routed_experts_reference",
    "route_reference",
    "Mxfp4Weight",
    "dequantize_mxfp4",
    "paged_verify_attention_reference",
    "paged_draft_attention_reference",
    "gated_delta_rule_reference",
    "chunked_gated_delta_rule_reference",
]

"""Whether the Pallas kernels ``impl`` selects can run given models: checked before compiling,
so that a shape the kernels cannot take is a clear error naming it, not a failed lowering."""

from __future__ import annotations

from typing import Sequence

from pallas_kernels.gpu import tuning as pk_tuning
from pallas_kernels.gpu.verify_attention import padded_group
from pallas_kernels.sizes import is_power_of_2

from dflash_jax.model.config import ModelConfig
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.mlp import MLPSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.ops import AttentionImpl, resolve_impl


def check_kernel_shapes(impl: AttentionImpl, configs: Sequence[ModelConfig], page_size: int, block_size: int, itemsize: int) -> None:
    """Raise before compiling when the kernels ``impl`` selects cannot run these models
    (ModelConfigs) in a dtype of ``itemsize`` bytes: the attention kernels need a power-of-two
    head_dim >= 16 and page size, block <= 128, and one page of K/V beside the draft block in
    shared memory; the norm+RoPE kernels rotary tables of a power-of-two width; the projection
    and routed-experts kernels widths that are multiples of 16; the gated delta rule kernels
    power-of-two head dims >= 16."""
    specs = sorted({layer.mixer for config in configs for layer in config.layers
                    if isinstance(layer.mixer, AttentionSpec)}, key=repr)
    problems = []
    attention = resolve_impl(impl, "verify_attention")
    if attention != "reference":
        for head_dim in sorted({spec.head_dim for spec in specs}):
            if not (is_power_of_2(head_dim) and head_dim >= 16):
                problems.append(f"head_dim {head_dim} (needs a power of two >= 16)")
        if not is_power_of_2(page_size):
            problems.append(f"page_size {page_size} (needs a power of two)")
        if attention.startswith("gpu") and block_size > 128:
            problems.append(f"block_size {block_size} (the draft kernel takes <= 128)")
        if attention.startswith("gpu") and not problems:
            for spec in specs:  # the draft kernel's shared memory (the largest of the attention kernels')
                try:
                    pk_tuning.attention_blocks(
                        q_len=block_size, group=padded_group(spec.num_heads, spec.num_kv_heads),
                        head_dim=spec.head_dim, page_size=page_size, pages_per_seq=1, batch=1,
                        kv_heads=spec.num_kv_heads, itemsize=itemsize,
                        extra_smem_bytes=2 * block_size * spec.head_dim * itemsize)
                except ValueError as error:
                    problems.append(f"page_size {page_size} ({error})")
                    break
    if any(resolve_impl(impl, op).startswith("gpu") for op in ("write_kv", "qkv_norm_rope_write", "qkv_norm_rope")):
        for spec in specs:
            width = spec.rope.rotary_dim // 2
            if not (is_power_of_2(width) and (spec.head_dim // 2) % width == 0):
                problems.append(f"rotary dimension {spec.rope.rotary_dim} of head_dim {spec.head_dim} (the norm+RoPE "
                                "kernels need half of it to be a power of two dividing head_dim / 2)")
    gated_delta = resolve_impl(impl, "gated_delta_rule")
    if gated_delta == "tpu":
        for config in configs:
            for i in config.recurrent_layers:
                spec = config.layers[i].mixer
                problems += [f"linear attention {name} {size} (the TPU gated delta rule kernels need a multiple of 128)"
                             for name, size in (("key_dim", spec.key_dim), ("value_dim", spec.value_dim))
                             if size % 128]
    elif gated_delta.startswith("gpu"):
        for config in configs:
            for i in config.recurrent_layers:
                spec = config.layers[i].mixer
                problems += [f"linear attention {name} {size} (the gated delta rule kernels need a power of two >= 16)"
                             for name, size in (("key_dim", spec.key_dim), ("value_dim", spec.value_dim))
                             if not (is_power_of_2(size) and size >= 16)]
    if resolve_impl(impl, "routed_experts").startswith("gpu"):
        for config in configs:
            widths = {layer.ffn.intermediate_size for layer in config.layers if isinstance(layer.ffn, MoESpec)}
            if widths and config.hidden_size % 16:
                problems.append(f"hidden_size {config.hidden_size} (the routed-experts kernel needs a multiple of 16)")
            problems += [f"moe_intermediate_size {width} (the routed-experts kernel needs a multiple of 16)"
                         for width in sorted(widths) if width % 16]
    if impl != "auto" and resolve_impl(impl, "fused_matmul") != "reference":  # (auto checks each product)

        widths = {}
        for config in configs:
            widths[f"hidden_size {config.hidden_size}"] = config.hidden_size
            for layer in config.layers:
                if isinstance(layer.mixer, AttentionSpec):
                    widths[f"num_heads * head_dim {layer.mixer.q_size}"] = layer.mixer.q_size
                else:
                    widths[f"linear value heads * dim {layer.mixer.value_size}"] = layer.mixer.value_size
                if isinstance(layer.ffn, MLPSpec):  # routed experts do not use this kernel
                    widths[f"intermediate_size {layer.ffn.intermediate_size}"] = layer.ffn.intermediate_size
                elif layer.ffn.shared_intermediate_size is not None:  # a shared expert does
                    width = layer.ffn.shared_intermediate_size
                    widths[f"shared_expert_intermediate_size {width}"] = width
        problems += [f"{name} (the projection kernel needs a multiple of 16)"
                     for name, value in widths.items() if value % 16]
    if problems:
        raise ValueError(f"the Pallas kernels (impl={impl!r}) cannot run {'; '.join(problems)}; "
                         "pass impl='reference' (CLI: --impl reference)")

"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, 235B-A22B): Qwen3
attention, and a routed-expert block in place of the MLP on the layers ``decoder_sparse_step``
and ``mlp_only_layers`` select."""

from __future__ import annotations

import dataclasses

from dflash_jax.model.config import LayerSpec, ModelConfig
from dflash_jax.model.families import hf_decoder
from dflash_jax.model.hf_json import ConfigError, field
from dflash_jax.model.nn.mlp import MLPSpec
from dflash_jax.model.nn.moe import MoESpec

# transformers' Qwen3MoeConfig defaults for absent fields
MAX_POSITION_DEFAULT = 32768


def parse(raw: dict, where: str) -> ModelConfig:
    hf_decoder.check_runnable(raw, where)
    layers = hf_decoder.num_layers(raw, where)
    fields = hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT)
    # Qwen3MoeConfig: 4 KV heads when the field is absent, head_dim hidden // heads; every layer
    # slides under use_sliding_window
    window = hf_decoder.sliding_window(raw, where)
    attention = dataclasses.replace(
        hf_decoder.attention(raw, where, head_dim_default=None, kv_heads_absent=4, qk_norm=True,
                             max_position=fields["max_position_embeddings"]), sliding_window=window)
    num_experts = hf_decoder.num_experts(raw, where)
    sparse = hf_decoder.sparse_layers(raw, where, layers, num_experts)
    moe = MoESpec(num_experts=num_experts, top_k=field(raw, "num_experts_per_tok", where, int),
                  intermediate_size=field(raw, "moe_intermediate_size", where, int),
                  norm_topk_prob=field(raw, "norm_topk_prob", where, bool, False)) if any(sparse) else None
    mlp = MLPSpec(field(raw, "intermediate_size", where, int)) if not all(sparse) else None
    kind = "full_attention" if window is None else "sliding_attention"
    return ModelConfig(family="qwen3_moe", layers=tuple(LayerSpec(attention, moe if is_sparse else mlp, kind)
                                                        for is_sparse in sparse), **fields)


def export_fields(config: ModelConfig) -> dict:
    sparse = [i for i, layer in enumerate(config.layers) if isinstance(layer.ffn, MoESpec)]
    dense = [i for i in range(config.num_layers) if i not in sparse]
    fields = {**hf_decoder.export_fields(config, "qwen3_moe", "Qwen3MoeForCausalLM"),
              "decoder_sparse_step": 1, "mlp_only_layers": dense, "num_experts": 0,
              "use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window}
    if sparse:
        moe = config.layers[sparse[0]].ffn
        if any(config.layers[i].ffn != moe for i in sparse):
            raise ConfigError("the MoE layers differ: Qwen3MoeConfig holds one expert spec")
        fields.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.intermediate_size, norm_topk_prob=moe.norm_topk_prob)
    if dense:
        fields["intermediate_size"] = config.intermediate_size
    return fields

"""LLaMA (``LlamaForCausalLM``: LLaMA-3.1 and its kin): no q/k norms, llama3 RoPE scaling,
optional attention and MLP biases."""

from __future__ import annotations


from dflash_jax.model.config import LayerSpec, ModelConfig
from dflash_jax.model.families import hf_decoder
from dflash_jax.model.hf_json import field
from dflash_jax.model.nn.mlp import MLPSpec

# transformers' LlamaConfig defaults for absent fields
MAX_POSITION_DEFAULT = 2048


def parse(raw: dict, where: str) -> ModelConfig:
    hf_decoder.check_runnable(raw, where)
    layers = hf_decoder.num_layers(raw, where)
    fields = hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT)
    # LlamaConfig: one KV head per query head when the field is absent or null, head_dim hidden // heads
    attention = hf_decoder.attention(raw, where, head_dim_default=None, kv_heads_absent=None, qk_norm=False,
                                     max_position=fields["max_position_embeddings"])
    mlp = MLPSpec(field(raw, "intermediate_size", where, int), bias=field(raw, "mlp_bias", where, bool, False))
    return ModelConfig(family="llama", layers=(LayerSpec(attention, mlp),) * layers, **fields)


def export_fields(config: ModelConfig) -> dict:
    mlps = {layer.ffn for layer in config.layers}
    return {**hf_decoder.export_fields(config, "llama", "LlamaForCausalLM"),
            "intermediate_size": config.intermediate_size, "mlp_bias": any(mlp.bias for mlp in mlps)}

"""Qwen3 (``Qwen3ForCausalLM``): q/k RMSNorm per head, optional sliding-window layers. Also the
layer format of every DFlash draft (z-lab's ``DFlashDraftModel`` subclasses Qwen3)."""

from __future__ import annotations

import dataclasses

from dflash_jax.model.config import LayerSpec, ModelConfig
from dflash_jax.model.families import hf_decoder
from dflash_jax.model.hf_json import ConfigError, field
from dflash_jax.model.nn.mlp import MLPSpec

# transformers' Qwen3Config defaults for absent fields
MAX_POSITION_DEFAULT = 32768


def parse(raw: dict, where: str) -> ModelConfig:
    hf_decoder.check_runnable(raw, where)
    if field(raw, "mlp_bias", where, bool, False):
        raise ConfigError(f"{where}: mlp_bias=true is not supported for Qwen3 (its MLP has no biases)")
    layers = hf_decoder.num_layers(raw, where)
    fields = hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT)
    # Qwen3Config: 32 KV heads when the field is absent, head_dim 128 (not hidden // heads)
    attention = hf_decoder.attention(raw, where, head_dim_default=128, kv_heads_absent=32, qk_norm=True,
                                     max_position=fields["max_position_embeddings"])
    mlp = MLPSpec(field(raw, "intermediate_size", where, int))
    # without explicit layer_types, layers from max_window_layers on slide
    kinds = hf_decoder.layer_kinds(raw, where, layers, hf_decoder.sliding_window(raw, where),
                                   first_sliding=field(raw, "max_window_layers", where, int, 28))
    specs = tuple(LayerSpec(dataclasses.replace(attention, sliding_window=window), mlp, kind) for kind, window in kinds)
    return ModelConfig(family="qwen3", layers=specs, **fields)


def export_fields(config: ModelConfig) -> dict:
    sliding = config.sliding_window is not None
    return {**hf_decoder.export_fields(config, "qwen3", "Qwen3ForCausalLM"),
            "intermediate_size": config.intermediate_size, "layer_types": list(config.layer_types),
            "use_sliding_window": sliding, "sliding_window": config.sliding_window}

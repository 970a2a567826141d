"""Qwen3 (``Qwen3ForCausalLM``): q/k RMSNorm per head, optional sliding-window layers. Also the
layer format of every DFlash draft (z-lab's ``DFlashDraftModel`` subclasses Qwen3)."""

from __future__ import annotations

import dataclasses

from dflash_jax.config import LayerSpec, ModelConfig
from dflash_jax.families import hf_decoder
from dflash_jax.hf_json import ConfigError, field
from dflash_jax.nn.mlp import MLPSpec

# transformers' Qwen3Config defaults for absent fields
MAX_POSITION_DEFAULT = 32768


def layer_kinds(raw: dict, where: str, layers: int) -> list[tuple[str, int | None]]:
    """transformers' Qwen3Config: the window (4096 when the field is absent, none when it is null)
    exists only with use_sliding_window; without explicit layer_types, layers from
    max_window_layers on slide."""
    window = None
    if field(raw, "use_sliding_window", where, bool, False):
        window = field(raw, "sliding_window", where, int, None) if "sliding_window" in raw else 4096
    return hf_decoder.layer_kinds(raw, where, layers, window,
                                  first_sliding=field(raw, "max_window_layers", where, int, 28))


def parse(raw: dict, where: str) -> ModelConfig:
    hf_decoder.check_runnable(raw, where)
    if field(raw, "mlp_bias", where, bool, False):
        raise ConfigError(f"{where}: mlp_bias=true is not supported for Qwen3 (its MLP has no biases)")
    layers = hf_decoder.num_layers(raw, where)
    # Qwen3Config: 32 KV heads when the field is absent, head_dim 128 (not hidden // heads)
    attention = hf_decoder.attention(raw, where, head_dim_default=128, kv_heads_absent=32, qk_norm=True,
                                     max_position_default=MAX_POSITION_DEFAULT)
    mlp = MLPSpec(field(raw, "intermediate_size", where, int))
    specs = tuple(LayerSpec(dataclasses.replace(attention, sliding_window=window), mlp, kind)
                  for kind, window in layer_kinds(raw, where, layers))
    return ModelConfig(family="qwen3", layers=specs,
                       **hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT))


def export_fields(config: ModelConfig) -> dict:
    sliding = config.sliding_window is not None
    return {**hf_decoder.export_fields(config, "qwen3", "Qwen3ForCausalLM"),
            "intermediate_size": config.intermediate_size, "layer_types": list(config.layer_types),
            "use_sliding_window": sliding, "sliding_window": config.sliding_window}

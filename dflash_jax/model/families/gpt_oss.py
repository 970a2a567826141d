"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): attention with q/k/v/o biases and a
learned sink logit per head, no q/k norm, YaRN RoPE, layers alternating a 128-token sliding
window (even layers) and full attention, and a routed-expert block on every layer whose router
and experts carry biases and whose SwiGLU is clamped (``MoESpec.swiglu_limit``). The experts'
gate and up columns are interleaved in the checkpoint (``tensors``)."""

from __future__ import annotations

import dataclasses

from dflash_jax.model.config import LayerSpec, ModelConfig
from dflash_jax.model.families import hf_decoder
from dflash_jax.model.hf_json import ConfigError, field
from dflash_jax.model.nn.moe import MoESpec

# transformers' GptOssConfig defaults for absent fields
MAX_POSITION_DEFAULT = 131072
ROPE_THETA_DEFAULT = 150000.0
YARN_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
SLIDING_WINDOW_DEFAULT = 128
SWIGLU_LIMIT_DEFAULT = 7.0
SWIGLU_ALPHA_DEFAULT = 1.702


# transformers' quantization_config of a released gpt-oss checkpoint: every tensor but the experts' full precision
MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def experts_in_mxfp4(raw: dict, where: str) -> bool:
    """Whether the checkpoint stores its experts in MXFP4, as gpt-oss releases them
    (``quant_method`` "mxfp4"); any other quantization is refused. ``hidden_act`` is not read:
    the experts' activation is the family's own."""
    quantization = raw.get("quantization_config")
    if not quantization:
        return False
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    if method != "mxfp4":
        raise ConfigError(f"{where}: quantization_config quant_method '{method}' is not supported for gpt-oss "
                          "(only its released mxfp4 experts)")
    return True


def with_defaults(raw: dict) -> dict:
    """``raw`` with GptOssConfig's defaults where the fields are absent: YaRN (factor 32, not
    truncated), rope_theta 150000, alternating sliding (even layers) and full layers."""
    raw = dict(raw)
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw["rope_scaling"] = dict(YARN_DEFAULT)
    if raw.get("rope_theta") is None and (raw.get("rope_parameters") or {}).get("rope_theta") is None:
        raw["rope_theta"] = ROPE_THETA_DEFAULT
    if raw.get("layer_types") is None and isinstance(raw.get("num_hidden_layers"), int):
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(raw["num_hidden_layers"])]
    return raw


def parse(raw: dict, where: str) -> ModelConfig:
    mxfp4 = experts_in_mxfp4(raw, where)
    raw = with_defaults(raw)
    layers = hf_decoder.num_layers(raw, where)
    fields = hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT)
    fields["rms_norm_eps"] = field(raw, "rms_norm_eps", where, float, 1e-5)
    attention = dataclasses.replace(
        hf_decoder.attention(raw, where, head_dim_default=64, kv_heads_absent=8, qk_norm=False,
                             max_position=fields["max_position_embeddings"]),
        bias=field(raw, "attention_bias", where, bool, True), sinks=True)
    # absent: 128; null: the sliding layers attend fully (as transformers reads it)
    window = field(raw, "sliding_window", where, int, None) if "sliding_window" in raw else SLIDING_WINDOW_DEFAULT
    kinds = hf_decoder.layer_kinds(raw, where, layers, window, first_sliding=0)
    moe = MoESpec(num_experts=hf_decoder.num_experts(raw, where), top_k=field(raw, "num_experts_per_tok", where, int, 4),
                  intermediate_size=field(raw, "intermediate_size", where, int), norm_topk_prob=True, bias=True,
                  swiglu_limit=field(raw, "swiglu_limit", where, float, SWIGLU_LIMIT_DEFAULT),
                  swiglu_alpha=field(raw, "swiglu_alpha", where, float, SWIGLU_ALPHA_DEFAULT), mxfp4=mxfp4)
    if moe.num_experts < 1:
        raise ConfigError(f"{where}: gpt-oss needs num_local_experts >= 1, got {moe.num_experts}")
    if mxfp4 and fields["hidden_size"] % 32:
        raise ConfigError(f"{where}: MXFP4 experts need a hidden_size that is a multiple of 32 (one scale per 32 "
                          f"inputs), got {fields['hidden_size']}")
    specs = tuple(LayerSpec(dataclasses.replace(attention, sliding_window=w), moe, kind) for kind, w in kinds)
    return ModelConfig(family="gpt_oss", layers=specs, **fields)


def export_fields(config: ModelConfig) -> dict:
    moe = config.layers[0].ffn
    if any(layer.ffn != moe for layer in config.layers) or not isinstance(moe, MoESpec):
        raise ConfigError("gpt-oss layers share one expert spec")
    fields = hf_decoder.export_fields(config, "gpt_oss", "GptOssForCausalLM")
    fields.pop("hidden_act")
    return {**fields, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "intermediate_size": moe.intermediate_size, "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": moe.swiglu_alpha, "layer_types": list(config.layer_types),
            "sliding_window": config.sliding_window, **({"quantization_config": MXFP4_QUANTIZATION} if moe.mxfp4 else {})}

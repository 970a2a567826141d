"""What the LLaMA-style families (Qwen3, LLaMA, Qwen3-MoE) read and write alike in config.json:
the shared decoder fields, the attention, and their export. Each family module adds only its
defaults and differences (transformers' config classes differ in defaults: a missing field must
mean here what it means there)."""

from __future__ import annotations

from typing import Any

from dflash_jax.model.hf_json import ConfigError, field, int_list
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.rope import rope_from_hf, rope_to_hf


def check_runnable(raw: dict, where: str) -> None:
    """ConfigError for what no family here runs: quantized weights, an activation other than SiLU."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(f"{where}: quantized checkpoints (quantization_config, quant_method "
                          f"'{method}') are not supported; use the bfloat16 release")
    act = field(raw, "hidden_act", where, str, "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act '{act}' is not supported (only silu)")


def decoder_fields(raw: dict, where: str, *, max_position_default: int) -> dict[str, Any]:
    """The ModelConfig fields outside the layers (everything but ``family`` and ``layers``)."""
    return dict(vocab_size=field(raw, "vocab_size", where, int), hidden_size=field(raw, "hidden_size", where, int),
                rms_norm_eps=field(raw, "rms_norm_eps", where, float, 1e-6),
                tie_word_embeddings=field(raw, "tie_word_embeddings", where, bool, False),
                max_position_embeddings=field(raw, "max_position_embeddings", where, int, max_position_default),
                eos_token_ids=int_list(raw, "eos_token_id", where, ()))


def num_layers(raw: dict, where: str) -> int:
    layers = field(raw, "num_hidden_layers", where, int)
    if layers < 1:
        raise ConfigError(f"{where}: num_hidden_layers must be >= 1, got {layers}")
    return layers


def attention(raw: dict, where: str, *, head_dim_default: int | None, kv_heads_absent: int | None,
              qk_norm: bool, max_position: int) -> AttentionSpec:
    """The attention of every layer (no window: the family sets it per layer). ``head_dim_default``
    None means hidden_size // num_attention_heads; ``kv_heads_absent`` is the KV head count when
    the field is absent (None: one per query head, as when it is null); ``max_position`` is the
    parsed ``max_position_embeddings`` (scaled RoPE may read it)."""
    heads = field(raw, "num_attention_heads", where, int)
    if raw.get("num_key_value_heads") is not None:
        kv_heads = field(raw, "num_key_value_heads", where, int)
    elif "num_key_value_heads" in raw or kv_heads_absent is None:
        kv_heads = heads  # null: one KV head per query head
    else:
        kv_heads = kv_heads_absent
    if head_dim_default is None:
        head_dim_default = field(raw, "hidden_size", where, int) // max(heads, 1)
    head_dim = field(raw, "head_dim", where, int, head_dim_default)
    rope = rope_from_hf(raw, head_dim, max_position, where)
    partial = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor {partial} is not used by this architecture "
                          "(it rotates whole heads): remove it")
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope=rope, qk_norm=qk_norm,
                         bias=field(raw, "attention_bias", where, bool, False))


def sliding_window(raw: dict, where: str) -> int | None:
    """The window of the sliding layers, as transformers' Qwen3 configs read it: only under
    ``use_sliding_window``, 4096 when the ``sliding_window`` field is absent, none when null."""
    if not field(raw, "use_sliding_window", where, bool, False):
        return None
    return field(raw, "sliding_window", where, int, None) if "sliding_window" in raw else 4096


def layer_kinds(raw: dict, where: str, layers: int, window: int | None, *,
                first_sliding: int) -> list[tuple[str, int | None]]:
    """Each layer's (``layer_types`` label, window): ``layer_types`` when given, else layers from
    ``first_sliding`` on slide (when there is a window). Without a window a "sliding_attention"
    layer attends fully, as in transformers."""
    layer_types = field(raw, "layer_types", where, list, None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                       for i in range(layers)]
    if len(layer_types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {layers} layers")
    unknown = sorted({str(kind) for kind in layer_types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"{where}: layer_types: unknown layer type '{unknown[0]}' (this architecture has "
                          "full_attention and sliding_attention layers)")
    return [(kind, window if kind == "sliding_attention" else None) for kind in layer_types]


def num_experts(raw: dict, where: str) -> int:
    """The expert count is required: a MoE config without it is not one this library can trust
    (transformers would fill in Qwen3-30B-A3B's 128 and fail on the weights). 0, as in
    transformers, makes every layer dense."""
    given = {name: field(raw, name, where, int) for name in ("num_experts", "num_local_experts")
             if raw.get(name) is not None}
    if not given:
        raise ConfigError(f"{where}: required field 'num_experts' (or num_local_experts) is missing "
                          "(a MoE config names its expert count)")
    if len(set(given.values())) > 1:
        raise ConfigError(f"{where}: num_experts {given['num_experts']} and num_local_experts "
                          f"{given['num_local_experts']} disagree (one is the other's alias): keep one")
    return next(iter(given.values()))


def sparse_layers(raw: dict, where: str, layers: int, num_experts: int) -> list[bool]:
    """Which layers route experts, as transformers' Qwen3-MoE and Qwen3-Next read it: every
    ``decoder_sparse_step``-th, except ``mlp_only_layers``, none without experts."""
    step = field(raw, "decoder_sparse_step", where, int, 1)
    if step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step must be >= 1, got {step}")
    dense_only = set(int_list(raw, "mlp_only_layers", where, ()))
    outside = sorted(i for i in dense_only if not 0 <= i < layers)
    if outside:
        raise ConfigError(f"{where}: mlp_only_layers {outside} are outside the {layers} layers")
    return [num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers)]


def export_fields(config, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json fields these families share, from a config whose layers share one attention
    spec (``ModelConfig.attention`` raises otherwise)."""
    attention = config.attention
    rope = rope_to_hf(attention.rope, attention.head_dim)
    fields = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "hidden_act": "silu", "attention_bias": attention.bias,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": attention.rope.theta, "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if attention.rope.kind != "default":
        fields["rope_scaling"] = dict(rope)  # what readers before transformers 5 look for
    if config.eos_token_ids:
        ids = list(config.eos_token_ids)
        fields["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return fields

"""Qwen3.5 / Qwen3.6 and Qwen3-Next hybrids: three of every four layers (``layer_types``, or
``full_attention_interval``) are Gated DeltaNet linear attention, the rest gated full attention
(q_proj also yields a per-head output gate; partial RoPE; q/k norms). All decoder norms are
zero-centred (x̂·(1 + w)). The feed-forward block is a dense SwiGLU (Qwen3.5), routed experts with
a gated shared expert on every layer (Qwen3.5-MoE), or either per layer (Qwen3-Next, as
Qwen3-MoE chooses).

Releases (``Qwen3_5ForConditionalGeneration``) keep the decoder's fields in ``text_config`` and
its weights under ``model.language_model.``; their vision tower and multi-token-prediction head
are skipped (text generation only). Text-position RoPE: mrope sections all see the same
position for text, which is 1-D RoPE.
"""

from __future__ import annotations

from dflash_jax.model.config import LayerSpec, ModelConfig
from dflash_jax.model.families import hf_decoder
from dflash_jax.model.hf_json import ConfigError, field
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.mlp import MLPSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.nn.rope import rope_from_hf, rope_to_hf

# transformers' config defaults for absent fields (Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig)
MAX_POSITION_DEFAULT = 32768
FULL_ATTENTION_INTERVAL_DEFAULT = 4
PARTIAL_ROTARY_DEFAULT = 0.25
LAYER_KINDS = ("linear_attention", "full_attention")
KV_HEADS_DEFAULT = {"qwen3_5": 4, "qwen3_5_moe": 2, "qwen3_next": 2}


def text_config(raw: dict, where: str) -> tuple[dict, str]:
    """The decoder's fields: a release's ``text_config`` (with the top level's tie and eos
    fields where it lacks them), else the config itself."""
    if "text_config" not in raw:
        return raw, where
    text = field(raw, "text_config", where, dict)
    inherited = {key: raw[key] for key in ("tie_word_embeddings", "eos_token_id") if key in raw and key not in text}
    return {**inherited, **text}, f"{where} text_config"


def layer_kinds(raw: dict, where: str, layers: int) -> list[str]:
    kinds = field(raw, "layer_types", where, list, None)
    if kinds is None:
        interval = field(raw, "full_attention_interval", where, int, FULL_ATTENTION_INTERVAL_DEFAULT)
        if interval < 1:
            raise ConfigError(f"{where}: full_attention_interval must be >= 1, got {interval}")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise ConfigError(f"{where}: layer_types has {len(kinds)} entries for {layers} layers")
    unknown = sorted({str(kind) for kind in kinds} - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"{where}: layer_types: unknown layer type '{unknown[0]}' (this architecture has "
                          "linear_attention and full_attention layers)")
    return kinds


def _attention(raw: dict, where: str, family: str, max_position: int) -> AttentionSpec:
    heads = field(raw, "num_attention_heads", where, int)
    kv_heads = field(raw, "num_key_value_heads", where, int, KV_HEADS_DEFAULT[family])
    head_dim = field(raw, "head_dim", where, int, 256)
    rope_params = field(raw, "rope_parameters", where, dict, None) or field(raw, "rope_scaling", where, dict, None) or {}
    partial = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULT))
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    rope = rope_from_hf(raw, int(head_dim * partial), max_position, where)
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope=rope, qk_norm=True,
                         bias=field(raw, "attention_bias", where, bool, False), output_gate=True)


def _linear_attention(raw: dict, where: str) -> GatedDeltaNetSpec:
    return GatedDeltaNetSpec(num_key_heads=field(raw, "linear_num_key_heads", where, int),
                             num_value_heads=field(raw, "linear_num_value_heads", where, int),
                             key_dim=field(raw, "linear_key_head_dim", where, int),
                             value_dim=field(raw, "linear_value_head_dim", where, int),
                             conv_kernel=field(raw, "linear_conv_kernel_dim", where, int, 4))


def _moe(raw: dict, where: str, norm_topk_prob: bool) -> MoESpec:
    return MoESpec(num_experts=field(raw, "num_experts", where, int), top_k=field(raw, "num_experts_per_tok", where, int),
                   intermediate_size=field(raw, "moe_intermediate_size", where, int), norm_topk_prob=norm_topk_prob,
                   shared_intermediate_size=field(raw, "shared_expert_intermediate_size", where, int))


def _feed_forwards(raw: dict, where: str, family: str, layers: int) -> list[MLPSpec | MoESpec]:
    if family == "qwen3_5":
        return [MLPSpec(field(raw, "intermediate_size", where, int))] * layers
    if family == "qwen3_5_moe":  # its router always renormalises the top k
        return [_moe(raw, where, norm_topk_prob=True)] * layers
    # Qwen3-Next: routed on the layers decoder_sparse_step and mlp_only_layers select
    sparse = hf_decoder.sparse_layers(raw, where, layers, field(raw, "num_experts", where, int))
    moe = _moe(raw, where, field(raw, "norm_topk_prob", where, bool, True)) if any(sparse) else None
    mlp = MLPSpec(field(raw, "intermediate_size", where, int)) if not all(sparse) else None
    return [moe if is_sparse else mlp for is_sparse in sparse]


def parser(family: str, name: str):
    """The config.json parser of a ``family`` (``qwen3_5``, ``qwen3_5_moe`` or ``qwen3_next``)
    whose ModelConfig is registry entry ``name`` (which also says which tensor names it uses)."""

    def parse(raw: dict, where: str) -> ModelConfig:
        raw, where = text_config(raw, where)
        hf_decoder.check_runnable(raw, where)
        layers = hf_decoder.num_layers(raw, where)
        fields = hf_decoder.decoder_fields(raw, where, max_position_default=MAX_POSITION_DEFAULT)
        attention = _attention(raw, where, family, fields["max_position_embeddings"])
        linear = _linear_attention(raw, where)
        ffns = _feed_forwards(raw, where, family, layers)
        specs = tuple(LayerSpec(attention if kind == "full_attention" else linear, ffn, kind)
                      for kind, ffn in zip(layer_kinds(raw, where, layers), ffns))
        return ModelConfig(family=name, layers=specs, zero_centred_norms=True, **fields)

    return parse


def export_fields(config: ModelConfig, *, model_type: str, architecture: str, text_model_type: str | None) -> dict:
    """config.json of a hybrid: top level (text-only save) or a release's ``text_config``."""
    attention = config.attention
    linears = {config.layers[i].mixer for i in config.recurrent_layers}
    if len(linears) != 1:
        raise ConfigError("a hybrid's linear-attention layers must share one spec (the config holds one)")
    linear = linears.pop()
    rope = rope_to_hf(attention.rope, attention.head_dim)
    rope["partial_rotary_factor"] = attention.rope.rotary_dim / attention.head_dim
    text = {
        "model_type": text_model_type or model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "hidden_act": "silu", "attention_bias": attention.bias,
        "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": config.tie_word_embeddings,
        "layer_types": list(config.layer_types), "linear_num_key_heads": linear.num_key_heads,
        "linear_num_value_heads": linear.num_value_heads, "linear_key_head_dim": linear.key_dim,
        "linear_value_head_dim": linear.value_dim, "linear_conv_kernel_dim": linear.conv_kernel,
    }
    if config.eos_token_ids:
        ids = list(config.eos_token_ids)
        text["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    moes = [layer.ffn for layer in config.layers if isinstance(layer.ffn, MoESpec)]
    dense = [i for i, layer in enumerate(config.layers) if isinstance(layer.ffn, MLPSpec)]
    if moes:
        moe = moes[0]
        if any(m != moe for m in moes):
            raise ConfigError("the MoE layers differ: the config holds one expert spec")
        text.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                    moe_intermediate_size=moe.intermediate_size,
                    shared_expert_intermediate_size=moe.shared_intermediate_size)
        if model_type == "qwen3_next":
            text.update(norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)
    if dense:
        text["intermediate_size"] = config.intermediate_size
    if text_model_type is None:
        return {"architectures": [architecture], **text}
    return {"architectures": [architecture], "model_type": model_type, "text_config": text,
            "tie_word_embeddings": config.tie_word_embeddings}


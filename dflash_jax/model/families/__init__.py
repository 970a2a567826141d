"""Target families as data: each contributes a config.json parser, its HF tensor names and its
export fields; the one decoder (``dflash_jax.model.nn.decoder``) runs them all.

A folder's family is chosen by its ``architectures`` (else its ``model_type``); anything else is
a ConfigError that lists what is supported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from dflash_jax.model.config import ModelConfig
from dflash_jax.model.families import gpt_oss, llama, qwen3, qwen3_5, qwen3_moe
from dflash_jax.model.families.tensors import GPT_OSS, LLAMA_STYLE, TensorNames
from dflash_jax.model.hf_json import ConfigError, architectures


@dataclasses.dataclass(frozen=True)
class Family:
    """``name`` is ``ModelConfig.family``; ``architectures`` and ``model_types`` are what a
    config.json calls it; ``parse(raw, where)`` makes its ModelConfig, ``export_fields(config)``
    the config.json that transformers reads back; ``names`` its tensor names."""

    name: str
    label: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: Callable[[dict, str], ModelConfig]
    export_fields: Callable[[ModelConfig], dict[str, Any]]
    names: TensorNames = LLAMA_STYLE


# Qwen3.5 / Qwen3.6 / Qwen3-Next: releases keep the decoder under language_model
HYBRID = dataclasses.replace(LLAMA_STYLE, ignored=("mtp.",))
HYBRID_RELEASE = dataclasses.replace(
    HYBRID, embed="model.language_model.embed_tokens.weight", final_norm="model.language_model.norm.weight",
    layer="model.language_model.layers.{}.", ignored=("model.visual.", "mtp."))


def _hybrid(name: str, label: str, family: str, architecture: str, model_type: str, names: TensorNames,
            text_model_type: str | None = None) -> Family:
    return Family(name, label, (architecture,), (model_type,), qwen3_5.parser(family, name),
                  functools.partial(qwen3_5.export_fields, model_type=model_type, architecture=architecture,
                                    text_model_type=text_model_type), names)


FAMILIES = (
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qwen3.parse, qwen3.export_fields),
    Family("llama", "LLaMA", ("LlamaForCausalLM",), ("llama",), llama.parse, llama.export_fields),
    Family("qwen3_moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qwen3_moe.parse,
           qwen3_moe.export_fields),
    _hybrid("qwen3_5", "Qwen3.5 / Qwen3.6 (text-only save)", "qwen3_5", "Qwen3_5ForCausalLM", "qwen3_5_text", HYBRID),
    _hybrid("qwen3_5_moe", "Qwen3.5-MoE / Qwen3.6-MoE (text-only save)", "qwen3_5_moe", "Qwen3_5MoeForCausalLM",
            "qwen3_5_moe_text", HYBRID),
    _hybrid("qwen3_5_release", "Qwen3.5 / Qwen3.6", "qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5",
            HYBRID_RELEASE, text_model_type="qwen3_5_text"),
    _hybrid("qwen3_5_moe_release", "Qwen3.5-MoE / Qwen3.6-MoE", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
            "qwen3_5_moe", HYBRID_RELEASE, text_model_type="qwen3_5_moe_text"),
    _hybrid("qwen3_next", "Qwen3-Next", "qwen3_next", "Qwen3NextForCausalLM", "qwen3_next",
            dataclasses.replace(HYBRID, linear_fused=True)),
    Family("gpt_oss", "gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), gpt_oss.parse, gpt_oss.export_fields, GPT_OSS),
)


def supported() -> str:
    """The supported architectures, for error messages."""
    return ", ".join(name for family in FAMILIES for name in family.architectures)


def get(name: str) -> Family:
    """The family called ``name`` (``ModelConfig.family``)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family '{name}' (known: {', '.join(f.name for f in FAMILIES)})")


def find_family(raw: dict[str, Any]) -> Family | None:
    """The family of a config.json: the first of its ``architectures`` that one names, else its
    ``model_type``; None when neither matches."""
    for name in architectures(raw):
        for family in FAMILIES:
            if name in family.architectures:
                return family
    return next((family for family in FAMILIES if raw.get("model_type") in family.model_types), None)


def parse_target(raw: dict[str, Any], where: str) -> ModelConfig:
    """A target's ModelConfig from its config.json; ConfigError naming what is not supported."""
    family = find_family(raw)
    if family is None:
        names = architectures(raw)
        what = f"architecture {', '.join(names)}" if names else f"model_type '{raw.get('model_type')}'"
        raise ConfigError(f"{where}: {what} is not supported (supported: {supported()})")
    return family.parse(raw, where)

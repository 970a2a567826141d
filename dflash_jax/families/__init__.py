"""Target families as data: each contributes a config.json parser, its HF tensor names and its
export fields; the one decoder (``dflash_jax.nn.decoder``) runs them all.

A folder's family is chosen by its ``architectures`` (else its ``model_type``); anything else is
a ConfigError that lists what is supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dflash_jax.config import ModelConfig
from dflash_jax.families import llama, qwen3, qwen3_moe
from dflash_jax.families.tensors import LLAMA_STYLE, TensorNames
from dflash_jax.hf_json import ConfigError, architectures


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


FAMILIES = (
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qwen3.parse, qwen3.export_fields),
    Family("llama", "LLaMA", ("LlamaForCausalLM",), ("llama",), llama.parse, llama.export_fields),
    Family("qwen3_moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qwen3_moe.parse,
           qwen3_moe.export_fields),
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

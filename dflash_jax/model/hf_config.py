"""Reading config.json: a target's by the family it names (``dflash_jax.model.families``), a
DFlash draft's (z-lab or speculators) as Qwen3 layers plus how it reads the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dflash_jax.model import families
from dflash_jax.model.config import DraftConfig, ModelConfig, build_target_layer_ids
from dflash_jax.model.families import qwen3
from dflash_jax.model.hf_json import ConfigError, architectures, field, int_list, read_config_json
from dflash_jax.model.nn.dynamic_conv import ConvSpec
from dflash_jax.model.selector import SelectorSpec


def target_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """A target's config.json, parsed by the family its ``architectures`` (or ``model_type``)
    names; ConfigError listing the supported ones for any other."""
    return families.parse_target(raw, where)


def is_draft_config(raw: dict[str, Any]) -> bool:
    """A DFlash draft's config.json (z-lab or speculators), as opposed to a target's."""
    return (raw.get("speculators_model_type") is not None or "dflash_config" in raw
            or any(name.startswith("DFlash") for name in architectures(raw)))


def draft_layers_from_hf(raw: dict[str, Any], where: str) -> ModelConfig:
    """A draft's layer stack: Qwen3 layers (z-lab's DFlashDraftModel subclasses Qwen3), whatever
    family its target is."""
    return qwen3.parse(raw, where)


def draft_config_from_hf(raw: dict[str, Any], where: str = "draft config.json") -> DraftConfig:
    """A DFlash draft's config.json (z-lab DFlash / DFlash2, or speculators); ConfigError for any other."""
    if raw.get("speculators_model_type") is not None:
        return _speculators_draft_config(raw, where)
    if not is_draft_config(raw):
        raise ConfigError(f"{where}: not a DFlash draft (architectures lacks 'DFlashDraftModel' "
                          "and there is no dflash_config or speculators_model_type)")
    other = [name for name in architectures(raw)
             if name.startswith("DFlash") and name not in ("DFlashDraftModel", "DFlash2DraftModel")]
    if other:
        raise ConfigError(f"{where}: architecture {other[0]} is not supported; this library runs "
                          "DFlashDraftModel and DFlash2DraftModel drafts (z-lab) and speculators 'dflash' "
                          "drafts")
    dflash2 = "DFlash2DraftModel" in architectures(raw)
    dflash = field(raw, "dflash_config", where, dict, {})

    def at(name):
        """(mapping, name, where) of a field: dflash_config's copy when it has one, else the
        top level's."""
        return (dflash, name, f"{where} dflash_config") if dflash.get(name) is not None else (raw, name, where)

    model = draft_layers_from_hf(raw, where)
    selector = None
    if dflash2:  # DFlash2: a convolution around each sublayer, and the candidate selector
        conv = ConvSpec(field(*at("conv_kernel_size"), int), field(*at("conv_group_size"), int))
        conv.groups(model.hidden_size)
        model = model.with_layers(tuple(dataclasses.replace(layer, conv=conv) for layer in model.layers))
        selector = SelectorSpec(rank=field(*at("selector_rank"), int), top_k=field(*at("selector_top_k"), int))
    ids = int_list(*at("target_layer_ids"), None)
    num_target_layers = field(raw, "num_target_layers", where, int, None)
    if ids is None:
        if num_target_layers is None:
            raise ConfigError(f"{where}: needs 'dflash_config.target_layer_ids' or 'num_target_layers'")
        ids = build_target_layer_ids(num_target_layers, model.num_layers)
    mask = field(*at("mask_token_id"), int, None)
    if mask is None:
        raise ConfigError(f"{where}: required field 'dflash_config.mask_token_id' is missing")
    is_causal = field(raw, "is_causal", where, bool, None)
    causal = tuple(kind == "sliding_attention" if is_causal is None else is_causal
                   for kind in model.layer_types)
    return DraftConfig(
        model=model,
        block_size=field(*at("block_size"), int, 16),
        mask_token_id=mask,
        target_layer_ids=ids,
        num_target_layers=num_target_layers,
        input_embedding_scale=field(*at("input_embedding_scale"), float, 1.0),
        output_multiplier=field(*at("output_multiplier"), float, 1.0),
        final_logit_softcapping=field(*at("final_logit_softcapping"), float, None) or None,
        causal_layers=causal,
        selector=selector,
    )

def _speculators_draft_config(raw: dict[str, Any], where: str) -> DraftConfig:
    kind = raw["speculators_model_type"]
    if kind != "dflash":
        raise ConfigError(f"{where}: speculators_model_type '{kind}' is not a DFlash draft")
    if field(raw, "sample_from_anchor", where, bool, False):
        # its block slot k predicts token t+k+1 rather than t+k: every proposal would miss
        raise ConfigError(f"{where}: sample_from_anchor=true drafts (slot k predicts the token after "
                          "the usual one) are not supported")
    layer_raw = dict(field(raw, "transformer_layer_config", where, dict))
    # Some exporters put the layers' attention kinds at the top level instead.
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        if key not in layer_raw and key in raw:
            layer_raw[key] = raw[key]
    model = draft_layers_from_hf(layer_raw, f"{where} transformer_layer_config")
    aux = int_list(raw, "aux_hidden_state_layer_ids", where)
    if min(aux, default=1) < 1:
        raise ConfigError(f"{where}: aux_hidden_state_layer_ids {list(aux)} must be >= 1 (id k is the "
                          "output of target decoder layer k; 0, the embedding output, cannot be tapped)")
    draft_vocab = field(raw, "draft_vocab_size", where, int, None)
    # speculators: full-attention layers are bidirectional; sliding ones causal unless
    # sliding_window_non_causal (the same default as the z-lab reference).
    non_causal_swa = field(raw, "sliding_window_non_causal", where, bool, False)
    return DraftConfig(
        model=model,
        block_size=field(raw, "block_size", where, int),
        mask_token_id=field(raw, "mask_token_id", where, int),
        target_layer_ids=tuple(i - 1 for i in aux),
        draft_vocab_size=None if draft_vocab in (None, model.vocab_size) else draft_vocab,
        causal_layers=tuple(k == "sliding_attention" and not non_causal_swa for k in model.layer_types),
        source_format="speculators",
    )


def load_target_config(directory: str | Path) -> ModelConfig:
    raw = read_config_json(directory)
    if is_draft_config(raw):
        raise ConfigError(f"{directory} holds a DFlash draft, not a target; pass it as the draft (--draft)")
    return target_config_from_hf(raw, f"{directory}/config.json")


def load_draft_config(directory: str | Path) -> DraftConfig:
    raw = read_config_json(directory)
    family = None if is_draft_config(raw) else families.find_family(raw)
    if family is not None:
        raise ConfigError(f"{directory} holds a {family.label} target, not a DFlash draft; "
                          "pass it as the target (--target)")
    return draft_config_from_hf(raw, f"{directory}/config.json")

"""Frozen model configurations parsed from HF ``config.json`` files (Qwen3 target, DFlash draft)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the offending field named."""


def _require(raw: dict, name: str, where: str):
    if name not in raw or raw[name] is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    return raw[name]


def _rope_theta(raw: dict, where: str) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only default RoPE)")
    # transformers 5 reads rope_parameters first; the top-level rope_theta is the older form
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{where}: required field 'rope_theta' (or rope_parameters.rope_theta) is missing")
    return float(theta)


def token_ids(value) -> tuple[int, ...]:
    """An int, a list of ints or None (null entries of a list are skipped) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Qwen3-style decoder stack (the target, or the draft's layers)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for kind in self.layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"layer_types: unknown layer type '{kind}'")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")

    def window(self, layer: int) -> int | None:
        """Sliding window of a layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        quantization = raw.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
            raise ConfigError(f"{where}: quantized checkpoints (quantization_config, quant_method "
                              f"'{method}') are not supported; use the bfloat16 release")
        if raw.get("attention_bias"):
            raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3 has none)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (only silu)")
        hidden = int(_require(raw, "hidden_size", where))
        heads = int(_require(raw, "num_attention_heads", where))
        layers = int(_require(raw, "num_hidden_layers", where))
        # transformers' Qwen3Config: the window (4096 when the field is absent, none when it is
        # null) exists only with use_sliding_window; without explicit layer_types, layers from
        # max_window_layers on slide.
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        window = None if window is None else int(window)
        layer_types = tuple(raw.get("layer_types") or (
            "sliding_attention" if window is not None and i >= int(raw.get("max_window_layers", 28))
            else "full_attention" for i in range(layers)))
        return cls(
            vocab_size=int(_require(raw, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(_require(raw, "intermediate_size", where)),
            num_layers=layers,
            num_heads=heads,
            # transformers' Qwen3Config defaults: 32 KV heads when the field is absent, one per
            # query head when it is null; head_dim 128 (not hidden // heads)
            num_kv_heads=int(raw.get("num_key_value_heads", 32) or heads),
            head_dim=int(raw.get("head_dim") or 128),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, where),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            sliding_window=window,
            layer_types=layer_types,
            eos_token_ids=token_ids(raw.get("eos_token_id")),
        )


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default target taps of a draft: spread over layers 1..L-3 (z-lab's rule)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def is_draft_config(raw: dict[str, Any]) -> bool:
    """A DFlash draft's config.json (z-lab or speculators), as opposed to a target's."""
    return (raw.get("speculators_model_type") is not None or "dflash_config" in raw
            or any(str(name).startswith("DFlash") for name in raw.get("architectures") or []))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash draft: its Qwen3 layer stack plus how it reads the target.

    ``target_layer_ids`` are z-lab ids: the output of target decoder layer k (HF hidden_states[k+1]).
    ``draft_vocab_size`` is set only for speculators drafts with a reduced vocabulary (d2t map).
    ``causal_layers`` reproduces the reference: sliding-window draft layers are causal unless
    the config says ``is_causal``.
    """

    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None
    causal_layers: tuple[bool, ...] = ()
    source_format: str = "z-lab"

    def __post_init__(self):
        if not self.causal_layers:
            object.__setattr__(self, "causal_layers", (False,) * self.model.num_layers)
        if len(self.causal_layers) != self.model.num_layers:
            raise ConfigError(f"causal_layers has {len(self.causal_layers)} entries for "
                              f"{self.model.num_layers} draft layers")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "draft config.json") -> "DraftConfig":
        if raw.get("speculators_model_type") is not None:
            return cls._from_speculators(raw, where)
        if not is_draft_config(raw):
            raise ConfigError(f"{where}: not a DFlash draft (architectures lacks 'DFlashDraftModel' "
                              "and there is no dflash_config or speculators_model_type)")
        other = [name for name in raw.get("architectures") or []
                 if str(name).startswith("DFlash") and name != "DFlashDraftModel"]
        if other:
            raise ConfigError(f"{where}: architecture {other[0]} is not supported; this library runs "
                              "DFlashDraftModel drafts (z-lab) and speculators 'dflash' drafts")
        dflash = raw.get("dflash_config") or {}

        def value(name, default=None):
            return dflash.get(name, raw.get(name, default))

        model = ModelConfig.from_hf(raw, where)
        ids = value("target_layer_ids")
        num_target_layers = raw.get("num_target_layers")
        if ids is None:
            if num_target_layers is None:
                raise ConfigError(f"{where}: needs 'dflash_config.target_layer_ids' or 'num_target_layers'")
            ids = build_target_layer_ids(int(num_target_layers), model.num_layers)
        mask = value("mask_token_id")
        if mask is None:
            raise ConfigError(f"{where}: required field 'dflash_config.mask_token_id' is missing")
        softcap = value("final_logit_softcapping")
        is_causal = raw.get("is_causal")
        causal = tuple(kind == "sliding_attention" if is_causal is None else bool(is_causal)
                       for kind in model.layer_types)
        return cls(
            model=model,
            block_size=int(value("block_size", 16)),
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            causal_layers=causal,
        )

    @classmethod
    def _from_speculators(cls, raw: dict[str, Any], where: str) -> "DraftConfig":
        kind = raw["speculators_model_type"]
        if kind != "dflash":
            raise ConfigError(f"{where}: speculators_model_type '{kind}' is not a DFlash draft")
        layer_raw = dict(_require(raw, "transformer_layer_config", where))
        # Some exporters put the layers' attention kinds at the top level instead.
        for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
            if key not in layer_raw and key in raw:
                layer_raw[key] = raw[key]
        model = ModelConfig.from_hf(layer_raw, f"{where} transformer_layer_config")
        aux = [int(i) for i in _require(raw, "aux_hidden_state_layer_ids", where)]
        if min(aux, default=1) < 1:
            raise ConfigError(f"{where}: aux_hidden_state_layer_ids {aux} must be >= 1 (id k is the "
                              "output of target decoder layer k; 0, the embedding output, cannot be tapped)")
        mask = raw.get("mask_token_id")
        if mask is None:
            raise ConfigError(f"{where}: required field 'mask_token_id' is missing")
        draft_vocab = raw.get("draft_vocab_size")
        # speculators: full-attention layers are bidirectional; sliding ones causal unless
        # sliding_window_non_causal (the same default as the z-lab reference).
        non_causal_swa = bool(raw.get("sliding_window_non_causal", False))
        return cls(
            model=model,
            block_size=int(_require(raw, "block_size", where)),
            mask_token_id=int(mask),
            target_layer_ids=tuple(i - 1 for i in aux),
            draft_vocab_size=None if draft_vocab in (None, model.vocab_size) else int(draft_vocab),
            causal_layers=tuple(k == "sliding_attention" and not non_causal_swa for k in model.layer_types),
            source_format="speculators",
        )

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError if this draft cannot run on ``target``."""
        if self.model.hidden_size != target.hidden_size:
            raise ConfigError(f"draft hidden_size {self.model.hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        if self.model.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.model.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")
        made_for = self.num_target_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            if self.source_format == "speculators":
                names = f"aux_hidden_state_layer_ids {[i + 1 for i in bad]}"
            else:
                names = f"target_layer_ids {bad}"
            trained = "" if made_for in (None, target.num_layers) else f"; it was made for a {made_for}-layer target"
            raise ConfigError(f"draft {names} are outside the target's {target.num_layers} layers{trained}")
        if made_for is not None and made_for != target.num_layers:
            warnings.warn(f"the draft was made for a {made_for}-layer target and this target has "
                          f"{target.num_layers} layers: output stays exact, but expect few accepted "
                          "tokens")
        if self.draft_vocab_size is not None and self.draft_vocab_size > target.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} is larger than the target "
                              f"vocabulary of {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"draft mask_token_id {self.mask_token_id} is outside the target "
                              f"vocabulary of {target.vocab_size}")


def read_json(path: str | Path) -> Any:
    """A JSON file of a model folder; ConfigError naming the file when it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from error


def read_config_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected an HF model folder with config.json")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw


def load_target_config(directory: str | Path) -> ModelConfig:
    raw = read_config_json(directory)
    if is_draft_config(raw):
        raise ConfigError(f"{directory} holds a DFlash draft, not a target; pass it as the draft (--draft)")
    model_type = raw.get("model_type")
    if model_type != "qwen3":
        raise ConfigError(f"{directory}/config.json: model_type '{model_type}' is not supported "
                          "(only 'qwen3' targets)")
    return ModelConfig.from_hf(raw, f"{directory}/config.json")


def load_draft_config(directory: str | Path) -> DraftConfig:
    raw = read_config_json(directory)
    if not is_draft_config(raw) and raw.get("model_type") == "qwen3":
        raise ConfigError(f"{directory} holds a Qwen3 target, not a DFlash draft; pass it as the target (--target)")
    return DraftConfig.from_hf(raw, f"{directory}/config.json")

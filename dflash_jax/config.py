"""Frozen model configurations parsed from HF ``config.json`` files (Qwen3 target, DFlash draft)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the offending field named."""


_REQUIRED = object()


def _field(raw: dict, name: str, where: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``raw[name]`` as ``kind`` (int, float, bool, str, dict or list); an absent or null field
    takes ``default``. ConfigError naming the field when it is missing without a default or has
    another type (a JSON bool is not a number, and "false" is not a bool)."""
    value = raw.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{where}: required field '{name}' is missing")
        return default
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                 dict: "an object", list: "a list"}
        raise ConfigError(f"{where}: field '{name}' must be {names[kind]}, got {value!r}")
    return value


def int_list(raw: dict, name: str, where: str, default: Any = _REQUIRED) -> Any:
    """A list of integers (or a single integer; null entries skipped) as a tuple, such as an
    ``eos_token_id``; ConfigError naming the field and ``where`` for anything else."""
    value = raw.get(name)
    if value is None:
        return _field(raw, name, where, list, default)
    items = value if isinstance(value, list) else [value]
    return tuple(_field({name: item}, name, where, int) for item in items if item is not None)


def _rope_theta(raw: dict, where: str) -> float:
    params = _field(raw, "rope_parameters", where, dict, None)
    scaling = _field(raw, "rope_scaling", where, dict, None)
    if params and scaling and scaling != params:
        # transformers 5 lets rope_scaling replace rope_parameters (Qwen3's long-context recipe
        # adds a YaRN rope_scaling to such configs): refuse rather than pick a different RoPE
        raise ConfigError(f"{where}: rope_parameters {params} and rope_scaling {scaling} disagree "
                          "(transformers would use rope_scaling): keep one of them")
    params = params or scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only default RoPE)")
    # transformers 5 reads rope_parameters first; the top-level rope_theta is the older form.
    # Required (Qwen3Config would take 10000, Qwen3's releases use 1e6: a wrong theta is silent).
    if params.get("rope_theta") is not None:
        return _field(params, "rope_theta", f"{where} rope_parameters", float)
    if raw.get("rope_theta") is None:
        raise ConfigError(f"{where}: required field 'rope_theta' (or rope_parameters.rope_theta) is missing")
    return _field(raw, "rope_theta", where, float)


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
        if _field(raw, "attention_bias", where, bool, False):
            raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3 has none)")
        act = _field(raw, "hidden_act", where, str, "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (only silu)")
        heads = _field(raw, "num_attention_heads", where, int)
        layers = _field(raw, "num_hidden_layers", where, int)
        # transformers' Qwen3Config: the window (4096 when the field is absent, none when it is
        # null) exists only with use_sliding_window; without explicit layer_types, layers from
        # max_window_layers on slide.
        window = None
        if _field(raw, "use_sliding_window", where, bool, False):
            window = _field(raw, "sliding_window", where, int, None) if "sliding_window" in raw else 4096
        layer_types = _field(raw, "layer_types", where, list, None)
        if layer_types is None:
            first_sliding = _field(raw, "max_window_layers", where, int, 28)
            layer_types = ["sliding_attention" if window is not None and i >= first_sliding
                           else "full_attention" for i in range(layers)]
        # transformers' Qwen3Config defaults: 32 KV heads when the field is absent, one per
        # query head when it is null; head_dim 128 (not hidden // heads)
        kv_heads = _field(raw, "num_key_value_heads", where, int, heads) if "num_key_value_heads" in raw else 32
        return cls(
            vocab_size=_field(raw, "vocab_size", where, int),
            hidden_size=_field(raw, "hidden_size", where, int),
            intermediate_size=_field(raw, "intermediate_size", where, int),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_field(raw, "head_dim", where, int, 128),
            rms_norm_eps=_field(raw, "rms_norm_eps", where, float, 1e-6),
            rope_theta=_rope_theta(raw, where),
            tie_word_embeddings=_field(raw, "tie_word_embeddings", where, bool, False),
            max_position_embeddings=_field(raw, "max_position_embeddings", where, int, 32768),
            sliding_window=window,
            layer_types=tuple(str(kind) for kind in layer_types),
            eos_token_ids=int_list(raw, "eos_token_id", where, ()),
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
            or any(name.startswith("DFlash") for name in _architectures(raw)))


def _architectures(raw: dict[str, Any]) -> list[str]:
    """config.json's ``architectures`` as a list of names (a lone string counts as one)."""
    names = raw.get("architectures")
    if isinstance(names, str):
        names = [names]
    return [str(name) for name in names] if isinstance(names, list) else []


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
        other = [name for name in _architectures(raw) if name.startswith("DFlash") and name != "DFlashDraftModel"]
        if other:
            raise ConfigError(f"{where}: architecture {other[0]} is not supported; this library runs "
                              "DFlashDraftModel drafts (z-lab) and speculators 'dflash' drafts")
        dflash = _field(raw, "dflash_config", where, dict, {})

        def at(name):
            """(mapping, name, where) of a field: dflash_config's copy when it has one, else the
            top level's."""
            return (dflash, name, f"{where} dflash_config") if dflash.get(name) is not None else (raw, name, where)

        model = ModelConfig.from_hf(raw, where)
        ids = int_list(*at("target_layer_ids"), None)
        num_target_layers = _field(raw, "num_target_layers", where, int, None)
        if ids is None:
            if num_target_layers is None:
                raise ConfigError(f"{where}: needs 'dflash_config.target_layer_ids' or 'num_target_layers'")
            ids = build_target_layer_ids(num_target_layers, model.num_layers)
        mask = _field(*at("mask_token_id"), int, None)
        if mask is None:
            raise ConfigError(f"{where}: required field 'dflash_config.mask_token_id' is missing")
        is_causal = _field(raw, "is_causal", where, bool, None)
        causal = tuple(kind == "sliding_attention" if is_causal is None else is_causal
                       for kind in model.layer_types)
        return cls(
            model=model,
            block_size=_field(*at("block_size"), int, 16),
            mask_token_id=mask,
            target_layer_ids=ids,
            num_target_layers=num_target_layers,
            input_embedding_scale=_field(*at("input_embedding_scale"), float, 1.0),
            output_multiplier=_field(*at("output_multiplier"), float, 1.0),
            final_logit_softcapping=_field(*at("final_logit_softcapping"), float, None) or None,
            causal_layers=causal,
        )

    @classmethod
    def _from_speculators(cls, raw: dict[str, Any], where: str) -> "DraftConfig":
        kind = raw["speculators_model_type"]
        if kind != "dflash":
            raise ConfigError(f"{where}: speculators_model_type '{kind}' is not a DFlash draft")
        if _field(raw, "sample_from_anchor", where, bool, False):
            # its block slot k predicts token t+k+1 rather than t+k: every proposal would miss
            raise ConfigError(f"{where}: sample_from_anchor=true drafts (slot k predicts the token after "
                              "the usual one) are not supported")
        layer_raw = dict(_field(raw, "transformer_layer_config", where, dict))
        # Some exporters put the layers' attention kinds at the top level instead.
        for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
            if key not in layer_raw and key in raw:
                layer_raw[key] = raw[key]
        model = ModelConfig.from_hf(layer_raw, f"{where} transformer_layer_config")
        aux = int_list(raw, "aux_hidden_state_layer_ids", where)
        if min(aux, default=1) < 1:
            raise ConfigError(f"{where}: aux_hidden_state_layer_ids {list(aux)} must be >= 1 (id k is the "
                              "output of target decoder layer k; 0, the embedding output, cannot be tapped)")
        draft_vocab = _field(raw, "draft_vocab_size", where, int, None)
        # speculators: full-attention layers are bidirectional; sliding ones causal unless
        # sliding_window_non_causal (the same default as the z-lab reference).
        non_causal_swa = _field(raw, "sliding_window_non_causal", where, bool, False)
        return cls(
            model=model,
            block_size=_field(raw, "block_size", where, int),
            mask_token_id=_field(raw, "mask_token_id", where, int),
            target_layer_ids=tuple(i - 1 for i in aux),
            draft_vocab_size=None if draft_vocab in (None, model.vocab_size) else draft_vocab,
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
        return json.loads(Path(path).read_text(encoding="utf-8"))
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

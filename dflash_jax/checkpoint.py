"""Reading and writing model weights: HF safetensors folders (streamed tensor by tensor) and
this library's orbax checkpoints. Every shape is checked against the config; missing, extra or
misshapen tensors raise CheckpointError naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from dflash_jax.config import DraftConfig, ModelConfig, load_draft_config, load_target_config
from dflash_jax.params import DraftParams, LayerParams, TargetParams

PARAMS_DIR = "params"          # orbax checkpoint inside a converted folder
MARKER_FILE = "dflash_jax.json"


class CheckpointError(ValueError):
    """Weights that do not match their config."""


# HF name inside a layer -> (LayerParams field, stored transposed)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("input_norm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("post_attention_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF-orientation ([out, in]) shape of every tensor in a layer."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF folder: model.safetensors, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def iter_tensors(directory: Path) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """(name, load, shape) for every tensor, loading one tensor at a time on demand."""
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                yield name, (lambda h=handle, n=name: h.get_tensor(n)), shape


class _Collector:
    """Streams tensors into named slots, checking names and shapes as they arrive."""

    def __init__(self, expected: dict[str, tuple[tuple[int, ...], bool]], dtype, where: str,
                 ignored: Callable[[str], bool] = lambda name: False):
        self.expected, self.dtype, self.where, self.ignored = expected, dtype, where, ignored
        self.values: dict[str, jax.Array] = {}

    def add(self, name: str, load: Callable[[], np.ndarray], shape: tuple[int, ...]) -> None:
        if name not in self.expected:
            if self.ignored(name):
                return
            raise CheckpointError(f"{self.where}: unexpected tensor '{name}' {list(shape)} "
                                  "(not part of this architecture/config)")
        want, transpose = self.expected[name]
        if shape != want:
            raise CheckpointError(f"{self.where}: tensor '{name}' has shape {list(shape)}, "
                                  f"config expects {list(want)}")
        array = load()
        if transpose:
            array = array.T
        dtype = self.dtype if np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16" \
            else array.dtype
        self.values[name] = jnp.asarray(array, dtype=dtype)
        del array

    def finish(self) -> dict[str, jax.Array]:
        missing = sorted(set(self.expected) - set(self.values))
        if missing:
            shown = ", ".join(f"'{m}'" for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise CheckpointError(f"{self.where}: missing {len(missing)} tensor(s): {shown}")
        return self.values


def _layers_from(values: dict[str, jax.Array], prefix: str, count: int) -> tuple[LayerParams, ...]:
    return tuple(LayerParams(**{field: values[f"{prefix}{n}.{name}"] for name, (field, _) in _LAYER_TENSORS.items()})
                 for n in range(count))


def _expected_layers(config: ModelConfig, prefix: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    shapes = _layer_shapes(config)
    return {f"{prefix}{n}.{name}": (shapes[name], _LAYER_TENSORS[name][1])
            for n in range(config.num_layers) for name in _LAYER_TENSORS}


def load_hf_target(directory: str | Path, dtype=jnp.bfloat16) -> tuple[ModelConfig, TargetParams]:
    """Load an HF Qwen3 folder (single file or sharded; any float dtype) as ``dtype`` params."""
    directory = Path(directory)
    config = load_target_config(directory)
    v, h = config.vocab_size, config.hidden_size
    expected = _expected_layers(config, "model.layers.")
    expected["model.embed_tokens.weight"] = ((v, h), False)
    expected["model.norm.weight"] = ((h,), False)
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = ((v, h), True)
    # A tied checkpoint may still carry a copy of lm_head; rotary caches are derived, not weights.
    ignored = lambda name: (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith(  # noqa: E731
        "rotary_emb.inv_freq")
    collector = _Collector(expected, dtype, str(directory), ignored)
    for name, load, shape in iter_tensors(directory):
        collector.add(name, load, shape)
    values = collector.finish()
    params = TargetParams(embed=values["model.embed_tokens.weight"], norm=values["model.norm.weight"],
                          lm_head=values.get("lm_head.weight"),
                          layers=_layers_from(values, "model.layers.", config.num_layers))
    return config, params


def load_hf_draft(directory: str | Path, dtype=jnp.bfloat16) -> tuple[DraftConfig, DraftParams]:
    """Load a DFlash draft in z-lab or speculators format."""
    directory = Path(directory)
    config = load_draft_config(directory)
    model = config.model
    h = model.hidden_size
    expected = _expected_layers(model, "layers.")
    expected["fc.weight"] = ((h, len(config.target_layer_ids) * h), True)
    expected["hidden_norm.weight"] = ((h,), False)
    expected["norm.weight"] = ((h,), False)
    ignored = lambda name: name.endswith("rotary_emb.inv_freq")  # noqa: E731
    if config.source_format == "speculators":
        # Speculators drafts carry copies of the target's embedding and LM head (the target's are
        # used); a reduced vocabulary brings its own LM head rows and the d2t/t2d maps.
        copies = {"embed_tokens.weight", "lm_head.weight"}
        if config.draft_vocab_size is not None:
            expected["lm_head.weight"] = ((config.draft_vocab_size, h), True)
            expected["d2t"] = ((config.draft_vocab_size,), False)
            expected["t2d"] = ((model.vocab_size,), False)
        ignored = lambda name: name in copies or name.endswith("rotary_emb.inv_freq")  # noqa: E731
    collector = _Collector(expected, dtype, str(directory), ignored)
    for name, load, shape in iter_tensors(directory):
        collector.add(name, load, shape)
    values = collector.finish()
    params = DraftParams(fc=values["fc.weight"], hidden_norm=values["hidden_norm.weight"],
                         norm=values["norm.weight"], layers=_layers_from(values, "layers.", model.num_layers),
                         lm_head=values.get("lm_head.weight") if config.draft_vocab_size else None,
                         d2t=values["d2t"].astype(jnp.int32) if "d2t" in values else None)
    return config, params


def is_converted(directory: str | Path) -> bool:
    """True for a folder written by ``checkpoints_convert`` (orbax params + config.json)."""
    return (Path(directory) / MARKER_FILE).is_file()


def save_params(directory: Path, params) -> None:
    """Write a params pytree as an orbax checkpoint at ``directory / PARAMS_DIR``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((directory / PARAMS_DIR).absolute(), params)


def restore_params(directory: Path, abstract):
    """Read an orbax params checkpoint into the structure/shapes/dtypes of ``abstract``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore((Path(directory) / PARAMS_DIR).absolute(), abstract)


def read_marker(directory: str | Path) -> dict:
    return json.loads((Path(directory) / MARKER_FILE).read_text())

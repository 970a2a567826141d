"""Loaded models: a config and its params, read from an HF folder or a converted folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax import checkpoint
from dflash_jax.config import DraftConfig, ModelConfig, load_draft_config, load_target_config
from dflash_jax.params import DraftParams, TargetParams, init_draft_params, init_target_params

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Target:
    config: ModelConfig
    params: TargetParams
    path: Path | None = None


@dataclasses.dataclass(frozen=True)
class Draft:
    config: DraftConfig
    params: DraftParams
    path: Path | None = None


def _dtype(dtype):
    """One of ``DTYPES``, by name or as a dtype; ValueError for anything else (an int8 would fail
    deep in the model, a float64 without x64 turn into float32)."""
    try:
        name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def _restore_converted(path: Path, kind: str, init, progress: bool):
    """Params of a converted folder, read straight into the dtypes of ``init()``'s params
    (whatever dtype they were converted to) on the default device."""
    checkpoint.read_marker(path, kind)
    return checkpoint.restore_params(path, jax.eval_shape(init), progress=progress)


def load_target(path: str | Path, dtype="bfloat16", *, progress: bool = False) -> Target:
    """A target of any supported family from an HF folder (safetensors) or a folder made by
    checkpoints_convert.
    ``progress`` shows a tqdm bar on stderr while the weights are read."""
    path, dtype = Path(path), _dtype(dtype)
    if checkpoint.is_converted(path):
        config = load_target_config(path)
        init = lambda: init_target_params(config, jax.random.key(0), dtype)  # noqa: E731
        return Target(config, _restore_converted(path, "target", init, progress), path)
    config, params = checkpoint.load_hf_target(path, dtype, progress=progress)
    return Target(config, params, path)


def load_draft(path: str | Path, target: Target | None = None, dtype=None, *,
               progress: bool = False) -> Draft:
    """DFlash draft (z-lab or speculators format, or converted); checked against ``target``
    (``progress`` as for ``load_target``). ``dtype`` defaults to the target's (the draft's K/V
    pages live beside the target's in one cache), else bfloat16."""
    if dtype is None:
        dtype = target.params.embed.dtype if target is not None else "bfloat16"
    path, dtype = Path(path), _dtype(dtype)
    config = load_draft_config(path)
    if target is not None:
        config.check_target(target.config)
    if checkpoint.is_converted(path):
        init = lambda: init_draft_params(config, jax.random.key(0), dtype)  # noqa: E731
        return Draft(config, _restore_converted(path, "draft", init, progress), path)
    _, params = checkpoint.load_hf_draft(path, dtype, progress=progress)
    if config.source_format == "speculators" and config.draft_vocab_size is None and target is not None:
        checkpoint.check_speculators_copies(path, target.params)
    return Draft(config, params, path)

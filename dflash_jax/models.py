"""Loaded models: a config and its params, read from an HF folder or a converted folder."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax import checkpoint, sharding
from pallas_kernels import Mxfp4Weight, dequantize_mxfp4
from dflash_jax.config import DraftConfig, ModelConfig, load_draft_config, load_target_config
from dflash_jax.params import DraftParams, TargetParams, init_draft_params, init_target_params
from dflash_jax.sharding import TensorParallel

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# How MXFP4 experts (gpt-oss) are held: "keep" (MXFP4, decoded by the experts' kernel as it reads
# them), "dequantize" (the params' dtype, at load), "auto" (see ``dequantizes_experts``)
MXFP4_EXPERTS = ("auto", "keep", "dequantize")
# auto dequantises while the dequantised params take at most this share of a device's memory
# (the rest for the KV cache and activations)
DEQUANTIZED_SHARE = 0.6


@dataclasses.dataclass(frozen=True)
class Target:
    """A target's config and params; ``tensor_parallel``: the mesh its params are split over
    (``dflash_jax.sharding``), None on one device."""

    config: ModelConfig
    params: TargetParams
    path: Path | None = None
    tensor_parallel: TensorParallel | None = None


@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft's config and params, split over ``tensor_parallel``'s mesh like its target's (or
    replicated on it), None on one device."""

    config: DraftConfig
    params: DraftParams
    path: Path | None = None
    tensor_parallel: TensorParallel | None = None


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


def _placer(layout, tensor_parallel: TensorParallel | None) -> checkpoint.Place | None:
    """``checkpoint``'s ``place`` for params of ``layout`` on the mesh (None: one device)."""
    if tensor_parallel is None:
        return None
    by_path = checkpoint.leaves_by_path(layout)
    return lambda path, array: sharding.place(array, by_path[path], tensor_parallel)


def _restore_converted(path: Path, kind: str, init, progress: bool, layout=None, tensor_parallel=None):
    """Params of a converted folder, read straight into the dtypes of ``init()``'s params
    (whatever dtype they were converted to) on the default device, or layer by layer onto the
    mesh by ``layout`` (a converted folder holds the single-device layout: any degree reads it)."""
    checkpoint.read_marker(path, kind)
    abstract = jax.eval_shape(init)
    place = None if layout is None else _placer(layout(abstract), tensor_parallel)
    return checkpoint.restore_params(path, abstract, progress=progress, place=place)


def _dequantized_experts(params, dtype, layout, tensor_parallel: TensorParallel | None):
    """``params`` with every ``Mxfp4Weight`` dequantised to ``dtype`` on its devices, one weight
    at a time (placed as ``layout``, the dense params' layout tree, says)."""
    where = None if layout is None else sharding.named(sharding.specs(layout), tensor_parallel.mesh)
    is_mxfp4 = lambda leaf: isinstance(leaf, Mxfp4Weight)  # noqa: E731

    def convert(leaf, placement):
        if not is_mxfp4(leaf):
            return leaf
        return jax.jit(dequantize_mxfp4, static_argnums=1, out_shardings=placement)(leaf, dtype)

    if where is None:
        return jax.tree.map(lambda leaf: convert(leaf, None), params, is_leaf=is_mxfp4)
    return jax.tree.map(convert, params, where, is_leaf=lambda x: is_mxfp4(x) or x is None)


def device_memory() -> int | None:
    """Bytes of memory a local device has (None where it reports none, as a CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def dequantizes_experts(config: ModelConfig, dtype, mode: str, tensor_parallel: TensorParallel | None) -> bool:
    """Whether a target of ``config`` loads its MXFP4 experts dequantised to ``dtype``: as
    ``mode`` says, or for "auto" whenever the dequantised params fit ``DEQUANTIZED_SHARE`` of a
    device's memory (so on a CPU, which reports none): on an H200 the bf16 experts decode faster
    than the MXFP4 kernel does (``benchmarks/RESULTS.md``), which holds gpt-oss-120b on one GPU.
    "auto" says on stderr what it chose."""
    if mode not in MXFP4_EXPERTS:
        raise ValueError(f"mxfp4_experts must be one of {MXFP4_EXPERTS}, got {mode!r}")
    if not config.mxfp4_experts or mode != "auto":
        return config.mxfp4_experts and mode == "dequantize"
    dense = jax.eval_shape(lambda: init_target_params(config.with_dequantized_experts(), jax.random.key(0), dtype))
    per_device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dense)) / (
        1 if tensor_parallel is None else tensor_parallel.size)
    limit = device_memory()
    dequantize = limit is None or per_device <= DEQUANTIZED_SHARE * limit
    room = "" if limit is None else f" of the {limit / 1e9:.0f} GB a device has"
    print(f"MXFP4 experts: {'dequantised to ' + jnp.dtype(dtype).name if dequantize else 'kept in MXFP4'} "
          f"(dequantised, the params take {per_device / 1e9:.1f} GB a device{room}; --mxfp4-experts keep|dequantize "
          "chooses)", file=sys.stderr)
    return dequantize


def load_target(path: str | Path, dtype="bfloat16", *, progress: bool = False,
                tensor_parallel: TensorParallel | None = None, mxfp4_experts: str = "auto") -> Target:
    """A target of any supported family from an HF folder (safetensors) or a folder made by
    checkpoints_convert.
    ``progress`` shows a tqdm bar on stderr while the weights are read. With ``tensor_parallel``
    each device receives only its slices as the checkpoint streams; a config that cannot be
    split that way is refused before any weight is read. Experts stored in MXFP4 (gpt-oss) are
    held as ``mxfp4_experts`` says (``MXFP4_EXPERTS``, ``dequantizes_experts``): in MXFP4, or
    dequantised to ``dtype`` (3.8x their memory)."""
    path, dtype = Path(path), _dtype(dtype)
    config = load_target_config(path)
    dequantize_experts = dequantizes_experts(config, dtype, mxfp4_experts, tensor_parallel)
    if dequantize_experts and checkpoint.is_converted(path):
        # a converted folder holds the experts as stored: dequantised on the device once restored
        stored = load_target(path, dtype, progress=progress, tensor_parallel=tensor_parallel, mxfp4_experts="keep")
        config = config.with_dequantized_experts()
        dense = jax.eval_shape(lambda: init_target_params(config, jax.random.key(0), dtype))
        layout = None if tensor_parallel is None else sharding.target_layout(
            dense, config, tensor_parallel.expert_parallel)
        params = _dequantized_experts(stored.params, dtype, layout, tensor_parallel)
        return Target(config, params, path, tensor_parallel)
    if dequantize_experts:
        config = config.with_dequantized_experts()
    layout = None
    if tensor_parallel is not None:
        experts_whole = tensor_parallel.expert_parallel
        sharding.local_config(config, tensor_parallel.size, expert_parallel=experts_whole)
        layout = lambda params: sharding.target_layout(params, config, experts_whole)  # noqa: E731
    init = lambda: init_target_params(config, jax.random.key(0), dtype)  # noqa: E731
    if checkpoint.is_converted(path):
        params = _restore_converted(path, "target", init, progress, layout, tensor_parallel)
        return Target(config, params, path, tensor_parallel)
    place = None if layout is None else _placer(layout(jax.eval_shape(init)), tensor_parallel)
    config, params = checkpoint.load_hf_target(path, dtype, progress=progress, place=place,
                                               dequantize_experts=dequantize_experts)
    return Target(config, params, path, tensor_parallel)


def load_draft(path: str | Path, target: Target | None = None, dtype=None, *,
               progress: bool = False) -> Draft:
    """DFlash draft (z-lab or speculators format, or converted); checked against ``target``
    (``progress`` as for ``load_target``). ``dtype`` defaults to the target's (the draft's K/V
    pages live beside the target's in one cache), else bfloat16. It goes on the target's mesh,
    split like it unless the target's ``tensor_parallel.replicate_draft``."""
    if dtype is None:
        dtype = target.params.embed.dtype if target is not None else "bfloat16"
    path, dtype = Path(path), _dtype(dtype)
    config = load_draft_config(path)
    tensor_parallel = None if target is None else target.tensor_parallel
    layout = None
    if target is not None:
        config.check_target(target.config)
    if tensor_parallel is not None:
        sharding.local_draft_config(config, tensor_parallel)
        layout = lambda params: sharding.draft_layout(params, config, tensor_parallel)  # noqa: E731
    init = lambda: init_draft_params(config, jax.random.key(0), dtype)  # noqa: E731
    if checkpoint.is_converted(path):
        return Draft(config, _restore_converted(path, "draft", init, progress, layout, tensor_parallel), path,
                     tensor_parallel)
    place = None if layout is None else _placer(layout(jax.eval_shape(init)), tensor_parallel)
    _, params = checkpoint.load_hf_draft(path, dtype, progress=progress, place=place)
    if config.source_format == "speculators" and config.draft_vocab_size is None and target is not None:
        checkpoint.check_speculators_copies(path, target.params)
    return Draft(config, params, path, tensor_parallel)


def split_target(target: Target, tensor_parallel: TensorParallel) -> Target:
    """``target`` (params on one device or host) split over the mesh: for params made in memory
    (tests, benchmarks, training); checkpoints load split with ``load_target``."""
    if target.tensor_parallel is not None:
        raise ValueError("the target is already split over a mesh")
    experts_whole = tensor_parallel.expert_parallel
    sharding.local_config(target.config, tensor_parallel.size, expert_parallel=experts_whole)
    params = sharding.placed(target.params, sharding.target_layout(target.params, target.config, experts_whole),
                             tensor_parallel)
    return dataclasses.replace(target, params=params, tensor_parallel=tensor_parallel)


def split_draft(draft: Draft, tensor_parallel: TensorParallel) -> Draft:
    """``draft`` on the mesh of a split target (``split_target``)."""
    if draft.tensor_parallel is not None:
        raise ValueError("the draft is already on a mesh")
    sharding.local_draft_config(draft.config, tensor_parallel)
    params = sharding.placed(draft.params, sharding.draft_layout(draft.params, draft.config, tensor_parallel),
                             tensor_parallel)
    return dataclasses.replace(draft, params=params, tensor_parallel=tensor_parallel)

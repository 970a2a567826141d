"""Loaded models: a config and its params, read from an HF folder or a converted folder."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax.loading import checkpoint, mxfp4

from dflash_jax.model import ops, sharding
from pallas_kernels import Mxfp4Weight
from dflash_jax.model.config import DraftConfig, ModelConfig
from dflash_jax.model.hf_config import load_draft_config, load_target_config
from dflash_jax.model.params import DraftParams, TargetParams, init_draft_params, init_target_params
from dflash_jax.model.sharding import TensorParallel

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# How MXFP4 experts (gpt-oss) are held: "keep" (MXFP4, decoded by the experts' kernel as it reads
# them), "dequantize" (the params' dtype, at load), "auto" (see ``dequantizes_experts``)
MXFP4_EXPERTS = ("auto", "keep", "dequantize")
# auto dequantises while the dequantised params take at most this share of the memory JAX may use
# on a device (the rest for the KV cache and activations)
DEQUANTIZED_SHARE = 0.8
# ...except on one GPU where no step runs more tokens than this: the MXFP4 experts kernel decodes
# one token faster than bf16 experts (gpt-oss-20b bs-1 decode, H200 2026-11-30: 3.41 against
# 3.67 ms; H100 2026-11-28: 3.54 against 3.93), is level at 8 (a layer's experts 300 against 283
# µs) and slower beyond (benchmarks/RESULTS.md)
MXFP4_FASTER_TOKENS = 1


@dataclasses.dataclass(frozen=True)
class Target:
    """A target's config and params; ``tensor_parallel``: the mesh its params are split over
    (``dflash_jax.model.sharding``), None on one device."""

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


def _dequantizing_placer(abstract, dtype, place: checkpoint.Place) -> checkpoint.Place:
    """``checkpoint``'s ``place`` for restoring MXFP4 experts (``abstract``'s Mxfp4Weight leaves)
    as dense params: each weight's codes and scales held on the host until both are read, then
    dequantised to ``dtype`` and ``place``d under the weight's own path; the pair's first half
    restores as None (``_merged_pairs`` keeps the other)."""
    pairs = {path[:-1] for path in checkpoint.leaves_by_path(abstract) if path[-1] in Mxfp4Weight._fields}
    pending = {}

    def place_leaf(path, array):
        if path[:-1] not in pairs:
            return place(path, array)
        halves = pending.setdefault(path[:-1], {})
        halves[path[-1]] = array
        if len(halves) < 2:
            return None
        weight = mxfp4.dequantize_packed(**pending.pop(path[:-1]))
        return place(path[:-1], checkpoint.host_layout(weight, False, dtype, "/".join(map(str, path[:-1]))))

    return place_leaf


def _merged_pairs(params):
    """``params`` restored through ``_dequantizing_placer``: each Mxfp4Weight node replaced by its
    placed dense weight."""
    def merged(leaf):
        if not isinstance(leaf, Mxfp4Weight):
            return leaf
        return leaf.scales if leaf.blocks is None else leaf.blocks

    return jax.tree.map(merged, params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))


def device_memory() -> int | None:
    """Bytes of memory JAX may use on a local device (None where it reports none, as a CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def _dense_bytes(config: ModelConfig, dtype, tp: int) -> float:
    """Bytes a device holds of ``config``'s params with its experts dequantised to ``dtype``."""
    dense = jax.eval_shape(lambda: init_target_params(config.with_dequantized_experts(), jax.random.key(0), dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dense)) / tp


def mxfp4_kernel_runs(impl: str = "auto") -> bool:
    """Whether ``impl`` runs the MXFP4 experts' GPU kernel here (an NVIDIA GPU of compute
    capability >= 8.0; elsewhere, or with ``impl="reference"``, the reference dequantises every
    expert of a layer at each step)."""
    return ops.resolve_impl(impl, "routed_experts") == "gpu"


def mxfp4_step_tokens(impl: str, rows: int, block: int) -> int | None:
    """``step_tokens`` for a caller whose steps run ``rows`` sequences of ``block`` tokens (1: plain
    decoding) under ``impl``: None where the MXFP4 kernel does not run (auto then never keeps MXFP4
    for speed)."""
    return rows * block if mxfp4_kernel_runs(impl) else None


def _auto_choice(config: ModelConfig, dtype, tp: int, step_tokens: int | None) -> tuple[bool, str]:
    """("auto"'s choice for ``dequantizes_experts``, the line that says why)."""
    choose = "--mxfp4-experts keep|dequantize chooses"
    if (mxfp4_kernel_runs() and tp == 1 and step_tokens is not None
            and step_tokens <= MXFP4_FASTER_TOKENS):
        return False, (f"MXFP4 experts: kept in MXFP4 (every step runs {step_tokens} token: the MXFP4 kernel "
                       f"decodes it faster than {jnp.dtype(dtype).name} experts; {choose})")
    limit, dense = device_memory(), _dense_bytes(config, dtype, tp)
    dequantize = limit is None or dense <= DEQUANTIZED_SHARE * limit
    room = "" if limit is None else f" of the {limit / 1e9:.0f} GB JAX may use on a device"
    return dequantize, (f"MXFP4 experts: {'dequantised to ' + jnp.dtype(dtype).name if dequantize else 'kept in MXFP4'}"
                        f" (dequantised, the params take {dense / 1e9:.1f} GB a device{room}; {choose})")


def dequantizes_experts(config: ModelConfig, dtype, mode: str, tp: int = 1, step_tokens: int | None = None) -> bool:
    """Whether a target of ``config`` (as stored: ``checkpoint.stored_target_config``) loads its
    MXFP4 experts dequantised to ``dtype`` over ``tp`` devices: as ``mode`` says, or for "auto"
    wherever that is faster: kept in MXFP4 on one GPU when no step runs more than
    ``MXFP4_FASTER_TOKENS`` tokens (``step_tokens``: the most a step runs, None when not known:
    plain decoding of one sequence runs 1), else dequantised whenever the dequantised params fit
    ``DEQUANTIZED_SHARE`` of the memory JAX may use on a device (so on a CPU, which reports none):
    DFlash steps (verifies of several tokens) and batches run faster with bf16 experts
    (``benchmarks/RESULTS.md``); kept in MXFP4, gpt-oss-120b fits one GPU."""
    if mode not in MXFP4_EXPERTS:
        raise ValueError(f"mxfp4_experts must be one of {MXFP4_EXPERTS}, got {mode!r}")
    if not config.mxfp4_experts or mode != "auto":
        return config.mxfp4_experts and mode == "dequantize"
    return _auto_choice(config, dtype, tp, step_tokens)[0]


def loaded_config(path: str | Path, dtype="bfloat16", mxfp4_experts: str = "auto", tp: int = 1,
                  step_tokens: int | None = None) -> ModelConfig:
    """The config ``load_target`` gives the target folder ``path`` (its experts as stored, or
    dequantised as ``mxfp4_experts`` says): what a caller checks a split or the kernels against
    before any weight is read."""
    config = checkpoint.stored_target_config(Path(path))
    return config.with_dequantized_experts() if dequantizes_experts(config, _dtype(dtype), mxfp4_experts, tp,
                                                                    step_tokens) else config


def load_target(path: str | Path, dtype="bfloat16", *, progress: bool = False,
                tensor_parallel: TensorParallel | None = None, mxfp4_experts: str = "auto",
                step_tokens: int | None = None) -> Target:
    """A target of any supported family from an HF folder (safetensors) or a folder made by
    checkpoints_convert.
    ``progress`` shows a tqdm bar on stderr while the weights are read. With ``tensor_parallel``
    each device receives only its slices as the checkpoint streams; a config that cannot be
    split that way is refused before any weight is read. Experts stored in MXFP4 (gpt-oss) are
    held as ``mxfp4_experts`` says (``MXFP4_EXPERTS``, ``dequantizes_experts``; "auto" says on
    stderr what it chose, from ``step_tokens``: the most tokens a step of the caller's will run,
    None when not known): in MXFP4, or dequantised to ``dtype`` as they are read (3.8x their
    memory in bfloat16)."""
    path, dtype = Path(path), _dtype(dtype)
    tp = 1 if tensor_parallel is None else tensor_parallel.size
    config = checkpoint.stored_target_config(path)
    if mxfp4_experts == "keep" and not config.mxfp4_experts and load_target_config(path).mxfp4_experts:
        raise ValueError(f"{path} stores its experts dequantised (its config.json says mxfp4): they cannot be kept "
                         "in MXFP4; convert the released checkpoint again, or take --mxfp4-experts dequantize")
    if mxfp4_experts == "auto" and config.mxfp4_experts:
        dequantize_experts, why = _auto_choice(config, dtype, tp, step_tokens)
        print(why, file=sys.stderr)
    else:
        dequantize_experts = dequantizes_experts(config, dtype, mxfp4_experts, tp, step_tokens)
    stored = config
    if dequantize_experts:
        config = config.with_dequantized_experts()
    layout = None
    if tensor_parallel is not None:
        experts_whole = tensor_parallel.expert_parallel
        sharding.local_config(config, tensor_parallel.size, expert_parallel=experts_whole)
        layout = lambda params: sharding.target_layout(params, config, experts_whole)  # noqa: E731
    init = lambda: init_target_params(config, jax.random.key(0), dtype)  # noqa: E731
    place = (None if layout is None else _placer(layout(jax.eval_shape(init)), tensor_parallel))
    if checkpoint.is_converted(path) and stored.mxfp4_experts and dequantize_experts:
        # the folder holds the codes (its marker, read above, says so): each weight dequantised on
        # the host as its layer is read
        abstract = jax.eval_shape(lambda: init_target_params(stored, jax.random.key(0), dtype))
        on_device = place or (lambda _, array: jax.device_put(array))
        params = checkpoint.restore_params(path, abstract, progress=progress,
                                           place=_dequantizing_placer(abstract, dtype, on_device))
        return Target(config, _merged_pairs(params), path, tensor_parallel)
    if checkpoint.is_converted(path):
        params = _restore_converted(path, "target", init, progress, layout, tensor_parallel)
        return Target(config, params, path, tensor_parallel)
    _, params = checkpoint.load_hf_target(path, dtype, progress=progress, place=place, config=config)
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

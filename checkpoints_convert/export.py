"""JAX params -> HF folders: a DFlash draft in z-lab format (what ``dflash.model.DFlashDraftModel
.from_pretrained``, SGLang and vLLM load) and a target of any supported family in the format it
was read from (Qwen3, LLaMA, Qwen3-MoE, Qwen3.5 / Qwen3.5-MoE text-only or as a release, Qwen3-Next).
A release is written without its vision tower (never loaded here): transformers warns that those
tensors are missing and initialises them.

Used to hand a draft trained here to the PyTorch ecosystem. Tensor names and config fields come
from the family tables (``dflash_jax.model.families``), the same ones the loaders read. Weights are written
shard by shard (torch ``[out, in]`` layout, safetensors), so memory beyond the params stays
below one shard; the folder appears atomically.

    from checkpoints_convert import export_draft
    export_draft(draft.config, draft.params, "my-draft")      # then DFlashDraftModel.from_pretrained("my-draft")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from checkpoints_convert.convert import SIDE_FILES, atomic_output
from dflash_jax.model import families
from dflash_jax.loading.checkpoint import HFTensor, hf_tensors
from dflash_jax.model.config import DraftConfig, ModelConfig
from dflash_jax.model.families.tensors import draft_slots, target_slots
from dflash_jax.loading.models import DTYPES
from dflash_jax.model.params import DraftParams, TargetParams

_HEADER_BYTES = 128  # safetensors header allowance per tensor (besides its name), for shard sizing
DEFAULT_MAX_SHARD_MB = 5000  # as transformers' save_pretrained (5 GB shards)


def _config_json(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json of a layer stack, as its family writes it (``dtype`` for transformers 5,
    ``torch_dtype`` for older readers)."""
    return {**families.get(model.family).export_fields(model), "dtype": dtype, "torch_dtype": dtype}


def _float_dtype(tensors: list[HFTensor], dtype: str | None) -> str:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return dtype
    return str(np.dtype(tensors[0].leaf.dtype))


def _write_folder(out_dir, config_json: dict, tensors: list[HFTensor], dtype: str | None,
                  max_shard_mb: int, overwrite: bool, side_files_from: str | Path | None,
                  progress: bool) -> Path:
    """config.json, the side files of ``side_files_from`` and safetensors shards of at most
    ``max_shard_mb`` MB (10**6 bytes; a single tensor larger than that gets a shard of its own)
    and, when sharded, the index."""
    if max_shard_mb <= 0:
        raise ValueError(f"max_shard_mb must be positive, got {max_shard_mb}")
    side_files = []
    if side_files_from is not None:
        source = Path(side_files_from)
        if not source.is_dir():
            raise FileNotFoundError(f"side_files_from {source} is not a directory")
        side_files = [source / name for name in SIDE_FILES if (source / name).is_file()]

    def stored_dtype(leaf_dtype) -> np.dtype:
        floating = jnp.issubdtype(leaf_dtype, jnp.floating)
        return np.dtype(DTYPES[dtype] if dtype is not None and floating else leaf_dtype)

    limit = max_shard_mb * 10**6 - 8 - _HEADER_BYTES  # 8-byte header length + __metadata__
    shards, used, total = [], 0, 0
    for tensor in tensors:
        nbytes = int(np.prod(tensor.shape)) * stored_dtype(tensor.leaf.dtype).itemsize
        cost = nbytes + len(tensor.name) + _HEADER_BYTES
        if not shards or (shards[-1] and used + cost > limit):
            shards.append([])
            used = 0
        shards[-1].append(tensor)
        used += cost
        total += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    out = Path(out_dir)
    with atomic_output(out, overwrite) as tmp, tqdm(total=total, unit="B", unit_scale=True,
                                                    desc=f"writing {out.name}", disable=not progress) as bar:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        for path in side_files:  # read before ``out`` is replaced, so side_files_from may be ``out``
            shutil.copyfile(path, tmp / path.name)
        weight_map = {}
        for file, shard in zip(files, shards):
            arrays = {}
            for tensor in shard:  # device -> host, one tensor at a time
                arrays[tensor.name] = tensor.host(stored_dtype(tensor.leaf.dtype))
                bar.update(arrays[tensor.name].nbytes)
            save_file(arrays, str(tmp / file), metadata={"format": "pt"})
            del arrays
            weight_map.update({tensor.name: file for tensor in shard})
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _check_types(config, config_type, params, params_type) -> None:
    """TypeError for arguments swapped or of the wrong kind (e.g. a Target passed as config)."""
    for name, value, expected in (("config", config, config_type), ("params", params, params_type)):
        if not isinstance(value, expected):
            raise TypeError(f"{name} must be a {expected.__name__}, got {type(value).__name__}"
                            " (pass model.config and model.params)")


def export_draft(config: DraftConfig, params: DraftParams, out_dir: str | Path, *,
                 max_shard_mb: int = DEFAULT_MAX_SHARD_MB, dtype: str | None = None,
                 overwrite: bool = False, side_files_from: str | Path | None = None,
                 progress: bool = False) -> Path:
    """Write ``params`` as a z-lab-format DFlash draft folder (``architectures
    ["DFlashDraftModel"]``, or ``["DFlash2DraftModel"]`` with its convolution and selector fields
    in ``dflash_config`` and the codebooks' published names), Qwen3 fields, ``block_size``, ``num_target_layers``, ``dflash_config
    {mask_token_id, target_layer_ids}``; weights ``fc.weight``, ``hidden_norm.weight``,
    ``norm.weight``, ``layers.N.…``). ``dtype`` casts floats on the way out (None keeps the
    params'; a float16 cast that overflows raises CheckpointError). ``overwrite`` replaces an
    existing model folder (a config.json inside) or empty folder, as a whole. ``side_files_from``:
    a folder whose tokenizer, chat template and generation config files (``SIDE_FILES``) are
    copied in. ``progress``: a bar over the bytes written. Raises TypeError for arguments of the
    wrong kind, ValueError for what the format cannot hold (a reduced draft vocabulary, unknown
    ``num_target_layers``, per-layer causality other than the reference's rule) and
    CheckpointError naming the tensor when params and config disagree.

    The folder loads with ``dflash.model.DFlashDraftModel.from_pretrained`` (PyPI ``dflash``), SGLang
    and vLLM; it carries no ``auto_map`` or modeling file, so ``AutoModel`` would build a plain
    Qwen3 model from it.
    """
    _check_types(config, DraftConfig, params, DraftParams)
    model = config.model
    if config.draft_vocab_size is not None:
        raise ValueError("z-lab drafts use the target's LM head: a reduced draft vocabulary "
                         f"(draft_vocab_size={config.draft_vocab_size}) cannot be exported")
    if config.num_target_layers is None:
        raise ValueError("config.num_target_layers is unknown (speculators configs lack it); set it with "
                         "dataclasses.replace(config, num_target_layers=<target's num_hidden_layers>)")
    tensors = hf_tensors(draft_slots(config), params)
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if config.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = config.input_embedding_scale
    if config.output_multiplier != 1.0:
        dflash["output_multiplier"] = config.output_multiplier
    if config.final_logit_softcapping:
        dflash["final_logit_softcapping"] = config.final_logit_softcapping
    if config.selector is not None:  # DFlash2
        if len({layer.conv for layer in model.layers}) > 1:
            raise ValueError("the draft layers' convolutions differ: DFlash2's config holds one")
        conv = model.layers[0].conv
        dflash.update(conv_kernel_size=conv.kernel_size, conv_group_size=conv.group_size,
                      selector_rank=config.selector.rank, selector_top_k=config.selector.top_k)
    architecture = "DFlashDraftModel" if config.selector is None else "DFlash2DraftModel"
    raw = {**_config_json(model, _float_dtype(tensors, dtype)), "architectures": [architecture],
           "tie_word_embeddings": False, "block_size": config.block_size,
           "num_target_layers": config.num_target_layers, "dflash_config": dflash}
    # The reference makes sliding-window layers causal and the rest bidirectional unless
    # ``is_causal`` (one flag for all layers) says otherwise.
    reference_rule = tuple(kind == "sliding_attention" for kind in model.layer_types)
    causal = config.causal_layers or reference_rule
    if causal != reference_rule:
        if len(set(causal)) > 1:
            raise ValueError(f"causal_layers {causal} cannot be expressed in z-lab format (one is_causal flag)")
        raw["is_causal"] = causal[0]
    return _write_folder(out_dir, raw, tensors, dtype, max_shard_mb, overwrite, side_files_from, progress)


def export_target(config: ModelConfig, params: TargetParams, out_dir: str | Path, *,
                  max_shard_mb: int = DEFAULT_MAX_SHARD_MB, dtype: str | None = None,
                  overwrite: bool = False, side_files_from: str | Path | None = None,
                  progress: bool = False) -> Path:
    """Write ``params`` as an HF folder of the config's family (``Qwen3ForCausalLM``,
    ``LlamaForCausalLM``, ``Qwen3MoeForCausalLM``: ``model.``-prefixed names, one tensor per
    expert, ``lm_head.weight`` only when untied). Tokenizer files are not part of params: pass
    the source model's folder as ``side_files_from`` (it may be ``out_dir`` itself, with
    ``overwrite``). Other arguments as for ``export_draft``.
    """
    _check_types(config, ModelConfig, params, TargetParams)
    tensors = hf_tensors(target_slots(config), params)
    raw = _config_json(config, _float_dtype(tensors, dtype))
    return _write_folder(out_dir, raw, tensors, dtype, max_shard_mb, overwrite, side_files_from, progress)

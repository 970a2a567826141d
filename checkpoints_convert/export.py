"""JAX params -> HF folders: a DFlash draft in z-lab format (what ``dflash.model.DFlashDraftModel
.from_pretrained``, SGLang and vLLM load) and a Qwen3 target (``Qwen3ForCausalLM``).

Used to hand a draft trained here to the PyTorch ecosystem. Tensor names come from
``dflash_jax.checkpoint``'s slot tables, the same ones the loaders read. Weights are written
shard by shard (torch ``[out, in]`` layout, safetensors), so memory beyond the params stays
below one shard; the folder appears atomically.

    from checkpoints_convert import export_draft
    export_draft(draft.config, draft.params, "my-draft")      # then DFlashDraftModel.from_pretrained("my-draft")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from checkpoints_convert.convert import atomic_output
from dflash_jax.checkpoint import draft_slots, hf_tensors, target_slots
from dflash_jax.config import DraftConfig, ModelConfig
from dflash_jax.models import DTYPES
from dflash_jax.params import DraftParams, TargetParams

_HEADER_BYTES = 128  # safetensors header allowance per tensor (besides its name), for shard sizing
DEFAULT_MAX_SHARD_MB = 5000  # as transformers' save_pretrained (5 GB shards)


def _qwen3_fields(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """The Qwen3Config fields of a layer stack (``rope_parameters`` and ``dtype`` for
    transformers 5, ``rope_theta`` and ``torch_dtype`` for older readers)."""
    sliding = "sliding_attention" in model.layer_types
    fields = {
        "model_type": "qwen3", "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": model.rms_norm_eps, "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings, "layer_types": list(model.layer_types),
        "use_sliding_window": sliding, "sliding_window": model.sliding_window if sliding else None,
        "dtype": dtype, "torch_dtype": dtype,
    }
    if model.eos_token_ids:
        ids = list(model.eos_token_ids)
        fields["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return fields


def _float_dtype(tensors, dtype: str | None) -> str:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return dtype
    return str(np.dtype(tensors[0][1].dtype))


def _write_folder(out_dir, config_json: dict, tensors: list[tuple[str, Any, bool]], dtype: str | None,
                  max_shard_mb: int, overwrite: bool) -> Path:
    """config.json plus safetensors shards of at most ``max_shard_mb`` MB (10**6 bytes; a single
    tensor larger than that gets a shard of its own) and, when sharded, the index."""
    if max_shard_mb <= 0:
        raise ValueError(f"max_shard_mb must be positive, got {max_shard_mb}")

    def stored_dtype(leaf_dtype) -> np.dtype:
        floating = jnp.issubdtype(leaf_dtype, jnp.floating)
        return np.dtype(DTYPES[dtype] if dtype is not None and floating else leaf_dtype)

    limit = max_shard_mb * 10**6 - 8 - _HEADER_BYTES  # 8-byte header length + __metadata__
    shards, used, total = [], 0, 0
    for name, leaf, transposed in tensors:
        nbytes = int(np.prod(leaf.shape)) * stored_dtype(leaf.dtype).itemsize
        cost = nbytes + len(name) + _HEADER_BYTES
        if not shards or (shards[-1] and used + cost > limit):
            shards.append([])
            used = 0
        shards[-1].append((name, leaf, transposed))
        used += cost
        total += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    def torch_layout(leaf, transposed) -> np.ndarray:
        array = np.asarray(leaf)  # device -> host, one tensor at a time
        return np.ascontiguousarray(array.T if transposed else array, dtype=stored_dtype(array.dtype))

    out = Path(out_dir)
    with atomic_output(out, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        weight_map = {}
        for file, shard in zip(files, shards):
            save_file({name: torch_layout(leaf, t) for name, leaf, t in shard}, str(tmp / file),
                      metadata={"format": "pt"})
            weight_map.update({name: file for name, _, _ in shard})
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def export_draft(config: DraftConfig, params: DraftParams, out_dir: str | Path, *,
                 max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
                 dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write ``params`` as a z-lab-format DFlash draft folder (``architectures
    ["DFlashDraftModel"]``, Qwen3 fields, ``block_size``, ``num_target_layers``, ``dflash_config
    {mask_token_id, target_layer_ids}``; weights ``fc.weight``, ``hidden_norm.weight``,
    ``norm.weight``, ``layers.N.…``). ``dtype`` casts floats on the way out (None keeps the
    params'). Raises ValueError for what the format cannot hold (a reduced draft vocabulary,
    unknown ``num_target_layers``, per-layer causality other than the reference's rule) and
    CheckpointError naming the tensor when params and config disagree.
    """
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
    raw = {"architectures": ["DFlashDraftModel"], **_qwen3_fields(model, _float_dtype(tensors, dtype)),
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
    return _write_folder(out_dir, raw, tensors, dtype, max_shard_mb, overwrite)


def export_target(config: ModelConfig, params: TargetParams, out_dir: str | Path, *,
                  max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
                  dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write ``params`` as an HF Qwen3ForCausalLM folder (``model.``-prefixed names;
    ``lm_head.weight`` only when untied). Tokenizer files are not part of params: copy them
    from the source model. Other arguments as for ``export_draft``.
    """
    tensors = hf_tensors(target_slots(config), params)
    raw = {"architectures": ["Qwen3ForCausalLM"], **_qwen3_fields(config, _float_dtype(tensors, dtype))}
    return _write_folder(out_dir, raw, tensors, dtype, max_shard_mb, overwrite)

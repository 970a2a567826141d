"""HF tensor names -> places in a params pytree: the one table that loading, conversion and export
all read. A family contributes its names (``TensorNames``); which tensors exist follows from the
layer specs (q/k norms, biases, dense or routed experts)."""

from __future__ import annotations

import dataclasses

from dflash_jax.config import DraftConfig, LayerSpec, ModelConfig
from dflash_jax.nn.moe import MoESpec


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in a params pytree.

    ``path`` is the leaf's key path (``("layers", 3, "attention", "o_proj")``), or None for a
    tensor that is checked and dropped (speculators' ``t2d``, derivable from ``d2t``). ``shape``
    is the HF ([out, in]) shape; ``transposed`` marks torch Linear weights, stored ``[in, out]``
    here. ``columns`` (start, stop) places a tensor inside a fused leaf along its last axis (q/k/v
    in ``qkv_proj``), ``expert`` on the leading axis of a stacked one (a MoE layer's experts).
    ``integer`` marks an id map (``d2t``, ``t2d``), stored int32; every other tensor is a float.
    """

    path: tuple | None
    shape: tuple[int, ...]
    transposed: bool = False
    columns: tuple[int, int] | None = None
    expert: int | None = None
    integer: bool = False

    @property
    def is_part(self) -> bool:
        """Whether the tensor fills only part of its leaf."""
        return self.columns is not None or self.expert is not None


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """A family's HF tensor names (LLaMA-style by default: Qwen3, LLaMA and Qwen3-MoE share them).
    ``layer`` takes the layer index; ``expert`` the expert index."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{}."
    input_norm: str = "input_layernorm.weight"
    post_attention_norm: str = "post_attention_layernorm.weight"
    attention: str = "self_attn."
    mlp: str = "mlp."
    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{}."


LLAMA_STYLE = TensorNames()
DRAFT = dataclasses.replace(LLAMA_STYLE, layer="layers.{}.")  # z-lab drafts: no ``model.`` prefix


def _fused(prefix: str, names: tuple[str, ...], widths: tuple[int, ...], path: tuple, rows: int | None, *,
           expert: int | None = None) -> dict[str, Slot]:
    """The slots of tensors fused column-wise into one leaf, in order: weights [width, rows]
    (transposed) or, for ``rows`` None, biases [width]."""
    slots, start = {}, 0
    for name, width in zip(names, widths):
        shape = (width,) if rows is None else (width, rows)
        slots[f"{prefix}{name}"] = Slot(path, shape, rows is not None, (start, start + width), expert)
        start += width
    return slots


def layer_slots(spec: LayerSpec, hidden: int, index: int, names: TensorNames) -> dict[str, Slot]:
    """Every tensor of one decoder layer."""
    prefix, base = names.layer.format(index), ("layers", index)
    h = hidden
    slots = {prefix + names.input_norm: Slot(base + ("input_norm",), (h,)),
             prefix + names.post_attention_norm: Slot(base + ("post_attention_norm",), (h,))}
    attn, at, a = spec.mixer, base + ("attention",), prefix + names.attention
    qkv = ("q_proj", "k_proj", "v_proj")
    widths = (attn.q_size, attn.kv_size, attn.kv_size)
    slots.update(_fused(a, tuple(f"{p}.weight" for p in qkv), widths, at + ("qkv_proj",), h))
    slots[f"{a}o_proj.weight"] = Slot(at + ("o_proj",), (h, attn.q_size), True)
    if attn.qk_norm:
        slots[f"{a}q_norm.weight"] = Slot(at + ("q_norm",), (attn.head_dim,))
        slots[f"{a}k_norm.weight"] = Slot(at + ("k_norm",), (attn.head_dim,))
    if attn.bias:
        slots.update(_fused(a, tuple(f"{p}.bias" for p in qkv), widths, at + ("qkv_bias",), None))
        slots[f"{a}o_proj.bias"] = Slot(at + ("o_bias",), (h,))
    ffn, ft = spec.ffn, base + ("ffn",)
    if isinstance(ffn, MoESpec):
        i = ffn.intermediate_size
        slots[prefix + names.router] = Slot(ft + ("router",), (ffn.num_experts, h), True)
        for e in range(ffn.num_experts):
            x = prefix + names.expert.format(e)
            slots.update(_fused(x, ("gate_proj.weight", "up_proj.weight"), (i, i), ft + ("gate_up_proj",), h,
                                expert=e))
            slots[f"{x}down_proj.weight"] = Slot(ft + ("down_proj",), (h, i), True, expert=e)
        return slots
    i, m = ffn.intermediate_size, prefix + names.mlp
    slots.update(_fused(m, ("gate_proj.weight", "up_proj.weight"), (i, i), ft + ("gate_up_proj",), h))
    slots[f"{m}down_proj.weight"] = Slot(ft + ("down_proj",), (h, i), True)
    if ffn.bias:
        slots.update(_fused(m, ("gate_proj.bias", "up_proj.bias"), (i, i), ft + ("gate_up_bias",), None))
        slots[f"{m}down_proj.bias"] = Slot(ft + ("down_bias",), (h,))
    return slots


def target_slots(config: ModelConfig) -> dict[str, Slot]:
    """The HF tensors of a target of ``config``'s family (``lm_head`` only when untied)."""
    from dflash_jax import families

    names = families.get(config.family).names
    v, h = config.vocab_size, config.hidden_size
    slots = {}
    for index, spec in enumerate(config.layers):
        slots.update(layer_slots(spec, h, index, names))
    slots[names.embed] = Slot(("embed",), (v, h))
    slots[names.final_norm] = Slot(("norm",), (h,))
    if not config.tie_word_embeddings:
        slots[names.lm_head] = Slot(("lm_head",), (v, h), True)
    return slots


def draft_slots(config: DraftConfig) -> dict[str, Slot]:
    """Tensor names of a DFlash draft (no ``model.`` prefix). A reduced-vocabulary speculators
    draft adds its own LM head rows, ``d2t`` and ``t2d``."""
    model = config.model
    h = model.hidden_size
    slots = {}
    for index, spec in enumerate(model.layers):
        slots.update(layer_slots(spec, h, index, DRAFT))
    slots["fc.weight"] = Slot(("fc",), (h, len(config.target_layer_ids) * h), True)
    slots["hidden_norm.weight"] = Slot(("hidden_norm",), (h,))
    slots["norm.weight"] = Slot(("norm",), (h,))
    if config.draft_vocab_size is not None:
        slots["lm_head.weight"] = Slot(("lm_head",), (config.draft_vocab_size, h), True)
        slots["d2t"] = Slot(("d2t",), (config.draft_vocab_size,), integer=True)
        slots["t2d"] = Slot(None, (model.vocab_size,))  # often bool: checked for shape only
    return slots

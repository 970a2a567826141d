"""HF tensor names -> places in a params pytree: the one table that loading, conversion and export
all read. A family contributes its names (``TensorNames``); which tensors exist follows from the
layer specs (q/k norms, biases, dense or routed experts)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash_jax.model.config import DraftConfig, LayerSpec, ModelConfig
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.moe import MoESpec


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in a params pytree.

    ``path`` is the leaf's key path (``("layers", 3, "attention", "o_proj")``), or None for a
    tensor that is checked and dropped (speculators' ``t2d``, derivable from ``d2t``). ``shape``
    is the HF ([out, in]) shape; ``transposed`` marks torch Linear weights (their last two axes),
    stored ``[in, out]`` here. ``columns`` places a tensor inside a fused leaf along its last axis
    (q/k/v in ``qkv_proj``): (start, stop) ranges that the tensor's rows fill in order (several
    for interleaved layouts: Qwen3.5's per-head q | gate, Qwen3-Next's in_proj_qkvz); ``expert``
    on the leading axis of a stacked leaf (a MoE layer's experts). ``integer`` marks an id map
    (``d2t``, ``t2d``), stored int32; ``mxfp4`` ("blocks" or "scales") half of an MXFP4 pair,
    stored as read (uint8; the blocks' 16 bytes of each 32 values flattened: [E, N, K/2], so that
    ``transposed`` gives ``Mxfp4Weight``'s [E, K/2, N]); every other tensor is a float.
    """

    path: tuple | None
    shape: tuple[int, ...]
    transposed: bool = False
    columns: tuple[tuple[int, int], ...] | None = None
    expert: int | None = None
    integer: bool = False
    mxfp4: str | None = None

    @property
    def is_part(self) -> bool:
        """Whether the tensor fills only part of its leaf."""
        return self.columns is not None or self.expert is not None


def column_index(columns: tuple[tuple[int, int], ...] | None):
    """An index for a leaf's last axis that selects ``columns`` in order (all for None)."""
    if columns is None:
        return slice(None)
    if len(columns) == 1:
        return slice(*columns[0])
    return np.concatenate([np.arange(start, stop) for start, stop in columns])


def column_width(columns: tuple[tuple[int, int], ...]) -> int:
    return sum(stop - start for start, stop in columns)


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """A family's HF tensor names and layout facts (LLaMA-style by default: Qwen3, LLaMA and
    Qwen3-MoE share them). ``layer`` takes the layer index; ``expert`` the expert index.
    ``linear_fused``: Gated DeltaNet's projections are Qwen3-Next's in_proj_qkvz / in_proj_ba,
    interleaved per key head. ``interleaved_experts``: gpt-oss's experts, stacked as [E, H, 2I]
    and [E, I, H] ([in, out], not torch's [out, in]) with gate and up columns alternating, and
    biases. ``ignored``: name prefixes of tensors this library does not use
    (a release's vision tower, its multi-token-prediction head)."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{}."
    input_norm: str = "input_layernorm.weight"
    post_attention_norm: str = "post_attention_layernorm.weight"
    attention: str = "self_attn."
    linear_attention: str = "linear_attn."
    mlp: str = "mlp."
    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{}."
    stacked_experts: str = "mlp.experts."
    shared_expert: str = "mlp.shared_expert."
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"
    linear_fused: bool = False
    interleaved_experts: bool = False
    ignored: tuple[str, ...] = ()

    def is_ignored(self, name: str) -> bool:
        return name.startswith(self.ignored) if self.ignored else False


LLAMA_STYLE = TensorNames()
GPT_OSS = dataclasses.replace(LLAMA_STYLE, router="mlp.router.weight", interleaved_experts=True)
DRAFT = dataclasses.replace(LLAMA_STYLE, layer="layers.{}.")  # z-lab drafts: no ``model.`` prefix


def _fused(prefix: str, names: tuple[str, ...], widths: tuple[int, ...], path: tuple, rows: int | None, *,
           expert: int | None = None) -> dict[str, Slot]:
    """The slots of tensors fused column-wise into one leaf, in order: weights [width, rows]
    (transposed) or, for ``rows`` None, biases [width]."""
    slots, start = {}, 0
    for name, width in zip(names, widths):
        shape = (width,) if rows is None else (width, rows)
        slots[f"{prefix}{name}"] = Slot(path, shape, rows is not None, ((start, start + width),), expert)
        start += width
    return slots


def _attention_slots(attn: AttentionSpec, hidden: int, at: tuple, a: str, names: TensorNames) -> dict[str, Slot]:
    h, d = hidden, attn.head_dim
    qkv = ("q_proj", "k_proj", "v_proj")
    widths = (attn.q_size, attn.kv_size, attn.kv_size)
    slots = _fused(a, tuple(f"{p}.weight" for p in qkv), widths, at + ("qkv_proj",), h)
    if attn.output_gate:
        # q_proj yields q and the output gate; stored here as q | k | v | gate
        # (transformers' Qwen3.5 / Qwen3-Next: its rows are per head [q_h | gate_h])
        gate = attn.qkv_size
        ranges = tuple(r for head in range(attn.num_heads)
                       for r in ((head * d, head * d + d), (gate + head * d, gate + head * d + d)))
        slots[f"{a}q_proj.weight"] = Slot(at + ("qkv_proj",), (2 * attn.q_size, h), True, ranges)
    slots[f"{a}o_proj.weight"] = Slot(at + ("o_proj",), (h, attn.q_size), True)
    if attn.qk_norm:
        slots[f"{a}q_norm.weight"] = Slot(at + ("q_norm",), (d,))
        slots[f"{a}k_norm.weight"] = Slot(at + ("k_norm",), (d,))
    if attn.bias:
        if attn.output_gate:
            raise ValueError("biased gated attention has no HF layout here")
        slots.update(_fused(a, tuple(f"{p}.bias" for p in qkv), widths, at + ("qkv_bias",), None))
        slots[f"{a}o_proj.bias"] = Slot(at + ("o_bias",), (h,))
    if attn.sinks:
        slots[f"{a}sinks"] = Slot(at + ("sinks",), (attn.num_heads,))
    return slots


def _linear_attention_slots(spec: GatedDeltaNetSpec, hidden: int, at: tuple, a: str,
                            names: TensorNames) -> dict[str, Slot]:
    """Gated DeltaNet: in_proj holds q | k | v | z | b | a (see ``nn.gated_deltanet``)."""
    h, hk, hv = hidden, spec.num_key_heads, spec.num_value_heads
    ks, vs, c = spec.key_size, spec.value_size, spec.conv_dim
    path = at + ("in_proj",)
    if names.linear_fused:
        # Qwen3-Next: per key head g, rows [q_g | k_g | v_g (r heads) | z_g (r heads)] and [b_g | a_g]
        dk, r, rv = spec.key_dim, hv // hk, hv // hk * spec.value_dim
        qkvz = tuple(rng for g in range(hk) for rng in (
            (g * dk, (g + 1) * dk), (ks + g * dk, ks + (g + 1) * dk), (2 * ks + g * rv, 2 * ks + (g + 1) * rv),
            (c + g * rv, c + (g + 1) * rv)))
        ba = tuple(rng for g in range(hk) for rng in (
            (c + vs + g * r, c + vs + (g + 1) * r), (c + vs + hv + g * r, c + vs + hv + (g + 1) * r)))
        slots = {f"{a}in_proj_qkvz.weight": Slot(path, (c + vs, h), True, qkvz),
                 f"{a}in_proj_ba.weight": Slot(path, (2 * hv, h), True, ba)}
    else:
        slots = _fused(a, ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
                       (c, vs, hv, hv), path, h)
    slots.update({f"{a}conv1d.weight": Slot(at + ("conv_weight",), (c, 1, spec.conv_kernel)),
                  f"{a}A_log": Slot(at + ("A_log",), (hv,)), f"{a}dt_bias": Slot(at + ("dt_bias",), (hv,)),
                  f"{a}norm.weight": Slot(at + ("norm",), (spec.value_dim,)),
                  f"{a}out_proj.weight": Slot(at + ("out_proj",), (h, vs), True)})
    return slots


def interleaved(width: int) -> tuple[tuple[int, int], ...]:
    """Columns of a gate | up leaf [.., 2 width] that alternating gate, up columns fill."""
    return tuple(r for j in range(width) for r in ((j, j + 1), (width + j, width + j + 1)))


def _moe_slots(ffn: MoESpec, hidden: int, ft: tuple, prefix: str, names: TensorNames,
               stacked_experts: bool) -> dict[str, Slot]:
    h, i, e = hidden, ffn.intermediate_size, ffn.num_experts
    slots = {prefix + names.router: Slot(ft + ("router",), (e, h), True)}
    if ffn.bias:
        slots[prefix + names.router.removesuffix("weight") + "bias"] = Slot(ft + ("router_bias",), (e,))
    if names.interleaved_experts:
        x, alternating = prefix + names.stacked_experts, interleaved(i)
        if ffn.mxfp4:  # [E, out, in / 2] codes and [E, out, in / 32] scales, columns as the weights'
            for name, inputs, outputs, columns in (("gate_up_proj", h, 2 * i, alternating), ("down_proj", i, h, None)):
                for part, size in (("blocks", inputs // 2), ("scales", inputs // 32)):
                    slots[f"{x}{name}_{part}"] = Slot(ft + (name, part), (e, outputs, size), True, columns,
                                                      mxfp4=part)
        else:
            slots[f"{x}gate_up_proj"] = Slot(ft + ("gate_up_proj",), (e, h, 2 * i), columns=alternating)
            slots[f"{x}down_proj"] = Slot(ft + ("down_proj",), (e, i, h))
        if ffn.bias:
            slots[f"{x}gate_up_proj_bias"] = Slot(ft + ("gate_up_bias",), (e, 2 * i), columns=alternating)
            slots[f"{x}down_proj_bias"] = Slot(ft + ("down_bias",), (e, h))
    elif ffn.bias or ffn.mxfp4:
        raise ValueError("biased or MXFP4 experts have an HF layout here only as gpt-oss's")
    elif stacked_experts:  # one [E, 2I, H] and one [E, H, I] tensor (transformers 5's own layout)
        x = prefix + names.stacked_experts
        slots[f"{x}gate_up_proj"] = Slot(ft + ("gate_up_proj",), (ffn.num_experts, 2 * i, h), True)
        slots[f"{x}down_proj"] = Slot(ft + ("down_proj",), (ffn.num_experts, h, i), True)
    else:
        for e in range(ffn.num_experts):
            x = prefix + names.expert.format(e)
            slots.update(_fused(x, ("gate_proj.weight", "up_proj.weight"), (i, i), ft + ("gate_up_proj",), h,
                                expert=e))
            slots[f"{x}down_proj.weight"] = Slot(ft + ("down_proj",), (h, i), True, expert=e)
    if ffn.shared_intermediate_size is not None:
        s, x = ffn.shared_intermediate_size, prefix + names.shared_expert
        slots.update(_fused(x, ("gate_proj.weight", "up_proj.weight"), (s, s), ft + ("shared", "gate_up_proj"), h))
        slots[f"{x}down_proj.weight"] = Slot(ft + ("shared", "down_proj"), (h, s), True)
        slots[prefix + names.shared_expert_gate] = Slot(ft + ("shared_gate",), (1, h), True)
    return slots


def layer_slots(spec: LayerSpec, hidden: int, index: int, names: TensorNames,
                stacked_experts: bool = False) -> dict[str, Slot]:
    """Every tensor of one decoder layer (a MoE layer's experts one tensor each, or stacked)."""
    prefix, base = names.layer.format(index), ("layers", index)
    h = hidden
    slots = {prefix + names.input_norm: Slot(base + ("input_norm",), (h,)),
             prefix + names.post_attention_norm: Slot(base + ("post_attention_norm",), (h,))}
    if isinstance(spec.mixer, AttentionSpec):
        slots.update(_attention_slots(spec.mixer, h, base + ("attention",), prefix + names.attention, names))
    else:
        slots.update(_linear_attention_slots(spec.mixer, h, base + ("attention",), prefix + names.linear_attention,
                                             names))
    if spec.conv is not None:  # DFlash2: layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}
        width = 2 * spec.conv.kernel_size * spec.conv.groups(h)
        for side in ("attention_conv", "mlp_conv"):
            slots[f"{prefix}{side}.base_kernel"] = Slot(base + (side, "base_kernel"), (2, spec.conv.kernel_size, h))
            slots[f"{prefix}{side}.kernel_projection.weight"] = Slot(base + (side, "kernel_projection"), (width, h),
                                                                     True)
    ffn, ft = spec.ffn, base + ("ffn",)
    if isinstance(ffn, MoESpec):
        slots.update(_moe_slots(ffn, h, ft, prefix, names, stacked_experts))
        return slots
    i, m = ffn.intermediate_size, prefix + names.mlp
    slots.update(_fused(m, ("gate_proj.weight", "up_proj.weight"), (i, i), ft + ("gate_up_proj",), h))
    slots[f"{m}down_proj.weight"] = Slot(ft + ("down_proj",), (h, i), True)
    if ffn.bias:
        slots.update(_fused(m, ("gate_proj.bias", "up_proj.bias"), (i, i), ft + ("gate_up_bias",), None))
        slots[f"{m}down_proj.bias"] = Slot(ft + ("down_bias",), (h,))
    return slots


def target_slots(config: ModelConfig, stacked_experts: bool = False) -> dict[str, Slot]:
    """The HF tensors of a target of ``config``'s family (``lm_head`` only when untied; MoE
    experts one tensor each, as transformers saves them, or ``stacked_experts``)."""
    from dflash_jax.model import families

    names = families.get(config.family).names
    v, h = config.vocab_size, config.hidden_size
    slots = {}
    for index, spec in enumerate(config.layers):
        slots.update(layer_slots(spec, h, index, names, stacked_experts))
    slots[names.embed] = Slot(("embed",), (v, h))
    slots[names.final_norm] = Slot(("norm",), (h,))
    if not config.tie_word_embeddings:
        slots[names.lm_head] = Slot(("lm_head",), (v, h), True)
    return slots


SELECTOR = "candidate_selector."


def draft_slots(config: DraftConfig, codebook_suffix: str = "") -> dict[str, Slot]:
    """Tensor names of a DFlash draft (no ``model.`` prefix). A reduced-vocabulary speculators
    draft adds its own LM head rows, ``d2t`` and ``t2d``; a DFlash2 draft its selector, whose
    codebooks z-lab publishes without ``.weight`` (``codebook_suffix`` ".weight": as torch's
    save_pretrained writes them)."""
    model = config.model
    h = model.hidden_size
    slots = {}
    for index, spec in enumerate(model.layers):
        slots.update(layer_slots(spec, h, index, DRAFT))
    slots["fc.weight"] = Slot(("fc",), (h, len(config.target_layer_ids) * h), True)
    slots["hidden_norm.weight"] = Slot(("hidden_norm",), (h,))
    slots["norm.weight"] = Slot(("norm",), (h,))
    if config.selector is not None:
        v, r = model.vocab_size, config.selector.rank
        for name in ("predecessor_codebook", "successor_codebook"):
            slots[f"{SELECTOR}{name}{codebook_suffix}"] = Slot(("selector", name), (v, r))
        slots[f"{SELECTOR}hidden_projection.weight"] = Slot(("selector", "hidden_projection"), (r, h), True)
    if config.draft_vocab_size is not None:
        slots["lm_head.weight"] = Slot(("lm_head",), (config.draft_vocab_size, h), True)
        slots["d2t"] = Slot(("d2t",), (config.draft_vocab_size,), integer=True)
        slots["t2d"] = Slot(None, (model.vocab_size,))  # often bool: checked for shape only
    return slots

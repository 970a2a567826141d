"""Tiny random HF checkpoints for the tests: targets of every family (Qwen3, LLaMA, Qwen3-MoE, by
transformers), DFlash drafts in z-lab format (``dflash.model.DFlashDraftModel``) and in
speculators format, as models for the parity tests and as whole saved folders (``*_folder``)
for the conversion and checkpoint-error tests.

Weights are drawn with numpy from a seed (not with transformers' initializers), so a test's
models do not change when transformers changes its init. Norm weights are 1 + noise so that
a norm applied with the wrong weight (or not at all) shows up.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


def subprocess_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess on ``devices`` CPU devices: the suite's own (conftest: its compile
    options), the device count replaced."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return f"{flags.strip()} --xla_force_host_platform_device_count={devices}"


def fill_random(module: torch.nn.Module, seed: int, *, std: float = 0.02, embed_std: float = 1.0,
                norm_jitter: float = 0.1) -> torch.nn.Module:
    """Overwrite every parameter (tied ones once) with seeded numpy draws."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            shape = tuple(param.shape)
            if "norm" in name:
                value = 1.0 + norm_jitter * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                value = embed_std * rng.standard_normal(shape)
            else:
                value = std * rng.standard_normal(shape)
            param.copy_(torch.from_numpy(value.astype(np.float32)))
    return module


def qwen3_config(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int | None = None, intermediate: int | None = None, tie: bool = False,
                 rope_theta: float = 1_000_000.0, layer_types=None, sliding_window: int | None = None,
                 eps: float = 1e-6, max_position: int = 4096):
    from transformers import Qwen3Config

    kwargs = {}
    if sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim or hidden // heads, tie_word_embeddings=tie, rms_norm_eps=eps,
                       rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
                       max_position_embeddings=max_position, attn_implementation="eager", **kwargs)


# LLaMA-3.1's RoPE scaling shrunk to the tests' lengths: with head_dim 16 and theta 1e4, half the
# frequencies have wavelengths past original_max_position_embeddings (divided by 8) and one lies
# in the smoothed band, so at the tests' 10-30 positions the phases differ from plain RoPE by
# radians, not rounding (test_families checks that).
LLAMA3_TEST_ROPE = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama_config(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int | None = None,
                 intermediate: int | None = None, tie: bool = False, rope=None, bias: bool = False,
                 eps: float = 1e-5, max_position: int = 4096, rope_theta: float | None = None):
    from transformers import LlamaConfig

    rope = dict(rope or LLAMA3_TEST_ROPE)
    if rope_theta is not None:
        rope["rope_theta"] = float(rope_theta)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim or hidden // heads, tie_word_embeddings=tie, rms_norm_eps=eps,
                       rope_parameters=rope, max_position_embeddings=max_position, attention_bias=bias,
                       mlp_bias=bias, attn_implementation="eager")


def qwen3_moe_config(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int | None = None,
                     intermediate: int | None = None, tie: bool = False, rope_theta: float = 1e6,
                     experts: int = 8, top_k: int = 2, expert_width: int = 32, norm_topk_prob: bool = True,
                     sparse_step: int = 1, mlp_only_layers=(), eps: float = 1e-6, max_position: int = 4096):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim or hidden // heads, tie_word_embeddings=tie, rms_norm_eps=eps,
                          rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
                          max_position_embeddings=max_position, num_experts=experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=expert_width, norm_topk_prob=norm_topk_prob,
                          decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers),
                          attn_implementation="eager")


def gpt_oss_config(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int = 8,
                   experts: int = 4, top_k: int = 2, expert_width: int = 16, sliding_window: int = 4):
    """A GptOssConfig (its YaRN default, layers alternating a window and full attention)."""
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, num_local_experts=experts,
                        num_experts_per_tok=top_k, intermediate_size=expert_width, sliding_window=sliding_window,
                        max_position_embeddings=131072, attn_implementation="eager")


def hybrid_text_fields(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int = 16,
                       intermediate: int | None = None, tie: bool = False, rope_theta: float = 1e4,
                       partial_rotary: float = 0.25, layer_types=None, linear_heads=(2, 4), linear_dims=(16, 16),
                       experts: int | None = None, top_k: int = 2, expert_width: int = 32, shared_width: int = 48,
                       eps: float = 1e-6, max_position: int = 4096, **moe) -> dict:
    """The decoder fields of a Qwen3.5 / Qwen3-Next hybrid (linear attention with
    ``linear_heads`` (key, value) heads of ``linear_dims`` (key, value) dims; routed experts with
    a shared one when ``experts``)."""
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  tie_word_embeddings=tie, rms_norm_eps=eps, max_position_embeddings=max_position,
                  rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta),
                                   "partial_rotary_factor": partial_rotary},
                  linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1],
                  linear_key_head_dim=linear_dims[0], linear_value_head_dim=linear_dims[1], linear_conv_kernel_dim=4)
    if layer_types is not None:
        fields["layer_types"] = list(layer_types)
    if experts is not None:
        fields.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                      shared_expert_intermediate_size=shared_width, **moe)
    return fields


# A vision tower as small as transformers allows: releases carry one, the loader must skip it.
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def hybrid_config(family: str, **arch):
    """A Qwen3.5-family config: ``qwen3_5`` / ``qwen3_5_moe`` text-only (ForCausalLM),
    ``qwen3_5_release`` / ``qwen3_5_moe_release`` as released (ForConditionalGeneration with a
    tiny vision tower), ``qwen3_next``."""
    import transformers

    fields = hybrid_text_fields(**arch)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**fields, attn_implementation="eager")
    moe = "moe" in family
    if family.endswith("_release"):
        config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        vision = dict(TINY_VISION, out_hidden_size=fields["hidden_size"])
        config = config_class(text_config=fields, vision_config=vision, tie_word_embeddings=fields["tie_word_embeddings"])
    else:
        config_class = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        config = config_class(**fields)
    config._attn_implementation = "eager"
    return config


HYBRID_MODELS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                 "qwen3_5_release": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe_release": "Qwen3_5MoeForConditionalGeneration", "qwen3_next": "Qwen3NextForCausalLM"}
FAMILY_CONFIGS = {"qwen3": qwen3_config, "llama": llama_config, "qwen3_moe": qwen3_moe_config,
                  "gpt_oss": gpt_oss_config}


def decoder_layers(model):
    """The decoder layers of a causal LM or a release (ForConditionalGeneration)."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def make_target(*, seed: int = 0, std: float = 0.02, embed_std: float = 1.0, family: str = "qwen3", **config):
    """A causal LM of ``family`` (f32, eval) with seeded random weights."""
    import transformers

    if family in HYBRID_MODELS:
        model = getattr(transformers, HYBRID_MODELS[family])(hybrid_config(family, **config)).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS[family](**config)).eval()
    return fill_random(model, seed, std=std, embed_std=embed_std)


def edit_config(path: Path, edit) -> None:
    """Rewrite a model folder's config.json through ``edit(raw)``."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    edit(raw)
    file.write_text(json.dumps(raw, indent=2))


def save_target(model, path, *, rope_style: str = "parameters", drop_head_dim: bool = False,
                eos_token_id=None) -> Path:
    """save_pretrained, then optionally rewrite config.json in older styles: ``rope_style="theta"``
    puts ``rope_theta`` at the top level (no rope_parameters); ``"scaling"`` as LLaMA-3.1's
    release writes it (top-level ``rope_theta``, the rest under ``rope_scaling``); ``drop_head_dim``
    removes head_dim (only valid when it is 128, transformers' Qwen3Config default)."""
    path = Path(path)
    model.save_pretrained(path)

    def edit(raw):
        if rope_style == "theta":
            raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        if rope_style == "scaling":
            scaling = raw.pop("rope_parameters")
            raw["rope_theta"] = scaling.pop("rope_theta")
            raw["rope_scaling"] = scaling
        if drop_head_dim:
            assert raw["head_dim"] == 128
            del raw["head_dim"]
        if eos_token_id is not None:
            raw["eos_token_id"] = eos_token_id

    edit_config(path, edit)
    return path


def save_mxfp4_gpt_oss(model, path, seed: int) -> Path:
    """A released-style gpt-oss folder: every layer's experts given random MXFP4 codes (set in
    ``model`` as transformers dequantises them, so that ``model`` is the folder's model), stored
    as ``*_blocks`` / ``*_scales`` with quantization_config mxfp4 as gpt-oss publishes it."""
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_numpy
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from dflash_jax.model.families.gpt_oss import MXFP4_QUANTIZATION

    rng, packed = np.random.default_rng(seed), {}
    for index, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(layer.mlp.experts, name)            # [E, in, out]
            e, inputs, outputs = weight.shape
            blocks = rng.integers(0, 256, (e, outputs, inputs // 32, 16), dtype=np.uint8)
            scales = rng.integers(121, 125, (e, outputs, inputs // 32), dtype=np.uint8)
            with torch.no_grad():
                weight.copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                        dtype=torch.float32))
            packed[f"model.layers.{index}.mlp.experts.{name}"] = (blocks, scales)
    path = Path(path)
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_numpy(tensors, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, lambda raw: raw.update(quantization_config=MXFP4_QUANTIZATION))
    return path


def make_zlab_draft(target, *, layers: int = 2, block_size: int = 16, mask_token_id: int | None = None,
                    target_layer_ids=(1, 2), heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                    rope_theta: float = 10_000.0, layer_types=None, sliding_window: int | None = None,
                    extra: dict | None = None, seed: int = 100, std: float = 0.02, rope: dict | None = None):
    """A z-lab DFlashDraftModel (Qwen3 layers) reading ``target`` (a causal LM of any family),
    seeded random weights; ``rope`` replaces its default RoPE (a llama3 one, as LLaMA drafts)."""
    from dflash.model import DFlashDraftModel

    tcfg = target.config.get_text_config()
    cfg = qwen3_config(vocab=tcfg.vocab_size, hidden=tcfg.hidden_size, layers=layers, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, intermediate=tcfg.intermediate_size,
                       rope_theta=rope_theta, layer_types=layer_types, sliding_window=sliding_window,
                       eps=tcfg.rms_norm_eps)
    if rope is not None:
        cfg.rope_parameters = dict(rope)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = block_size
    cfg.num_target_layers = tcfg.num_hidden_layers
    dflash = {"mask_token_id": tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    dflash.update(extra or {})
    cfg.dflash_config = dflash
    model = DFlashDraftModel(cfg).eval()
    return fill_random(model, seed, std=std)


def save_draft(model, path) -> Path:
    path = Path(path)
    model.save_pretrained(path)
    return path


def output_head_weight(target) -> torch.Tensor:
    return target.get_output_embeddings().weight


def save_speculators_draft(draft, target, path, *, selected_ids=None) -> Path:
    """Write ``draft`` (a z-lab DFlashDraftModel) in vLLM speculators format.

    ``selected_ids`` (sorted target ids) makes a reduced draft vocabulary: ``lm_head`` holds only
    those rows of the target's output head, ``d2t[i] = selected_ids[i] - i`` (int64) and ``t2d``
    is the bool mask of selected target ids."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dcfg = draft.config
    vocab = dcfg.vocab_size
    layer_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                  "rope_parameters", "attention_bias", "layer_types", "sliding_window", "use_sliding_window",
                  "tie_word_embeddings")
    full = dcfg.to_dict()
    layer_config = {"model_type": "qwen3", **{k: full[k] for k in layer_keys if k in full}}
    ids = list(draft.target_layer_ids)
    draft_vocab = vocab if selected_ids is None else len(selected_ids)
    config = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer_config,
        "block_size": int(draft.block_size),
        "mask_token_id": int(draft.mask_token_id),
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "draft_vocab_size": draft_vocab,
        "speculators_version": "0.3.0",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: value.detach().clone().contiguous() for name, value in draft.state_dict().items()
               if not name.endswith("inv_freq")}
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    head = output_head_weight(target).detach().clone()
    if selected_ids is None:
        tensors["lm_head.weight"] = head
    else:
        selected = torch.as_tensor(np.asarray(selected_ids), dtype=torch.long)
        assert bool((selected[1:] > selected[:-1]).all()), "selected_ids must be sorted and unique"
        tensors["lm_head.weight"] = head[selected].contiguous()
        tensors["d2t"] = selected - torch.arange(len(selected))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[selected] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _rope_freqs(module, theta: float, rotary_dim: int) -> np.ndarray:
    """The inverse frequencies a model's RoPE rotates by: theta ** (-2i / rotary_dim) in float64
    for plain RoPE (what the Qwen3 pairs were built with), else its own scaled ones (llama3)."""
    rotary = module.rotary_emb
    if getattr(rotary, "rope_type", "default") == "default":
        return theta ** (-np.arange(rotary_dim // 2) * 2.0 / rotary_dim)
    return rotary.inv_freq.double().numpy()


def _rope_peak_query(head_dim: int, freqs: np.ndarray, offset: int, amplitude: float, pairs: int) -> np.ndarray:
    """q with q . rope(k) maximal when q_pos - k_pos == offset, for k = ones on the first ``pairs``
    rotary pairs (HF rotate_half layout: pair j is dims j and j + rotary_dim/2)."""
    half = len(freqs)
    q = np.zeros(head_dim)
    q[:pairs] = amplitude * np.cos(offset * freqs[:pairs])
    q[half:half + pairs] = -amplitude * np.sin(offset * freqs[:pairs])
    return q


def _copy_head(attn, *, hidden: int, head_dim: int, freqs: np.ndarray, offset: int, code_dims: int, gain: float,
               amplitude: float = 90.0, pairs: int = 3, input_dim0: float = 1.0) -> None:
    """Make ``attn`` (an attention with 2 kv heads) attend from every position to the one
    ``offset`` tokens earlier (queries/keys read only the constant hidden dim 0; RoPE does the
    rest) and add ``gain`` x that token's code dims (1..code_dims) back onto the same dims.

    With q/k norms (Qwen3) the norm weights carry the query and key patterns (the projections give
    constant vectors, which the norms map to ones); without them (LLaMA) the projections do,
    scaled by ``input_dim0``, the value the input norm gives hidden dim 0 (about the same for
    every token)."""
    peak = torch.tensor(_rope_peak_query(head_dim, freqs, offset, amplitude, pairs), dtype=torch.float32)
    k = torch.zeros(head_dim)
    k[:pairs] = 1.0
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
        if hasattr(attn, "q_norm"):
            # (a gated attention's q_proj also yields its gate: 1 here, so sigmoid(gate) ~ 1)
            attn.q_proj.weight[:, 0] = 1.0
            attn.k_proj.weight[:, 0] = 1.0
            centre = 1.0 if type(attn.q_norm).__name__ in ZERO_CENTRED_NORMS else 0.0  # they scale by 1 + w
            attn.q_norm.weight.copy_(peak - centre)
            attn.k_norm.weight.copy_(k - centre)
        else:
            attn.q_proj.weight[:, 0] = peak.repeat(attn.q_proj.weight.shape[0] // head_dim) / input_dim0
            attn.k_proj.weight[:, 0] = k.repeat(attn.k_proj.weight.shape[0] // head_dim) / input_dim0
        kv_dims = attn.v_proj.weight.shape[0]
        assert kv_dims >= code_dims
        for i in range(code_dims):
            attn.v_proj.weight[i, 1 + i] = 1.0
        group = attn.o_proj.weight.shape[1] // kv_dims    # q heads per kv head
        for i in range(code_dims):
            kv_head, within = divmod(i, head_dim)
            q_head = kv_head * group                       # first q head reading that kv head
            attn.o_proj.weight[1 + i, q_head * head_dim + within] = gain


ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
COPY_THETA = 1e4   # rope theta of the copy construction (its high frequencies make the offset peak sharp)
CODE_DIMS = 32     # hidden dims 1..32 carry a token's identity code


def make_copy_target(*, period: int = 6, seed: int = 0, noise: float = 0.02, head_noise: float = 0.45,
                     gain: float = 1.0, mask_token_id: int = 127, family: str = "qwen3", linear_noise: float = 0.0,
                     **family_kwargs):
    """A target of ``family`` (V 128, H 64, 4 layers, 4/2 heads, head_dim 16, rope 1e4; LLaMA:
    its test llama3 RoPE; MoE: random experts) that continues a prompt (of at least ``period``
    tokens) by copying the token ``period`` positions back, with deterministic content-dependent
    deviations from LM-head noise ``head_noise``.

    Hidden dim 0 is a constant (every embedding has 1 there) that the copy head's queries and keys
    read, so its attention pattern depends only on relative position (RoPE); dims 1..32 hold a
    random unit code per token that the copy head moves and the LM head reads. The mask token has
    no code. Every other weight is small random noise, so every weight still matters. A hybrid's
    layer 1 is its attention (the others Gated DeltaNet, whose output projections get
    ``linear_noise`` so that their recurrent states move the output)."""
    vocab, hidden, head_dim = 128, 64, 16
    if family in HYBRID_MODELS:
        family_kwargs = {"layer_types": ("linear_attention", "full_attention", "linear_attention", "linear_attention"),
                         "partial_rotary": 0.5, **family_kwargs}
    target = make_target(seed=seed, std=noise, vocab=vocab, hidden=hidden, layers=4, heads=4, kv_heads=2,
                         head_dim=head_dim, rope_theta=COPY_THETA, family=family, **family_kwargs)
    layers = decoder_layers(target)
    text = target.config.get_text_config()
    rotary_dim = int(head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0))
    rng = np.random.default_rng(seed + 1000)
    codes = rng.standard_normal((vocab, CODE_DIMS))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    with torch.no_grad():
        embed = target.get_input_embeddings().weight
        embed.mul_(noise)
        embed[:, 0] = 1.0
        embed[:, 1:1 + CODE_DIMS] = torch.tensor(codes, dtype=torch.float32)
        embed[mask_token_id, 1:1 + CODE_DIMS] = 0.0
        # hidden dim 0 after layer 1's input norm: 1 / rms(embedding), |embedding|^2 ~ 2
        input_dim0 = float(layers[1].input_layernorm.weight[0]) * (hidden / 2) ** 0.5
        inner = getattr(target.model, "language_model", target.model)
        _copy_head(layers[1].self_attn, hidden=hidden, head_dim=head_dim,
                   freqs=_rope_freqs(inner, COPY_THETA, rotary_dim), offset=period - 1, code_dims=CODE_DIMS,
                   gain=gain, input_dim0=input_dim0, pairs=min(3, rotary_dim // 2))
        rng_linear = np.random.default_rng(seed + 2000)
        for layer in layers:
            if hasattr(layer, "linear_attn") and linear_noise:
                out = layer.linear_attn.out_proj.weight
                out.copy_(torch.tensor(linear_noise * rng_linear.standard_normal(tuple(out.shape)), dtype=torch.float32))
        head = output_head_weight(target)
        head.copy_(torch.tensor(head_noise * rng.standard_normal((vocab, hidden)), dtype=torch.float32))
        head[:, 1:1 + CODE_DIMS] += torch.tensor(codes, dtype=torch.float32)
        head[:, 0] = 0.0
    return target


def make_copy_draft(target, *, period: int = 6, seed: int = 100, noise: float = 0.02, gain: float = 1.0,
                    **draft_kwargs):
    """A z-lab draft for ``make_copy_target`` that copies the same way from the context features
    (``fc`` passes the first tap, layer 0's output, through; draft layer 0 attends ``period``
    back), so it is right about the next ``period`` tokens until the target deviates: varied
    acceptance lengths, mean > 2, varied tokens. Extra kwargs go to ``make_zlab_draft``."""
    kwargs = dict(layers=2, block_size=16, target_layer_ids=(0, 1), heads=4, kv_heads=2, rope_theta=COPY_THETA,
                  mask_token_id=127, seed=seed, std=noise)
    kwargs.update(draft_kwargs)
    draft = make_zlab_draft(target, **kwargs)
    hidden = target.config.get_text_config().hidden_size
    with torch.no_grad():
        fc = draft.fc.weight
        fc.mul_(0.1)
        fc[:, :hidden] += torch.eye(hidden)
        _copy_head(draft.layers[0].self_attn, hidden=hidden, head_dim=draft.config.head_dim,
                   freqs=_rope_freqs(draft, draft.config.rope_parameters["rope_theta"], draft.config.head_dim),
                   offset=period, code_dims=CODE_DIMS, gain=gain)
    return draft


def as_dflash2(draft, *, kernel_size: int = 2, group_size: int = 8, rank: int = 6, top_k: int = 5, seed: int = 0,
               conv_std: float = 0.05, selector_std: float = 0.3):
    """The PyPI reference's DFlash2DraftModel with ``draft``'s (a DFlashDraftModel) weights, and
    seeded random convolutions (the reference leaves ``base_kernel`` uninitialised) and selector:
    small enough that a copying draft keeps varied acceptance, large enough to change it."""
    from dflash.model import DFlash2DraftModel

    config = copy.deepcopy(draft.config)
    config.architectures = ["DFlash2DraftModel"]
    config.dflash_config = {**config.dflash_config, "conv_kernel_size": kernel_size, "conv_group_size": group_size,
                            "selector_rank": rank, "selector_top_k": top_k}
    model = DFlash2DraftModel(config).eval()
    missing, unexpected = model.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all("conv" in name or "candidate_selector" in name for name in missing)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "conv" in name:
                tensor.normal_(0.0, conv_std, generator=gen)
            elif "candidate_selector" in name:
                tensor.normal_(0.0, selector_std, generator=gen)
    return model


# ---------------------------------------------------------------------------------------------
# Whole HF folders for the conversion and checkpoint-error tests (stand-in tokenizer files).

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def qwen3_fields(**overrides) -> dict:
    """A tiny Qwen3 config (hidden 32, 2 layers, GQA 4:2)."""
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)
    return {**fields, **overrides}


def write_tokenizer(folder: Path) -> int:
    """A real byte-level BPE tokenizer (eos ``<|endoftext|>``, no chat template) in ``folder``,
    trained on a line of code; returns its vocabulary size (a target's may be larger, padded as
    released vocabularies are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tokenizer.get_vocab_size()


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


def write_chat_tokenizer(folder: Path) -> int:
    """write_tokenizer's BPE plus chat special tokens and a ChatML template (``CHAT_TEMPLATE``,
    with Qwen3's enable_thinking switch); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                   "<|im_end|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


def write_chat_pair(target_dir: Path, draft_dir: Path, **config) -> None:
    """A tiny random Qwen3 target with ``write_chat_tokenizer``'s tokenizer and template, and a
    1-layer z-lab draft over its layer 1 (block 4), saved by transformers and the z-lab package;
    ``config`` overrides both configs' fields."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = write_chat_tokenizer(target_dir)
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, **config)
    Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **shape)).save_pretrained(target_dir)
    draft_config = Qwen3Config(num_hidden_layers=1, **shape)
    draft_config.block_size, draft_config.num_target_layers = 4, 2
    draft_config.dflash_config = {"mask_token_id": 3, "target_layer_ids": [1]}
    draft_config.architectures = ["DFlashDraftModel"]
    DFlashDraftModel(draft_config).save_pretrained(draft_dir)


def target_folder(directory: Path, *, dtype: str = "float32", seed: int = 0, max_shard_size=None,
                  **config) -> torch.nn.Module:
    """Save a random transformers Qwen3ForCausalLM (plus stand-in tokenizer files) and return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**qwen3_fields(**config)))
    model = fill_random(model, seed, std=0.5, embed_std=0.5, norm_jitter=0.5).to(TORCH_DTYPES[dtype])
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    (directory / "tokenizer.json").write_text('{"stand-in": true}')
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    return model


def zlab_draft_folder(directory: Path, *, dtype: str = "float32", seed: int = 1, **config) -> torch.nn.Module:
    """Save a random z-lab DFlashDraftModel (first layer sliding-window) and return it."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    fields = qwen3_fields(architectures=["DFlashDraftModel"], block_size=4, num_target_layers=4,
                          dflash_config={"mask_token_id": 100, "target_layer_ids": [1, 2]},
                          use_sliding_window=True, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], **config)
    model = fill_random(DFlashDraftModel(Qwen3Config(**fields)), seed, std=0.5, embed_std=0.5, norm_jitter=0.5)
    model = model.to(TORCH_DTYPES[dtype])
    model.save_pretrained(directory)
    return model


def speculators_draft_folder(directory: Path, *, draft_vocab: int | None = 64, seed: int = 2) -> dict:
    """Write a speculators-format DFlash draft by hand; returns its tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    layer = qwen3_fields(model_type="qwen3")
    v, h = layer["vocab_size"], layer["hidden_size"]
    raw = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
           "transformer_layer_config": layer, "block_size": 4, "mask_token_id": 100,
           "aux_hidden_state_layer_ids": [2, 3], "draft_vocab_size": draft_vocab or v}
    (directory / "config.json").write_text(json.dumps(raw))
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(shape, generator=generator)  # noqa: E731
    d, i, kv = layer["head_dim"], layer["intermediate_size"], layer["num_key_value_heads"] * layer["head_dim"]
    q = layer["num_attention_heads"] * d
    tensors = {"fc.weight": rand(h, 2 * h), "hidden_norm.weight": rand(h), "norm.weight": rand(h),
               "embed_tokens.weight": rand(v, h), "lm_head.weight": rand(draft_vocab or v, h)}
    for n in range(layer["num_hidden_layers"]):
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                  "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                  "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        tensors.update({f"layers.{n}.{name}": rand(*shape) for name, shape in shapes.items()})
    if draft_vocab:
        targets = torch.sort(torch.randperm(v, generator=generator)[:draft_vocab]).values
        tensors["d2t"] = targets - torch.arange(draft_vocab)   # target_id = i + d2t[i]
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def train_briefly(target, config, folder: Path, *, vocab: int):
    """Three f32 steps of ``train_draft`` for ``target`` on 16 random rows of 32 token ids below
    ``vocab``, exported to ``folder``; returns what ``train_draft`` returns."""
    from dflash_jax.training import data, train_draft
    from dflash_jax.training.train_target import OptimConfig

    rows = data.TokenRows(np.random.default_rng(0).integers(0, vocab, (16, 32)).astype(np.int32),
                          np.ones((16, 32), bool))
    recipe = train_draft.DraftTrainConfig(optim=OptimConfig(steps=3, lr=1e-3), num_anchors=4, batch_size=2,
                                          compute_dtype="float32", save_every=10)
    return train_draft.train_draft(target, rows, folder, config, recipe, export_dtype="float32")

"""The one decoder forward that every target family and the draft run: each layer does what its
spec says (pre-norm -> mixer -> residual -> post-norm -> dense or routed feed-forward ->
residual). Layers are unrolled in Python: a ``lax.scan`` over stacked layers measured ~2.3x
slower for decode on an H200 (benchmarks/RESULTS.md), and specs may differ from layer to layer.

Which keys an attention query sees, and which recurrent state a Gated DeltaNet layer continues,
is the caller's ``attend``:

    attend(state, index, spec, params, projected, positions) -> (out, state)

gets layer ``index``'s mixer spec and params and its fused input projection of tokens at
``positions`` [B, T] (q | k | v [| gate] of attention, out [B, T, Hq, D]; or q | k | v | z | b | a
of Gated DeltaNet, out [B, T, Hv, dv]) and threads ``state`` (a target's cache; nothing for a
draft's block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import struct

from dflash_jax.model import ops
from dflash_jax.model.nn import attention, dynamic_conv, gated_deltanet, mlp, moe
from dflash_jax.model.nn.attention import AttentionParams, AttentionSpec, init_attention
from dflash_jax.model.nn.dynamic_conv import ConvParams, ConvSpec, init_conv
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetParams, GatedDeltaNetSpec, init_gated_deltanet
from dflash_jax.model.nn.mlp import MLPParams, MLPSpec, init_mlp
from dflash_jax.model.nn.moe import MoEParams, MoESpec, init_moe
from pallas_kernels import rms_norm

Attend = Callable[[Any, int, AttentionSpec | GatedDeltaNetSpec, AttentionParams | GatedDeltaNetParams, jax.Array,
                   jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: pre-norm, a mixer (softmax attention, or Gated DeltaNet linear attention
    in hybrids), residual; post-norm, a feed-forward block, residual. ``kind`` is HF's
    ``layer_types`` label; it can differ from what the mixer does (a "sliding_attention" layer
    without a window attends fully) and DFlash drafts read it (the reference makes its sliding
    layers causal). ``conv``: DFlash2's dynamic convolution around both sublayers (drafts only)."""

    mixer: AttentionSpec | GatedDeltaNetSpec
    ffn: MLPSpec | MoESpec
    kind: str = "full_attention"
    conv: ConvSpec | None = None


@struct.dataclass
class LayerParams:
    """One decoder layer (H hidden): its norms, token mixer (``attention``: softmax attention, or
    Gated DeltaNet's linear attention) and feed-forward block; a DFlash2 draft layer's dynamic
    convolutions around each (``nn.dynamic_conv``)."""

    input_norm: jax.Array              # [H]
    attention: AttentionParams | GatedDeltaNetParams
    post_attention_norm: jax.Array     # [H]
    ffn: MLPParams | MoEParams
    attention_conv: ConvParams | None = None
    mlp_conv: ConvParams | None = None


def init_layer(spec: LayerSpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> LayerParams:
    """Random layer (normal(0, scale) weights, unit norms): for tests and benchmarks."""
    k_attn, k_ffn, k_conv1, k_conv2 = jax.random.split(key, 4)
    init_ffn = init_mlp if isinstance(spec.ffn, MLPSpec) else init_moe
    ones = lambda: jax.numpy.ones((hidden,), dtype)  # noqa: E731 (one buffer each: training donates them)
    init_mixer = init_attention if isinstance(spec.mixer, AttentionSpec) else init_gated_deltanet
    conv = (lambda k: init_conv(spec.conv, hidden, k, dtype, scale)) if spec.conv else (lambda k: None)  # noqa: E731
    return LayerParams(input_norm=ones(), attention=init_mixer(spec.mixer, hidden, k_attn, dtype, scale),
                       post_attention_norm=ones(), ffn=init_ffn(spec.ffn, hidden, k_ffn, dtype, scale),
                       attention_conv=conv(k_conv1), mlp_conv=conv(k_conv2))


def norm_scale(weight: jax.Array | None) -> jax.Array | None:
    """The scale of a zero-centred RMSNorm of weight w: 1 + w (added in f32, as transformers)."""
    return None if weight is None else (1.0 + weight.astype(jax.numpy.float32)).astype(weight.dtype)


def with_norm_scales(params: LayerParams) -> LayerParams:
    """A layer of zero-centred norms (Qwen3.5) as one of plain norms: each norm weight w replaced
    by its scale 1 + w (the checkpoint's w are kept as they are, so conversion and export are
    exact; XLA hoists these few vectors out of a decode loop)."""
    mixer = params.attention
    if isinstance(mixer, AttentionParams):
        mixer = mixer.replace(q_norm=norm_scale(mixer.q_norm), k_norm=norm_scale(mixer.k_norm))
    return params.replace(input_norm=norm_scale(params.input_norm), attention=mixer,
                          post_attention_norm=norm_scale(params.post_attention_norm))


def feed_forward(x: jax.Array, params: LayerParams, spec: LayerSpec, eps: float, impl: str,
                 tensor_axis: str | None = None) -> jax.Array:
    """The post-attention half of a layer: x + ffn(post_attention_norm(x))."""
    if isinstance(spec.ffn, MLPSpec):
        return mlp.forward(x, params.ffn, params.post_attention_norm, eps, impl, tensor_axis)
    return moe.forward(x, params.ffn, spec.ffn, params.post_attention_norm, eps, impl, tensor_axis)


def layer_forward(x: jax.Array, params: LayerParams, spec: LayerSpec, index: int, positions: jax.Array,
                  attend: Attend, state: Any, eps: float, impl: str,
                  tensor_axis: str | None = None) -> tuple[jax.Array, Any]:
    """One layer on x [B, T, H] at ``positions`` [B, T] (``tensor_axis``: the layer is one
    shard's part, its row-parallel outputs summed over that mesh axis)."""
    mixer = spec.mixer
    if spec.conv is not None:
        return _convolved_layer(x, params, spec, index, positions, attend, state, eps, impl, tensor_axis)
    if isinstance(mixer, AttentionSpec):
        projected = attention.project_qkv(x, params.attention, params.input_norm, eps, impl)
        out, state = attend(state, index, mixer, params.attention, projected, positions)
        x = attention.output(x, out, projected, params.attention, mixer, impl, tensor_axis)
    else:
        projected = gated_deltanet.project(x, params.attention, params.input_norm, eps, impl)
        out, state = attend(state, index, mixer, params.attention, projected, positions)
        x = gated_deltanet.output(x, out, projected, params.attention, mixer, eps, impl, tensor_axis)
    return feed_forward(x, params, spec, eps, impl, tensor_axis), state


def _convolved_layer(x: jax.Array, params: LayerParams, spec: LayerSpec, index: int, positions: jax.Array,
                     attend: Attend, state: Any, eps: float, impl: str,
                     tensor_axis: str | None) -> tuple[jax.Array, Any]:
    """A DFlash2 draft layer: each sublayer's normed input convolved before it, its output after
    it (``nn.dynamic_conv``; the positions of x are the block's). Attention and a dense MLP; with
    ``tensor_axis`` each sublayer's partial products are summed before its output is convolved
    (the convolutions act on whole hidden vectors, as every shard holds them)."""
    if not isinstance(spec.mixer, AttentionSpec) or not isinstance(spec.ffn, MLPSpec):
        raise ValueError("a convolved (DFlash2) layer is softmax attention and a dense MLP")
    h, after = dynamic_conv.prepare(rms_norm(x, params.input_norm, eps), params.attention_conv, spec.conv)
    projected = ops.project(h, params.attention.qkv_proj, bias=params.attention.qkv_bias, impl=impl)
    out, state = attend(state, index, spec.mixer, params.attention, projected, positions)
    out = ops.project(out.reshape(*out.shape[:2], -1), params.attention.o_proj, bias=params.attention.o_bias,
                      sum_over=tensor_axis, impl=impl)
    x = x + dynamic_conv.finish(out, after, params.attention_conv, spec.conv)
    h, after = dynamic_conv.prepare(rms_norm(x, params.post_attention_norm, eps), params.mlp_conv, spec.conv)
    y = mlp.swiglu(h, params.ffn, impl, sum_over=tensor_axis)
    return x + dynamic_conv.finish(y, after, params.mlp_conv, spec.conv), state


def run(layers: Sequence[LayerParams], specs: Sequence[LayerSpec], x: jax.Array, positions: jax.Array,
        attend: Attend, state: Any, *, eps: float, impl: str, tap_layers: tuple[int, ...] = (),
        zero_centred_norms: bool = False,
        tensor_axis: str | None = None) -> tuple[jax.Array, dict[int, jax.Array], Any]:
    """Every layer in turn. Returns the last layer's output (not final-normed), the outputs of
    ``tap_layers`` by index, and the threaded state."""
    taps = {}
    for index, (params, spec) in enumerate(zip(layers, specs, strict=True)):
        if zero_centred_norms:
            params = with_norm_scales(params)
        x, state = layer_forward(x, params, spec, index, positions, attend, state, eps, impl, tensor_axis)
        if index in tap_layers:
            taps[index] = x
    return x, taps, state

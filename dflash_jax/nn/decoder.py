"""The one decoder forward that every target family and the draft run: each layer does what its
spec says (pre-norm -> mixer -> residual -> post-norm -> dense or routed feed-forward ->
residual). Layers are unrolled in Python: a ``lax.scan`` over stacked layers measured ~2.3x
slower for decode on an H200 (benchmarks/RESULTS.md), and specs may differ from layer to layer.

Which keys an attention query sees is the caller's ``attend``:

    attend(state, index, spec, params, qkv, positions) -> (out [B, T, Hq, D], state)

gets layer ``index``'s fused projection qkv [B, T, (Hq + 2 Hkv) * D] of tokens at ``positions``
[B, T] and threads ``state`` (a target's paged cache; nothing for a draft's block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import struct

from dflash_jax.config import LayerSpec
from dflash_jax.nn import attention, mlp, moe
from dflash_jax.nn.attention import AttentionParams, AttentionSpec, init_attention
from dflash_jax.nn.mlp import MLPParams, MLPSpec, init_mlp
from dflash_jax.nn.moe import MoEParams, init_moe

Attend = Callable[[Any, int, AttentionSpec, AttentionParams, jax.Array, jax.Array], tuple[jax.Array, Any]]


@struct.dataclass
class LayerParams:
    """One decoder layer (H hidden): its norms, attention and feed-forward block."""

    input_norm: jax.Array              # [H]
    attention: AttentionParams
    post_attention_norm: jax.Array     # [H]
    ffn: MLPParams | MoEParams


def init_layer(spec: LayerSpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> LayerParams:
    """Random layer (normal(0, scale) weights, unit norms): for tests and benchmarks."""
    k_attn, k_ffn = jax.random.split(key)
    init_ffn = init_mlp if isinstance(spec.ffn, MLPSpec) else init_moe
    ones = lambda: jax.numpy.ones((hidden,), dtype)  # noqa: E731 (one buffer each: training donates them)
    return LayerParams(input_norm=ones(), attention=init_attention(spec.mixer, hidden, k_attn, dtype, scale),
                       post_attention_norm=ones(), ffn=init_ffn(spec.ffn, hidden, k_ffn, dtype, scale))


def feed_forward(x: jax.Array, params: LayerParams, spec: LayerSpec, eps: float, impl: str) -> jax.Array:
    """The post-attention half of a layer: x + ffn(post_attention_norm(x))."""
    if isinstance(spec.ffn, MLPSpec):
        return mlp.forward(x, params.ffn, params.post_attention_norm, eps, impl)
    return moe.forward(x, params.ffn, spec.ffn, params.post_attention_norm, eps, impl)


def layer_forward(x: jax.Array, params: LayerParams, spec: LayerSpec, index: int, positions: jax.Array,
                  attend: Attend, state: Any, eps: float, impl: str) -> tuple[jax.Array, Any]:
    """One layer on x [B, T, H] at ``positions`` [B, T]."""
    qkv = attention.project_qkv(x, params.attention, params.input_norm, eps, impl)
    out, state = attend(state, index, spec.mixer, params.attention, qkv, positions)
    x = attention.output(x, out, params.attention, impl)
    return feed_forward(x, params, spec, eps, impl), state


def run(layers: Sequence[LayerParams], specs: Sequence[LayerSpec], x: jax.Array, positions: jax.Array,
        attend: Attend, state: Any, *, eps: float, impl: str,
        tap_layers: tuple[int, ...] = ()) -> tuple[jax.Array, dict[int, jax.Array], Any]:
    """Every layer in turn. Returns the last layer's output (not final-normed), the outputs of
    ``tap_layers`` by index, and the threaded state."""
    taps = {}
    for index, (params, spec) in enumerate(zip(layers, specs, strict=True)):
        x, state = layer_forward(x, params, spec, index, positions, attend, state, eps, impl)
        if index in tap_layers:
            taps[index] = x
    return x, taps, state

"""Qwen3 target forward over the paged KV cache: prefill, decode and verify are one function.

Layers are unrolled in Python (a ``lax.scan`` over stacked layers measured ~2.3x slower for
decode on the H200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax import attention
from dflash_jax.cache import PagedKVCache
from dflash_jax.config import ModelConfig
from dflash_jax.params import LayerParams, TargetParams
from pallas_kernels import rms_norm


def attention_output_and_mlp(x: jax.Array, out: jax.Array, layer: LayerParams, eps: float,
                             impl: str) -> jax.Array:
    """The rest of a decoder layer after attention out [B, T, Hq, D]: o_proj + residual, then the
    SwiGLU MLP (post-attention norm, gate|up, silu(gate) * up, down) + residual."""
    x = attention.project(out.reshape(*out.shape[:2], -1), layer.o_proj, residual=x, impl=impl)
    h = attention.project(x, layer.gate_up_proj, norm_weight=layer.post_attention_norm, eps=eps,
                          gated=True, impl=impl)
    return attention.project(h, layer.down_proj, residual=x, impl=impl)


def target_layer(x: jax.Array, layer: LayerParams, config: ModelConfig, index: int, positions: jax.Array,
                 cache: PagedKVCache, impl: str) -> tuple[jax.Array, PagedKVCache]:
    """One decoder layer on x [B, T, H] at ``positions`` [B, T] (contiguous per sequence)."""
    eps, theta = config.rms_norm_eps, config.rope_theta
    qkv = attention.project(x, layer.qkv_proj, norm_weight=layer.input_norm, eps=eps, impl=impl)
    q, k_pages, v_pages = attention.qkv_norm_rope_write(
        qkv, layer.q_norm, layer.k_norm, positions,
        *cache.layer(index), cache.page_table, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        eps=eps, theta=theta, impl=impl)
    cache = cache.replace_layer(index, k_pages, v_pages)
    out = attention.verify_attention(q, k_pages, v_pages, cache.page_table, positions[:, 0],
                                     sliding_window=config.window(index), impl=impl)
    return attention_output_and_mlp(x, out, layer, eps, impl), cache


def forward(params: TargetParams, config: ModelConfig, tokens: jax.Array, start: jax.Array,
            cache: PagedKVCache, *, tap_layers: tuple[int, ...] = (),
            impl: str = "auto") -> tuple[jax.Array, jax.Array | None, PagedKVCache]:
    """Run tokens [B, T] at positions start[b] + t, writing their K/V into the cache.

    Returns the final-normed hidden states [B, T, H], the outputs of ``tap_layers`` (HF
    ``hidden_states[k + 1]``; for the last layer that is the final-normed state) concatenated on
    the feature axis [B, T, len(tap_layers) * H] (None when no taps), and the cache. The cache's
    ``lengths`` are not changed: committing is the caller's decision.
    """
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    x = params.embed[tokens]
    outputs = {}
    for index, layer in enumerate(params.layers):
        x, cache = target_layer(x, layer, config, index, positions, cache, impl)
        if index in tap_layers:
            outputs[index] = x
    normed = rms_norm(x, params.norm, config.rms_norm_eps)
    # HF's hidden_states[L] (what the z-lab reference taps for the last layer) is the final-normed
    # state, not the raw output of the last decoder layer.
    if config.num_layers - 1 in outputs:
        outputs[config.num_layers - 1] = normed
    taps = jnp.concatenate([outputs[i] for i in tap_layers], axis=-1) if tap_layers else None
    return normed, taps, cache


def logits(params: TargetParams, hidden: jax.Array) -> jax.Array:
    """LM head (tied or not) with f32 accumulation and output."""
    if params.lm_head is None:
        return jnp.einsum("...h,vh->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...h,hv->...v", hidden, params.lm_head, preferred_element_type=jnp.float32)

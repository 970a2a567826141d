"""DFlash draft forward: context K/V materialization and the non-causal block pass.

The draft has no embedding or LM head of its own: it borrows the target's (a speculators
draft with a reduced vocabulary brings its own LM head and a d2t map back to target ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from dflash_jax.model import ops
from dflash_jax.model.cache import PagedKVCache
from dflash_jax.model.config import DraftConfig
from dflash_jax.model.nn import attention, decoder
from dflash_jax.model.collectives import embed_lookup, local_vocab
from dflash_jax.model.params import DraftParams, TargetParams
from dflash_jax.model.target import logits as target_logits
from pallas_kernels import rms_norm, split_qkv


def context_features(params: DraftParams, config: DraftConfig, taps: jax.Array) -> jax.Array:
    """fc + hidden_norm of concatenated target taps [B, T, n*H] -> [B, T, H]."""
    return rms_norm(taps @ params.fc, params.hidden_norm, config.model.rms_norm_eps)


def context_kv_proj(params: DraftParams) -> tuple[jax.Array, ...]:
    """Each draft layer's k|v columns of ``qkv_proj``, [H, 2*Hkv*D]: context tokens need no q.

    Slicing the columns copies the weight: XLA does not fold the slice into the product (Qwen3-8B
    draft on an H200: five 11 µs copies per decode step). The decode loop slices once per chunk.
    """
    return tuple(layer.attention.qkv_proj[:, layer.attention.q_size:] for layer in params.layers)


def write_context(params: DraftParams, config: DraftConfig, taps: jax.Array, positions: jax.Array,
                  cache: PagedKVCache, *, impl: str = "auto",
                  kv_proj: Sequence[jax.Array] | None = None) -> PagedKVCache:
    """Project taps [B, T, n*H] of tokens at ``positions`` [B, T] into every draft layer's
    context K/V (k_proj [+ bias] + k_norm + RoPE, v_proj [+ bias]) and store them in the draft's
    pages. ``kv_proj``: ``context_kv_proj(params)``, when the caller has it already."""
    model = config.model
    features = context_features(params, config, taps)
    kv_proj = context_kv_proj(params) if kv_proj is None else kv_proj
    for index, (layer, spec, weight) in enumerate(zip(params.layers, model.layers, kv_proj, strict=True)):
        slot = cache.num_target_layers + index
        attn = layer.attention
        kv = features @ weight
        if attn.qkv_bias is not None:
            kv = kv + attn.qkv_bias[attn.q_size:]
        _, k, v = split_qkv(kv, 0, spec.mixer.num_kv_heads)
        cos, sin = attention.rotary_tables(positions, spec.mixer, features.dtype)
        k_pages, v_pages = ops.write_kv(k, v, attn.k_norm, cos, sin, positions, *cache.layer(slot),
                                        cache.page_table, eps=model.rms_norm_eps, impl=impl)
        cache = cache.replace_layer(slot, k_pages, v_pages)
    return cache


def layer_stack(params: DraftParams, config: DraftConfig, x: jax.Array, positions: jax.Array,
                attend: Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array], *,
                impl: str = "auto") -> jax.Array:
    """Draft layers over block embeddings x [B, T, H] at ``positions`` [B, T]; final-normed.

    ``attend(layer, q, k, v)`` gets the block's normed+roped q/k and v [B, T, heads, D] and
    returns the attention output: inference attends over the paged context, training over
    in-batch context with anchor masks. Everything else is the shared decoder.
    """
    eps = config.model.rms_norm_eps

    def block_attend(state, index, spec, layer, qkv, block_positions):
        q, k, v = attention.block_qkv(qkv, layer, spec, block_positions, eps, impl)
        return attend(index, q, k, v), state

    x, _, _ = decoder.run(params.layers, config.model.layers, x, positions, block_attend, None, eps=eps, impl=impl,
                          tensor_axis=config.model.tensor_axis)
    return rms_norm(x, params.norm, eps)


def embed_block(config: DraftConfig, target: TargetParams, block: jax.Array,
                vocab_axis: str | None = None) -> jax.Array:
    """Block tokens [B, T] through the target's embedding (x input_embedding_scale); its rows
    split over ``vocab_axis`` when the target is (``nn.tensor_parallel``)."""
    x = embed_lookup(target.embed, block, vocab_axis)
    if config.input_embedding_scale != 1.0:  # in f32, then rounded: as torch scales bf16 by a float
        x = (x.astype(jnp.float32) * config.input_embedding_scale).astype(x.dtype)
    return x


def block_hidden(params: DraftParams, config: DraftConfig, target: TargetParams, block: jax.Array,
                 cache: PagedKVCache, block_lens: jax.Array, *, impl: str = "auto",
                 vocab_axis: str | None = None) -> jax.Array:
    """Draft hidden [B, T, H] for block [B, T] = [last token, mask x (T-1)] at positions
    lengths[b] + t, attending to the cached context and the block's first block_lens[b] keys
    (``vocab_axis``: the target's, as for ``embed_block``)."""
    context_lens = cache.lengths
    positions = context_lens[:, None] + jnp.arange(block.shape[1], dtype=jnp.int32)[None, :]

    def attend(index, q, k, v):
        return ops.draft_attention(
            q, *cache.layer(cache.num_target_layers + index), cache.page_table, context_lens, k, v,
            block_lens, sliding_window=config.model.window(index),
            causal=bool(config.causal_layers[index]), impl=impl)

    return layer_stack(params, config, embed_block(config, target, block, vocab_axis), positions, attend, impl=impl)


def draft_logits(params: DraftParams, config: DraftConfig, target: TargetParams,
                 hidden: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """Logits over the target vocabulary [..., V] (f32) from draft hidden states; with
    ``vocab_axis`` (a split target) this shard's columns of them, as the target's head gives."""

    def shaped(logits):  # the config's output multiplier and soft cap
        if config.output_multiplier != 1.0:
            logits = logits * config.output_multiplier
        if config.final_logit_softcapping:
            cap = config.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits

    if params.lm_head is None:
        return shaped(target_logits(target, hidden))
    # reduced draft vocabulary: scatter to target ids after shaping; the others stay impossible
    small = jnp.einsum("...h,hv->...v", hidden, params.lm_head, preferred_element_type=jnp.float32)
    target_ids = jnp.arange(small.shape[-1]) + params.d2t
    logits = jnp.full((*small.shape[:-1], config.model.vocab_size), -jnp.inf, jnp.float32)
    return local_vocab(logits.at[..., target_ids].set(shaped(small)), vocab_axis)

"""A target of any family over the cache: prefill, decode and verify are one function, the
embedding, the shared decoder (``nn.decoder``) with paged causal attention (and, in hybrids,
Gated DeltaNet layers continuing their recurrent states), and the head."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.model.cache import PagedKVCache
from dflash_jax.model.config import ModelConfig
from dflash_jax.model.nn import attention, decoder, gated_deltanet
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.collectives import embed_lookup
from dflash_jax.model.params import TargetParams
from pallas_kernels import rms_norm


def paged_attend(eps: float, impl: str) -> decoder.Attend:
    """The target's ``attend``: an attention layer writes the tokens' K/V into its pages, then
    attends causally over them; a Gated DeltaNet layer continues its committed states and records
    the block's inputs for the commit. The threaded state is the cache."""

    def attend(cache: PagedKVCache, index, spec, params, projected, positions):
        if isinstance(spec, AttentionSpec):
            out, k_pages, v_pages = attention.paged_causal(projected, params, spec, positions, *cache.layer(index),
                                                           cache.page_table, eps, impl)
            return out, cache.replace_layer(index, k_pages, v_pages)
        out, pending = gated_deltanet.mix(projected, params, spec, cache.conv[index], cache.recurrent[index], impl)
        return out, cache.record(index, pending)

    return attend


def forward(params: TargetParams, config: ModelConfig, tokens: jax.Array, start: jax.Array,
            cache: PagedKVCache, *, tap_layers: tuple[int, ...] = (),
            impl: str = "auto") -> tuple[jax.Array, jax.Array | None, PagedKVCache]:
    """Run tokens [B, T] at positions start[b] + t, writing their K/V into the cache.

    Returns the final-normed hidden states [B, T, H], the outputs of ``tap_layers`` (HF
    ``hidden_states[k + 1]``; for the last layer that is the final-normed state) concatenated on
    the feature axis [B, T, len(tap_layers) * H] (None when no taps), and the cache. The cache's
    ``lengths`` and recurrent states are not changed: committing is the caller's decision
    (``cache.commit``; the block must start at ``cache.lengths`` when the target has recurrent
    layers).
    """
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    eps = config.rms_norm_eps
    x = embed_lookup(params.embed, tokens, config.tensor_axis)
    x, outputs, cache = decoder.run(params.layers, config.layers, x, positions, paged_attend(eps, impl), cache,
                                    eps=eps, impl=impl, tap_layers=tap_layers,
                                    zero_centred_norms=config.zero_centred_norms, tensor_axis=config.tensor_axis)
    normed = rms_norm(x, decoder.norm_scale(params.norm) if config.zero_centred_norms else params.norm, eps)
    # HF's hidden_states[L] (what the z-lab reference taps for the last layer) is the final-normed
    # state, not the raw output of the last decoder layer.
    if config.num_layers - 1 in outputs:
        outputs[config.num_layers - 1] = normed
    taps = jnp.concatenate([outputs[i] for i in tap_layers], axis=-1) if tap_layers else None
    return normed, taps, cache


def logits(params: TargetParams, hidden: jax.Array) -> jax.Array:
    """LM head (tied or not) with f32 accumulation and output: [..., V], or under tensor
    parallelism this shard's vocabulary columns [..., V / tp] (``nn.tensor_parallel`` picks or
    samples across them)."""
    if params.lm_head is None:
        return jnp.einsum("...h,vh->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...h,hv->...v", hidden, params.lm_head, preferred_element_type=jnp.float32)

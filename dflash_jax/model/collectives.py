"""The collectives of a forward split over a mesh axis (see ``dflash_jax.model.sharding`` for the
layout): each takes the axis name, or None on one device, where it is the plain operation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_partials(x: jax.Array, axis: str | None) -> jax.Array:
    """The sum over shards of a row-parallel partial result (itself on one device)."""
    return x if axis is None else jax.lax.psum(x, axis)


def embed_lookup(embed: jax.Array, tokens: jax.Array, axis: str | None) -> jax.Array:
    """Embeddings [..., H] of token ids from a table split by vocabulary rows over ``axis`` (each
    shard looks up the ids it holds, the others give zeros; the sum is exact)."""
    if axis is None:
        return embed[tokens]
    rows = embed.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    inside = (local >= 0) & (local < rows)
    found = jnp.where(inside[..., None], embed[jnp.clip(local, 0, rows - 1)], jnp.zeros((), embed.dtype))
    return jax.lax.psum(found, axis)


def vocab_argmax(logits: jax.Array, axis: str | None) -> jax.Array:
    """argmax over the whole vocabulary of logits [..., V_local] split by columns over ``axis``,
    without gathering them: each shard's best (value, id), then the first best of those (ties go to
    the lowest id, as ``jnp.argmax``)."""
    if axis is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    best = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
    offset = jax.lax.axis_index(axis) * logits.shape[-1]
    values = jax.lax.all_gather(best, axis, axis=best.ndim)
    ids = jax.lax.all_gather(local + offset, axis, axis=best.ndim)
    return jnp.take_along_axis(ids, jnp.argmax(values, axis=-1)[..., None], axis=-1)[..., 0].astype(jnp.int32)


def gather_vocab(logits: jax.Array, axis: str | None) -> jax.Array:
    """The whole vocabulary's logits [..., V] from column shards [..., V_local] (sampling needs
    every probability: top-p sorts them)."""
    return logits if axis is None else jax.lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)


def local_vocab(logits: jax.Array, axis: str | None) -> jax.Array:
    """This shard's columns of whole-vocabulary logits [..., V] (a replicated reduced-vocabulary
    draft head's), so that every logits tensor in a sharded program splits the same way."""
    if axis is None:
        return logits
    width = logits.shape[-1] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(logits, jax.lax.axis_index(axis) * width, width, axis=logits.ndim - 1)

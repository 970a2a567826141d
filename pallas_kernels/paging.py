"""Reading and writing token rows of a paged KV layer (plain jnp, shared by all references)."""

import jax
import jax.numpy as jnp


def write_pages(pages: jax.Array, page_table: jax.Array, positions: jax.Array,
                values: jax.Array) -> jax.Array:
    """Store ``values[b, t]`` at token position ``positions[b, t]`` of sequence ``b``.

    pages: [num_pages, page_size, heads, head_dim]; page_table: [batch, pages_per_seq] int32;
    positions: [batch, T] int32; values: [batch, T, heads, head_dim].
    Positions outside the sequence's page table (negative or >= pages_per_seq * page_size), and
    pages whose id is outside [0, num_pages) (such as the cache's ``num_pages`` sentinel), are
    dropped, so padded tokens can be written blindly.
    """
    num_pages, page_size = pages.shape[:2]
    pages_per_seq = page_table.shape[1]
    logical = positions // page_size
    in_range = (positions >= 0) & (logical < pages_per_seq)
    physical = jnp.take_along_axis(page_table, jnp.clip(logical, 0, pages_per_seq - 1), axis=1)
    in_range &= (physical >= 0) & (physical < num_pages)  # a page id outside the pool: dropped
    physical = jnp.where(in_range, physical, num_pages)  # out of bounds -> dropped
    return pages.at[physical, positions % page_size].set(values.astype(pages.dtype), mode="drop")


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Contiguous view of every sequence's pages: [batch, pages_per_seq * page_size, heads, dim]."""
    batch, pages_per_seq = page_table.shape
    _, page_size, heads, dim = pages.shape
    return pages[page_table].reshape(batch, pages_per_seq * page_size, heads, dim)

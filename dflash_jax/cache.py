"""Paged KV cache shared by the target's and the draft's layers, and its host-side allocator.

One page table serves every layer: position ``p`` of sequence ``b`` lives in page
``page_table[b, p // page_size]`` of each layer's pages. The target caches the K/V of every
token it has run; the draft caches context K/V (from the target's hidden states) at the same
positions, so both fit one allocator. ``lengths`` counts committed tokens: anything past it
(a rejected block's K/V, in either group) is ignored and later overwritten, never copied.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.config import ModelConfig
from dflash_jax.nn.attention import AttentionSpec


class OutOfPagesError(RuntimeError):
    """The requested sequences need more KV pages than the cache has."""


@struct.dataclass
class PagedKVCache:
    """k[i], v[i]: [num_pages, page_size, kv_heads_i, head_dim_i] for layer i (target layers
    first, then draft layers); page_table: [batch, pages_per_seq] int32, unused entries hold
    ``num_pages`` (writes there are dropped); lengths: [batch] int32 committed tokens."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    num_target_layers: int = struct.field(pytree_node=False)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: pages_per_seq * page_size."""
        return self.page_table.shape[1] * self.page_size

    def layer(self, index: int) -> tuple[jax.Array, jax.Array]:
        return self.k[index], self.v[index]

    def replace_layer(self, index: int, k: jax.Array, v: jax.Array) -> "PagedKVCache":
        ks, vs = list(self.k), list(self.v)
        ks[index], vs[index] = k, v
        return self.replace(k=tuple(ks), v=tuple(vs))

    def commit(self, lengths: jax.Array) -> "PagedKVCache":
        """The one place a step's outcome enters the cache: each sequence now holds ``lengths``
        [batch] committed tokens. K/V written past them (a rejected draft's) is simply never read
        and is overwritten later: lengths, not copies."""
        return self.replace(lengths=lengths.astype(jnp.int32))


def allocate_pages(tokens_per_seq: list[int], page_size: int, num_pages: int | None = None,
                   rng: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
    """Give each sequence enough pages for its tokens; return (page_table, num_pages).

    ``num_pages`` defaults to exactly what is needed. With ``rng`` the pages are handed out in
    a random order (tests use it to check that nothing assumes contiguous pages).
    Raises OutOfPagesError before anything is allocated if the pages do not suffice, and
    ValueError for no sequences.
    """
    if not tokens_per_seq:
        raise ValueError("allocate_pages needs at least one sequence (tokens_per_seq is empty)")
    needed = [max(1, math.ceil(n / page_size)) for n in tokens_per_seq]
    total = sum(needed)
    if num_pages is None:
        num_pages = total
    if total > num_pages:
        raise OutOfPagesError(f"{len(needed)} sequences need {total} pages of {page_size} tokens "
                              f"({sum(tokens_per_seq)} tokens) but the cache has {num_pages}")
    order = np.arange(num_pages) if rng is None else rng.permutation(num_pages)
    table = np.full((len(needed), max(needed)), num_pages, np.int32)
    offset = 0
    for row, n in enumerate(needed):
        table[row, :n] = order[offset:offset + n]
        offset += n
    return table, num_pages


def kv_layers(config: ModelConfig | None) -> tuple[AttentionSpec, ...]:
    """The attention of each of ``config``'s layers that keeps K/V pages (none for None)."""
    return () if config is None else tuple(layer.mixer for layer in config.layers)


def init_cache(target: ModelConfig | None, draft: ModelConfig | None, page_table: np.ndarray, num_pages: int,
               page_size: int, dtype, fill: float = 0.0) -> PagedKVCache:
    """Zeroed (or ``fill``-ed: tests poison with NaN) pages for every attention layer of the
    target and then of the draft's layer stack (either may be None: a target alone, or a draft
    trained over its own context)."""
    ks, vs = [], []
    for spec in kv_layers(target) + kv_layers(draft):
        shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
        ks.append(jnp.full(shape, fill, dtype))
        vs.append(jnp.full(shape, fill, dtype))
    batch = page_table.shape[0]
    return PagedKVCache(k=tuple(ks), v=tuple(vs), page_table=jnp.asarray(page_table, jnp.int32),
                        lengths=jnp.zeros((batch,), jnp.int32), num_target_layers=len(kv_layers(target)))

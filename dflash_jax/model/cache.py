"""The cache shared by the target's and the draft's layers: paged K/V for attention layers, a
recurrent state per sequence for Gated DeltaNet layers, and the host-side page allocator.

One page table serves every attention layer: position ``p`` of sequence ``b`` lives in page
``page_table[b, p // page_size]`` of each layer's pages. The target caches the K/V of every
token it has run; the draft caches context K/V (from the target's hidden states) at the same
positions, so both fit one allocator. ``lengths`` counts committed tokens: anything past it
(a rejected block's K/V, in either group) is ignored and later overwritten, never copied.

A Gated DeltaNet layer's state cannot be rolled back by a length: a forward leaves it unchanged
(reading it once) and records the block's inputs (``pending``); ``commit`` folds in exactly the
committed tokens of each sequence (a replay of the accepted prefix from the pre-verify state: one
more state read and one write per layer, nothing kept per draft position). Commit is the one
place a step's outcome enters the cache.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax.sharding import PartitionSpec as P

from dflash_jax.model.config import ModelConfig
from dflash_jax.model.nn import gated_deltanet
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec, PendingBlock
from dflash_jax.model.sharding import TensorParallel, cache_specs, named


class OutOfPagesError(RuntimeError):
    """The requested sequences need more KV pages than the cache has."""


@struct.dataclass
class PagedKVCache:
    """Per layer i (target layers first, then draft layers), None where the layer has no such
    pool: k[i], v[i]: [num_pages, page_size, kv_heads_i, head_dim_i] of an attention layer;
    conv[i]: [batch, K-1, conv_dim_i] (the last pre-conv inputs) and recurrent[i]: [batch, Hv_i,
    dk_i, dv_i] f32 of a Gated DeltaNet layer. page_table: [batch, pages_per_seq] int32, unused
    entries hold ``num_pages`` (writes there are dropped); lengths: [batch] int32 committed
    tokens. pending: the last forward's Gated DeltaNet inputs per layer, until ``commit``."""

    k: tuple[jax.Array | None, ...]
    v: tuple[jax.Array | None, ...]
    conv: tuple[jax.Array | None, ...]
    recurrent: tuple[jax.Array | None, ...]
    page_table: jax.Array
    lengths: jax.Array
    num_target_layers: int = struct.field(pytree_node=False)
    pending: tuple[PendingBlock | None, ...] | None = None

    @property
    def _any_pages(self) -> jax.Array:
        return next(k for k in self.k if k is not None)

    @property
    def page_size(self) -> int:
        return self._any_pages.shape[1]

    @property
    def num_pages(self) -> int:
        return self._any_pages.shape[0]

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

    def record(self, index: int, pending: PendingBlock) -> "PagedKVCache":
        """Keep a Gated DeltaNet layer's block inputs for the commit."""
        blocks = list(self.pending or (None,) * len(self.k))
        blocks[index] = pending
        return self.replace(pending=tuple(blocks))

    def emptied(self) -> "PagedKVCache":
        """Every sequence emptied, to start from nothing: no committed tokens, zero recurrent and
        conv states (pages need no clearing: nothing past ``lengths`` is read)."""
        zero = lambda pool: tuple(None if x is None else jnp.zeros_like(x) for x in pool)  # noqa: E731
        return self.replace(conv=zero(self.conv), recurrent=zero(self.recurrent),
                            lengths=jnp.zeros_like(self.lengths), pending=None)

    def commit(self, lengths: jax.Array, impl: str = "auto") -> "PagedKVCache":
        """The one place a step's outcome enters the cache: each sequence now holds ``lengths``
        [batch] committed tokens. K/V written past them (a rejected draft's) is simply never read
        and is overwritten later: lengths, not copies. The recurrent layers fold in the first
        lengths - self.lengths tokens of the block the last forward ran (it started at
        ``self.lengths``), from their pre-forward states: ``lengths`` may not be below
        ``self.lengths`` (a state is never rolled back past a commit)."""
        lengths = lengths.astype(jnp.int32)
        if self.pending is None:
            return self.replace(lengths=lengths)
        counts = lengths - self.lengths
        conv, recurrent = list(self.conv), list(self.recurrent)
        for index, block in enumerate(self.pending):
            if block is not None:
                conv[index], recurrent[index] = gated_deltanet.advance(block, conv[index], recurrent[index], counts,
                                                                       impl)
        return self.replace(lengths=lengths, conv=tuple(conv), recurrent=tuple(recurrent), pending=None)


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


def mixers(config: ModelConfig | None) -> tuple[AttentionSpec | GatedDeltaNetSpec, ...]:
    """The mixer of each of ``config``'s layers, which sizes its cache pools (none for None)."""
    return () if config is None else tuple(layer.mixer for layer in config.layers)


def state_bytes_per_sequence(config: ModelConfig) -> int:
    """Bytes of recurrent and conv state one sequence holds in ``config``'s Gated DeltaNet layers."""
    return sum(config.layers[i].mixer.state_bytes for i in config.recurrent_layers)


def init_cache(target: ModelConfig | None, draft: ModelConfig | None, page_table: np.ndarray, num_pages: int,
               page_size: int, dtype, fill: float = 0.0) -> PagedKVCache:
    """Zeroed (or ``fill``-ed: tests poison with NaN) pages for every attention layer and states
    for every Gated DeltaNet layer of the target and then of the draft's layer stack (either may
    be None: a target alone, or a draft trained over its own context). A prefill empties the
    sequences it starts (``emptied``)."""
    batch = page_table.shape[0]
    ks, vs, conv, recurrent = [], [], [], []
    for spec in mixers(target) + mixers(draft):
        if isinstance(spec, AttentionSpec):
            shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
            ks.append(jnp.full(shape, fill, dtype))
            vs.append(jnp.full(shape, fill, dtype))
            conv.append(None)
            recurrent.append(None)
        else:
            ks.append(None)
            vs.append(None)
            conv.append(jnp.full((batch, spec.conv_kernel - 1, spec.conv_dim), fill, dtype))
            recurrent.append(jnp.full((batch, spec.num_value_heads, spec.key_dim, spec.value_dim), fill,
                                      jnp.float32))
    if all(k is None for k in ks):
        raise ValueError("a cache needs at least one attention layer (pages hold the draft's context and "
                         "the target's K/V)")
    return PagedKVCache(k=tuple(ks), v=tuple(vs), conv=tuple(conv), recurrent=tuple(recurrent),
                        page_table=jnp.asarray(page_table, jnp.int32), lengths=jnp.zeros((batch,), jnp.int32),
                        num_target_layers=len(mixers(target)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def zeroed_cache(page_table, target: ModelConfig, draft: ModelConfig | None, num_pages: int, page_size: int,
                  dtype, tensor_parallel: TensorParallel | None) -> PagedKVCache:
    """``init_cache`` as one compiled program per shape (the engine's empty state); split over the
    mesh of ``tensor_parallel`` when given."""
    cache = init_cache(target, draft, page_table, num_pages, page_size, dtype)
    if tensor_parallel is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, named(cache_specs(cache, tensor_parallel), tensor_parallel.mesh))


def device_free_bytes() -> int | None:
    """Memory the first local device has left beside what it holds (the weights), as far as it
    reports it (GPUs do; CPUs report nothing: None)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if stats.get("bytes_limit") else None


def cache_bytes_per_device(cache: PagedKVCache, tensor_parallel: TensorParallel | None = None) -> int:
    """Bytes one device holds of a cache (or its shapes): its split pools a share each."""
    shares = [1] * len(jax.tree.leaves(cache)) if tensor_parallel is None else [
        tensor_parallel.size if spec != P() else 1
        for spec in jax.tree.leaves(cache_specs(cache, tensor_parallel), is_leaf=lambda x: isinstance(x, P))]
    return sum(x.size * x.dtype.itemsize // share for x, share in zip(jax.tree.leaves(cache), shares, strict=True))


def check_cache_fits(cache: PagedKVCache, tensor_parallel: TensorParallel | None = None) -> None:
    """ValueError when the paged KV cache (its shapes: target and draft layers; split over the
    mesh of ``tensor_parallel``) would not fit in the device memory left beside the weights."""
    free = device_free_bytes()
    needed = cache_bytes_per_device(cache, tensor_parallel)
    if free is not None and needed > free:
        raise ValueError(f"the KV cache needs {needed / 2**30:.2f} GiB ({cache.num_pages * cache.page_size} token "
                         "slots: each sequence's prompt + max_new_tokens + a block) and the device has "
                         f"{free / 2**30:.2f} GiB free beside the weights: use fewer prompts per batch or a "
                         "smaller max_new_tokens (a server: fewer pages or a shorter max_model_len)")


def check_page_size(config: ModelConfig, page_size: int) -> None:
    """ValueError for a page larger than the model's positions: every prompt is padded to whole
    pages, so such a page only costs memory and prefill time."""
    if page_size > config.max_position_embeddings:
        raise ValueError(f"page_size {page_size} exceeds the target's max_position_embeddings "
                         f"{config.max_position_embeddings} (prompts are padded to whole pages)")

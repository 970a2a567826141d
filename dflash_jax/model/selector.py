"""DFlash2's candidate selector: instead of each block position's own argmax (or sample), the
draft keeps its ``top_k`` tokens per position and walks the block left to right, scoring each
candidate by its draft logit plus a low-rank bigram term between the token chosen before it and
the candidate, modulated by the position's hidden state:

    score[t, j] = logit[t, cand[t, j]] + sum_r pred[prev, r] * (h[t] W)[r] * succ[cand[t, j], r]

Greedy (temperature 0) takes the best score; sampling draws from softmax(score / T) over the k
candidates, and that k-way distribution is the draft's q in rejection sampling (zero outside the
candidates; no top-p / top-k on it, as the reference)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn.initializers import normal


@dataclasses.dataclass(frozen=True)
class SelectorSpec:
    """``top_k`` candidates per position; bigram codebooks of rank ``rank``."""

    rank: int
    top_k: int

    def __post_init__(self):
        if self.rank < 1 or self.top_k < 1:
            raise ConfigError(f"selector_rank and selector_top_k must be >= 1, got {self.rank} and {self.top_k}")


@struct.dataclass
class SelectorParams:
    """V vocabulary, r rank, H hidden."""

    predecessor_codebook: jax.Array   # [V, r]
    successor_codebook: jax.Array     # [V, r]
    hidden_projection: jax.Array      # [H, r]


def init_selector(spec: SelectorSpec, vocab: int, hidden: int, key: jax.Array, dtype,
                  scale: float = 0.02) -> SelectorParams:
    """Random weights (normal(0, scale)): for tests and benchmarks."""
    keys = jax.random.split(key, 3)
    return SelectorParams(predecessor_codebook=normal(keys[0], (vocab, spec.rank), dtype, scale),
                          successor_codebook=normal(keys[1], (vocab, spec.rank), dtype, scale),
                          hidden_projection=normal(keys[2], (hidden, spec.rank), dtype, scale))


TOP_K_CHUNK = 128  # vocabulary columns per chunk (see chunked_top_k)


def chunked_top_k(x: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` of x [..., V], the same values and indices (ties to the lower index),
    through short rows: the columns in chunks, the k chunks of the largest maxima (ties to the
    lower chunk), in chunk order, then the best k of their columns. Exact: an element among the
    best k has fewer than k elements before it, so fewer than k chunks whose maximum comes
    before it, and its own chunk is among the k taken. XLA's GPU top k runs one program per
    row: a block's 16 rows of 151,936 columns take 0.32 ms on an H200, their 16 rows of 1,187
    chunk maxima and of 16 x 128 columns a small part of that. Columns past V (the last chunk's
    padding) are -inf, behind every real column of equal value. (A chunk's maximum does not tell
    -0 from +0: a tie between zeros of opposite sign may go to a lower index than top_k's.)"""
    vocab = x.shape[-1]
    chunks = -(-vocab // chunk)
    if chunks <= k:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, chunks * chunk - vocab)], constant_values=-jnp.inf)
    padded = padded.reshape(*x.shape[:-1], chunks, chunk)
    _, taken = jax.lax.top_k(padded.max(axis=-1), k)
    taken = jnp.sort(taken, axis=-1)                                                   # [..., k] in id order
    columns = jnp.take_along_axis(padded, taken[..., None], axis=-2).reshape(*x.shape[:-1], k * chunk)
    values, best = jax.lax.top_k(columns, k)
    return values, jnp.take_along_axis(taken, best // chunk, axis=-1) * chunk + best % chunk


def top_candidates(logits: jax.Array, top_k: int, vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(logits [..., k] f32 in descending order, their token ids [..., k]) of the ``top_k`` best of
    logits [..., V], or with ``vocab_axis`` of the vocabulary's column shards [..., V_local]: each
    shard's best k with their global ids, gathered, the best k of those (ties to the lower id, as
    on one device: the shards' columns are in id order)."""
    vocab = logits.shape[-1] * (1 if vocab_axis is None else jax.lax.axis_size(vocab_axis))
    if vocab < top_k:
        raise ConfigError(f"selector_top_k {top_k} exceeds the vocabulary {vocab}")
    unary, ids = chunked_top_k(logits.astype(jnp.float32), min(top_k, logits.shape[-1]))
    if vocab_axis is None:
        return unary, ids
    ids = ids + jax.lax.axis_index(vocab_axis) * logits.shape[-1]
    unary, ids = (jax.lax.all_gather(x, vocab_axis, axis=x.ndim - 1, tiled=True) for x in (unary, ids))
    unary, best = jax.lax.top_k(unary, top_k)
    return unary, jnp.take_along_axis(ids, best, axis=-1)


def select(params: SelectorParams, spec: SelectorSpec, hidden: jax.Array, logits: jax.Array, anchor: jax.Array,
           temperature: jax.Array | None, key: jax.Array | None,
           vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The path of draft tokens [B, P] for hidden [B, P, H] and its logits [B, P, V] (with
    ``vocab_axis``: this shard's columns; the path is the same on every shard, given the same key)
    after the anchor (the last committed token) [B]: (path, candidates [B, P, k], the per-position
    k-way probabilities [B, P, k] f32 when sampling at ``temperature`` (scalar or [B]; a row at 0
    is greedy) with ``key`` (one, or one per row [B]), else None). Candidates in descending logit
    order."""
    unary, candidates = top_candidates(logits, spec.top_k, vocab_axis)
    projected = hidden @ params.hidden_projection                                      # [B, P, r]
    successors = params.successor_codebook[candidates]                                 # [B, P, k, r]
    sampling = temperature is not None

    def position(prev, inputs):
        unary_t, cand_t, proj_t, succ_t, key_t = inputs
        bigram = params.predecessor_codebook[prev] * proj_t                           # [B, r]
        scores = unary_t + jnp.einsum("br,bkr->bk", bigram, succ_t, preferred_element_type=jnp.float32)
        if sampling:  # a greedy row (temperature 0) among sampled ones: one-hot at its best score
            greedy = temperature[:, None] <= 0
            probs = jnp.where(greedy, jax.nn.one_hot(jnp.argmax(scores, axis=-1), scores.shape[-1]),
                              jax.nn.softmax(scores / jnp.where(greedy, 1.0, temperature[:, None]), axis=-1))
            index = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(key_t, probs)
        else:
            probs, index = None, jnp.argmax(scores, axis=-1)
        chosen = jnp.take_along_axis(cand_t, index[:, None], axis=1)[:, 0]
        return chosen, (chosen, probs)

    steps = hidden.shape[1]
    if sampling:
        temperature = jnp.broadcast_to(temperature, anchor.shape)
        rows = jax.random.split(key, anchor.shape[0]) if key.ndim == 0 else key
        keys = jax.vmap(lambda k: jax.random.split(k, steps))(rows).swapaxes(0, 1)    # [P, B]
    else:
        keys = jnp.zeros((steps,), jnp.int32)
    per_position = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    _, (path, probs) = jax.lax.scan(position, anchor, (per_position(unary), per_position(candidates),
                                                       per_position(projected), per_position(successors), keys))
    return per_position(path), candidates, None if probs is None else per_position(probs)


def dense_probs(candidates: jax.Array, probs: jax.Array, vocab: int, vocab_axis: str | None = None) -> jax.Array:
    """The selector's k-way probabilities [B, P, k] at their candidates' ids [B, P, k] as dense
    rows [B, P, V] (zero elsewhere): the draft's q for rejection sampling. With ``vocab_axis``,
    ``vocab`` is a shard's width and the rows this shard's columns."""
    offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * vocab
    local = candidates - offset
    local = jnp.where((local >= 0) & (local < vocab), local, vocab)   # another shard's: dropped
    dense = jnp.zeros((*candidates.shape[:-1], vocab), jnp.float32)
    rows = jnp.arange(candidates.shape[0])[:, None, None], jnp.arange(candidates.shape[1])[None, :, None]
    return dense.at[rows[0], rows[1], local].add(probs, mode="drop")

"""Token choice and speculative acceptance: greedy, and rejection sampling that is exact in
distribution. Temperature, top-k and top-p are applied exactly as the z-lab reference does:
top-k first, softmax over the kept logits, then top-p on those probabilities (keep a token
while the mass before it is < top_p), renormalized."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp

from dflash_jax.nn.tensor_parallel import gather_vocab, local_vocab, vocab_argmax


_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 1.18e-38, float32's smallest normal number


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_p"],
                   meta_fields=["top_k", "greedy", "nucleus"])
@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k 0 means no top-k; top_p 1.0 means no top-p.

    A pytree whose leaves are ``temperature`` and ``top_p``: jitted code takes them as run-time
    values, so another temperature or top-p compiles nothing. What sets the compiled code is
    static: ``top_k`` (a shape), ``greedy`` (temperature 0) and ``nucleus`` (top_p < 1), both
    derived from the numbers given.
    """

    temperature: float | jax.Array = 0.0
    top_p: float | jax.Array = 1.0
    top_k: int = 0
    greedy: bool | None = None
    nucleus: bool | None = None

    def __post_init__(self):
        # jax rebuilds the config with traced (or placeholder) leaves: only numbers are checked.
        # Sampling runs in float32: outside its normal range a temperature or top_p becomes 0,
        # or its inverse does, and the probabilities NaN (every token then reads as id 0).
        if isinstance(self.temperature, numbers.Real):
            if not (math.isfinite(self.temperature) and self.temperature >= 0):
                raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
            if self.temperature > 0 and not _F32_TINY <= self.temperature <= 1 / _F32_TINY:
                raise ValueError(f"temperature must be 0 or in [{_F32_TINY:.3g}, {1 / _F32_TINY:.3g}] (float32's "
                                 f"normal range, where sampling is computed), got {self.temperature}")
            self._derive("greedy", self.temperature <= 0)
        if isinstance(self.top_p, numbers.Real):
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
            if self.top_p < _F32_TINY:
                raise ValueError(f"top_p must be at least {_F32_TINY:.3g} (float32's smallest normal number), "
                                 f"got {self.top_p}")
            self._derive("nucleus", self.top_p < 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.greedy is None or self.nucleus is None:
            raise TypeError("give temperature and top_p as numbers (greedy and nucleus derive from them)")

    def _derive(self, name: str, value: bool) -> None:
        if getattr(self, name) not in (None, value):
            raise ValueError(f"{name}={getattr(self, name)} contradicts temperature={self.temperature}, "
                             f"top_p={self.top_p}: leave it out (it is derived)")
        object.__setattr__(self, name, value)

    def as_arrays(self) -> "SamplingConfig":
        """The same config with float32 array leaves: what compiled functions are given."""
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), self)


def _scatter_rows(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
    """out[..., indices[..., j]] = values[..., j] over a zero vector of length ``size``."""
    flat_v = values.reshape(-1, values.shape[-1])
    flat_i = indices.reshape(-1, indices.shape[-1])
    rows = jnp.arange(flat_v.shape[0])[:, None]
    out = jnp.zeros((flat_v.shape[0], size), values.dtype).at[rows, flat_i].set(flat_v)
    return out.reshape(*values.shape[:-1], size)


def _top_p_sorted(sorted_probs: jax.Array, top_p: float) -> jax.Array:
    keep = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
    kept = sorted_probs * keep
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def sampling_probs(logits: jax.Array, config: SamplingConfig, vocab_axis: str | None = None) -> jax.Array:
    """Probabilities [..., V] (f32) that sampling at ``config`` draws from (T > 0). With
    ``vocab_axis`` the logits and the probabilities are this shard's vocabulary columns
    (``nn.tensor_parallel``), computed from the shards' maxima, sums and top-k candidates
    without gathering the logits, except for top-p without top-k, which sorts the whole
    vocabulary (gathered)."""
    if vocab_axis is not None:
        return _split_sampling_probs(logits, config, vocab_axis)
    logits = logits.astype(jnp.float32)
    # Shifted so the best score is 0 before dividing: a tiny temperature then gives -inf or 0,
    # never inf - inf = NaN.
    scores = (logits - jnp.max(logits, axis=-1, keepdims=True)) / config.temperature
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        values, indices = jax.lax.top_k(scores, config.top_k)  # sorted descending
        probs = jax.nn.softmax(values, axis=-1)
        if config.nucleus:
            probs = _top_p_sorted(probs, config.top_p)
        return _scatter_rows(probs, indices, vocab)
    probs = jax.nn.softmax(scores, axis=-1)
    if config.nucleus:
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        probs = _scatter_rows(_top_p_sorted(sorted_probs, config.top_p), order, vocab)
    return probs


def _split_sampling_probs(logits: jax.Array, config: SamplingConfig, axis: str) -> jax.Array:
    """``sampling_probs`` of vocabulary columns split over ``axis``: the same probabilities, this
    shard's columns of them."""
    logits = logits.astype(jnp.float32)
    width = logits.shape[-1]
    vocab = width * jax.lax.axis_size(axis)
    top_k = 0 < config.top_k < vocab
    if config.nucleus and not top_k:
        return local_vocab(sampling_probs(gather_vocab(logits, axis), config), axis)
    scores = (logits - jax.lax.pmax(jnp.max(logits, axis=-1, keepdims=True), axis)) / config.temperature
    if not top_k:
        weights = jnp.exp(scores)
    else:
        # the global top k are among the shards' own top k: gathered, k values a shard
        candidates = jax.lax.all_gather(jax.lax.top_k(scores, min(config.top_k, width))[0], axis,
                                        axis=scores.ndim - 1, tiled=True)
        values = jax.lax.top_k(candidates, config.top_k)[0]                   # sorted descending
        cut = values[..., -1:]
        if config.nucleus:  # the smallest score top-p keeps of those k
            kept = _top_p_sorted(jax.nn.softmax(values, axis=-1), config.top_p)
            cut = jnp.min(jnp.where(kept > 0, values, jnp.inf), axis=-1, keepdims=True)
        weights = jnp.where(scores >= cut, jnp.exp(scores), 0.0)
    return weights / jax.lax.psum(jnp.sum(weights, axis=-1, keepdims=True), axis)


def sample_probs(key: jax.Array, probs: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """One token per row of probs [..., V]; with ``vocab_axis``, of this shard's columns of them:
    each shard's Gumbel-max winner (its own noise), then the best of those (exact, as a
    categorical draw is the Gumbel-max of the log-probabilities)."""
    if vocab_axis is None:
        return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
    noise = jax.random.gumbel(jax.random.fold_in(key, jax.lax.axis_index(vocab_axis)), probs.shape)
    return vocab_argmax(jnp.log(probs) + noise, vocab_axis)


def choose(key: jax.Array, logits: jax.Array, config: SamplingConfig, vocab_axis: str | None = None) -> jax.Array:
    """Next token(s) from logits [..., V]: argmax when greedy, else a sample. With ``vocab_axis``
    the logits are this shard's vocabulary columns (``nn.tensor_parallel``): neither needs the
    gathered logits."""
    if config.greedy:
        return vocab_argmax(logits, vocab_axis)
    return sample_probs(key, sampling_probs(logits, config, vocab_axis), vocab_axis)


def leading_run(ok: jax.Array) -> jax.Array:
    """Length [...] of the leading run of True along the last axis of ok [..., T]: the drafts
    accepted."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1, dtype=jnp.int32)


def accept_greedy(draft_tokens: jax.Array, target_logits: jax.Array, block_lens: jax.Array,
                  vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Leading matches n [B] of draft_tokens [B, T-1] against argmax(target_logits [B, T, V])
    (only the first block_lens-1 drafts count), and the bonus argmax(target[n]) [B]
    (``vocab_axis`` as for ``choose``)."""
    posterior = vocab_argmax(target_logits, vocab_axis)
    slots = jnp.arange(draft_tokens.shape[1])[None, :]
    match = (draft_tokens == posterior[:, :-1]) & (slots < block_lens[:, None] - 1)
    accepted = leading_run(match)
    return accepted, jnp.take_along_axis(posterior, accepted[:, None], axis=1)[:, 0]


def _probs_of(probs: jax.Array, tokens: jax.Array, vocab_axis: str | None) -> jax.Array:
    """probs[..., tokens] for probs [..., V] (with ``vocab_axis``: this shard's columns; each token's
    probability found on one shard, summed) and tokens [...]."""
    if vocab_axis is None:
        return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    width = probs.shape[-1]
    local = tokens - jax.lax.axis_index(vocab_axis) * width
    found = jnp.take_along_axis(probs, jnp.clip(local, 0, width - 1)[..., None], axis=-1)[..., 0]
    return jax.lax.psum(jnp.where((local >= 0) & (local < width), found, 0.0), vocab_axis)


def accept_sampling(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
                    target_probs: jax.Array, block_lens: jax.Array,
                    vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling: accept draft x at i with prob min(1, p(x)/q(x)); at the first
    rejection sample from normalize(max(p - q, 0)) (p itself if that is all zero); if every
    draft is accepted sample the bonus from p at the next position.

    draft_tokens [B, T-1]; draft_probs q [B, T-1, V]; target_probs p [B, T, V]; block_lens [B].
    With ``vocab_axis`` q and p are this shard's vocabulary columns (``sampling_probs``): the
    probabilities of the drafts and the residual's mass are summed over the shards.
    """
    accept_key, bonus_key = jax.random.split(key)
    num_drafts = draft_tokens.shape[1]
    p = _probs_of(target_probs[:, :-1], draft_tokens, vocab_axis)
    q = _probs_of(draft_probs, draft_tokens, vocab_axis)
    u = jax.random.uniform(accept_key, p.shape)
    slots = jnp.arange(num_drafts)[None, :]
    accepted = leading_run((u * q < p) & (slots < block_lens[:, None] - 1))
    p_next = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(draft_probs, jnp.minimum(accepted, num_drafts - 1)[:, None, None],
                                 axis=1)[:, 0]
    residual = jnp.maximum(p_next - q_next, 0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    if vocab_axis is not None:
        total = jax.lax.psum(total, vocab_axis)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1), p_next)
    all_accepted = (accepted >= block_lens - 1)[:, None]
    return accepted, sample_probs(bonus_key, jnp.where(all_accepted, p_next, residual), vocab_axis)

"""Token choice and speculative acceptance: greedy, and rejection sampling that is exact in
distribution, with settings per row of a batch. Temperature, top-k and top-p are applied as the
z-lab reference does: top-k first, softmax over the kept logits, then top-p on those
probabilities (keep a token while the mass before it is < top_p), renormalized; min-p (not in the
reference) comes between them, relative to the most likely token."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp

from dflash_jax.model.collectives import gather_vocab, vocab_argmax


_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 1.18e-38, float32's smallest normal number


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling settings. temperature 0 means greedy (argmax); top_k 0 means no
    top-k; top_p 1.0 means no top-p; min_p 0 means no min-p (keep tokens whose probability is at
    least min_p times the most likely one's). ``greedy`` and ``nucleus`` derive from the numbers.
    Compiled code takes ``as_arrays()`` (or ``SamplingRows.stack`` of several requests)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool | None = None
    nucleus: bool | None = None

    def __post_init__(self):
        # Sampling runs in float32: outside its normal range a temperature or top_p becomes 0,
        # or its inverse does, and the probabilities NaN (every token then reads as id 0).
        if not isinstance(self.temperature, numbers.Real) or not isinstance(self.top_p, numbers.Real):
            raise TypeError("give temperature and top_p as numbers (greedy and nucleus derive from them)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature > 0 and not _F32_TINY <= self.temperature <= 1 / _F32_TINY:
            raise ValueError(f"temperature must be 0 or in [{_F32_TINY:.3g}, {1 / _F32_TINY:.3g}] (float32's "
                             f"normal range, where sampling is computed), got {self.temperature}")
        self._derive("greedy", self.temperature <= 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < _F32_TINY:
            raise ValueError(f"top_p must be at least {_F32_TINY:.3g} (float32's smallest normal number), "
                             f"got {self.top_p}")
        self._derive("nucleus", self.top_p < 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.min_p, numbers.Real) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _derive(self, name: str, value: bool) -> None:
        if getattr(self, name) not in (None, value):
            raise ValueError(f"{name}={getattr(self, name)} contradicts temperature={self.temperature}, "
                             f"top_p={self.top_p}: leave it out (it is derived)")
        object.__setattr__(self, name, value)

    def as_arrays(self) -> "SamplingRows":
        """These settings as ``SamplingRows`` of 0-d arrays, shared by every row of a batch: what
        compiled functions are given (the values compile nothing)."""
        return jax.tree.map(lambda x: x[0], SamplingRows.stack([self]))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_p", "top_k", "min_p"],
                   meta_fields=["greedy", "top_k_cap", "nucleus", "sort_all"])
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Sampling settings per row of a batch: temperature, top_p, min_p f32 and top_k int32, each
    [B] (or 0-d: one setting for every row). A row with temperature 0 is greedy: its
    probabilities are one-hot at the argmax, so rejection sampling accepts exactly what greedy
    acceptance does. The static fields choose the compiled code: ``greedy`` (every row greedy:
    plain argmax), ``top_k_cap`` (the largest top_k of a sampled row: the candidates taken from
    the vocabulary), ``nucleus`` (some sampled row has top_p < 1), ``sort_all`` (one of those
    has no top-k: the whole vocabulary is sorted)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    greedy: bool
    top_k_cap: int
    nucleus: bool
    sort_all: bool

    @staticmethod
    def stack(configs: "list[SamplingConfig]", top_k_cap: int | None = None) -> "SamplingRows":
        """The rows of ``configs`` (one per row); ``top_k_cap`` as for ``statics``."""
        array = lambda name, dtype: jnp.asarray([getattr(c, name) for c in configs], dtype)  # noqa: E731
        return SamplingRows(temperature=array("temperature", jnp.float32), top_p=array("top_p", jnp.float32),
                            top_k=array("top_k", jnp.int32), min_p=array("min_p", jnp.float32),
                            **SamplingRows.statics(configs, top_k_cap))

    @staticmethod
    def statics(configs: "list[SamplingConfig]", top_k_cap: int | None = None) -> dict:
        """The static fields for rows of ``configs`` (no arrays made); ``top_k_cap`` raises the
        cap (a caller that mixes requests keeps the number of compiled variants small)."""
        sampled = [c for c in configs if not c.greedy]
        cap = max([c.top_k for c in sampled], default=0)
        if top_k_cap is not None and cap:
            if top_k_cap < cap:
                raise ValueError(f"top_k_cap {top_k_cap} is below a row's top_k {cap}")
            cap = top_k_cap
        return dict(greedy=not sampled, top_k_cap=cap, nucleus=any(c.nucleus for c in sampled),
                    sort_all=any(c.nucleus and c.top_k == 0 for c in sampled))


def _rows(config: "SamplingConfig | SamplingRows") -> SamplingRows:
    return config.as_arrays() if isinstance(config, SamplingConfig) else config


def _per_row(value: jax.Array, ndim: int) -> jax.Array:
    """A row setting [B] (or 0-d) shaped to broadcast against [B, ..., V] arrays of ``ndim``."""
    return value.reshape(value.shape + (1,) * (ndim - value.ndim))


def _top_p_kept(sorted_scores: jax.Array, keep: jax.Array, top_p: jax.Array) -> jax.Array:
    """Of descending scores [..., C] with ``keep`` so far, those top-p keeps: a token stays while
    the renormalized mass before it is < top_p."""
    weights = jnp.where(keep, jnp.exp(sorted_scores), 0.0)
    probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return keep & (jnp.cumsum(probs, axis=-1) - probs < top_p)


def _cut(scores: jax.Array, rows: SamplingRows, vocab_axis: str | None) -> jax.Array:
    """The smallest score [..., 1] each row keeps (top-k, then min-p, then top-p). Scores are
    shifted so each row's best is 0: min-p keeps scores >= log(min_p). The candidates are the
    whole vocabulary sorted (``sort_all``), or the top ``top_k_cap`` (with ``vocab_axis``, each
    shard's own top ones, gathered: the global top k are among them)."""
    ndim = scores.ndim
    min_p_cut = jnp.log(_per_row(rows.min_p, ndim))                 # -inf at min_p 0
    width = scores.shape[-1]
    vocab = width if vocab_axis is None else width * jax.lax.axis_size(vocab_axis)
    top_k = _per_row(rows.top_k, ndim)
    if rows.sort_all or (rows.nucleus and rows.top_k_cap >= vocab):
        candidates = -jnp.sort(-gather_vocab(scores, vocab_axis), axis=-1)
        has_cut = jnp.ones_like(top_k, bool)                         # every row cut from the sorted list
    elif rows.top_k_cap:
        local = jax.lax.top_k(scores, min(rows.top_k_cap, width))[0]
        candidates = jax.lax.top_k(gather_vocab(local, vocab_axis), min(rows.top_k_cap, vocab))[0]
        has_cut = (top_k > 0) & (top_k < vocab)
    else:
        return min_p_cut
    count = candidates.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < count), top_k, count)
    keep = (jnp.arange(count) < k) & (candidates >= min_p_cut)
    if rows.nucleus:
        keep = _top_p_kept(candidates, keep, _per_row(rows.top_p, ndim))
    cut = jnp.min(jnp.where(keep, candidates, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(has_cut, cut, min_p_cut)


def sampling_probs(logits: jax.Array, config: "SamplingConfig | SamplingRows",
                   vocab_axis: str | None = None) -> jax.Array:
    """Probabilities [..., V] (f32) that sampling draws from, per row of ``config``: one-hot at
    the argmax for a greedy row. With ``vocab_axis`` the logits and the probabilities are this
    shard's vocabulary columns (``nn.tensor_parallel``), computed from the shards' maxima, sums
    and top-k candidates without gathering the logits, except where a row has top-p without
    top-k, which sorts the whole vocabulary (gathered)."""
    rows = _rows(config)
    logits = logits.astype(jnp.float32)
    best = jnp.max(logits, axis=-1, keepdims=True)
    if vocab_axis is not None:
        best = jax.lax.pmax(best, vocab_axis)
    temperature = _per_row(rows.temperature, logits.ndim)
    greedy = temperature <= 0
    # Shifted so the best score is 0 before dividing: a tiny temperature then gives -inf or 0,
    # never inf - inf = NaN.
    scores = (logits - best) / jnp.where(greedy, 1.0, temperature)
    weights = jnp.where(scores >= _cut(scores, rows, vocab_axis), jnp.exp(scores), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if vocab_axis is not None:
        total = jax.lax.psum(total, vocab_axis)
    offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * logits.shape[-1]
    one_hot = (jnp.arange(logits.shape[-1]) + offset == vocab_argmax(logits, vocab_axis)[..., None])
    return jnp.where(greedy, one_hot.astype(jnp.float32), weights / total)


def split_keys(key: jax.Array, num: int) -> tuple[jax.Array, ...]:
    """``num`` new keys from one key, or from each row's key [B] (each row its own stream)."""
    if key.ndim == 0:
        return tuple(jax.random.split(key, num))
    keys = jax.vmap(lambda k: jax.random.split(k, num))(key)
    return tuple(keys[:, i] for i in range(num))


def uniform_per_row(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform [0, 1) of ``shape`` [B, ...]: from one key, or row b from key[b]."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def sample_probs(key: jax.Array, probs: jax.Array, vocab_axis: str | None = None) -> jax.Array:
    """One token per row of probs [..., V], from one key or from each row's key [B] (probs then
    [B, ..., V]); with ``vocab_axis``, of this shard's columns of them: each shard's Gumbel-max
    winner (its own noise), then the best of those (exact, as a categorical draw is the
    Gumbel-max of the log-probabilities)."""
    def draw(key, probs):
        if vocab_axis is None:
            return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        noise = jax.random.gumbel(jax.random.fold_in(key, jax.lax.axis_index(vocab_axis)), probs.shape)
        return vocab_argmax(jnp.log(probs) + noise, vocab_axis)

    return draw(key, probs) if key.ndim == 0 else jax.vmap(draw)(key, probs)


def choose(key: jax.Array, logits: jax.Array, config: "SamplingConfig | SamplingRows",
           vocab_axis: str | None = None) -> jax.Array:
    """Next token(s) from logits [..., V]: argmax when greedy, else a sample (``sample_probs``
    for the keys). With ``vocab_axis`` the logits are this shard's vocabulary columns
    (``nn.tensor_parallel``): neither needs the gathered logits."""
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

    draft_tokens [B, T-1]; draft_probs q [B, T-1, V]; target_probs p [B, T, V]; block_lens [B];
    ``key`` one key or one per row [B].
    With ``vocab_axis`` q and p are this shard's vocabulary columns (``sampling_probs``): the
    probabilities of the drafts and the residual's mass are summed over the shards.
    """
    accept_key, bonus_key = split_keys(key, 2)
    num_drafts = draft_tokens.shape[1]
    p = _probs_of(target_probs[:, :-1], draft_tokens, vocab_axis)
    q = _probs_of(draft_probs, draft_tokens, vocab_axis)
    u = uniform_per_row(accept_key, p.shape)
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


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int,
                   vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The model's own log-probabilities (log-softmax of the raw logits, before any sampling
    setting) of tokens [...] under logits [..., V], and the k most likely [..., k] (values,
    ids, best first). With ``vocab_axis`` the logits are this shard's columns: the normaliser
    from the shards' maxima and sums, the top k from each shard's own top k."""
    logits = logits.astype(jnp.float32)
    best = jnp.max(logits, axis=-1, keepdims=True)
    if vocab_axis is not None:
        best = jax.lax.pmax(best, vocab_axis)
    total = jnp.sum(jnp.exp(logits - best), axis=-1, keepdims=True)
    if vocab_axis is not None:
        total = jax.lax.psum(total, vocab_axis)
    normaliser = (jnp.log(total) + best)[..., 0]
    width = logits.shape[-1]
    offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * width
    local = tokens - offset
    found = jnp.take_along_axis(logits, jnp.clip(local, 0, width - 1)[..., None], axis=-1)[..., 0]
    chosen = jnp.where((local >= 0) & (local < width), found, 0.0)
    if vocab_axis is not None:
        chosen = jax.lax.psum(chosen, vocab_axis)
    values, ids = jax.lax.top_k(logits, min(k, width))
    if vocab_axis is not None:
        values, ids = (gather_vocab(x, vocab_axis) for x in (values, ids + offset))
        values, at = jax.lax.top_k(values, k)
        ids = jnp.take_along_axis(ids, at, axis=-1)
    return chosen - normaliser, values - normaliser[..., None], ids.astype(jnp.int32)

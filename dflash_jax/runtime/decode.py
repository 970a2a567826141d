"""The jitted programs of the engine's decode state, for plain decoding and DFlash alike.

Plain decoding is the same loop with no draft and block size 1: the "verify" of a one-token
block is an ordinary decode step and its "bonus" is the next token. One DFlash step:

1. draft: block ``[last token, mask x (B-1)]`` at positions ``lengths .. lengths+B-1`` through
   the draft over its cached context K/V -> B-1 draft tokens;
2. verify: the target runs the block, writing its K/V, returning logits and tapped hiddens;
3. accept: greedy prefix match, or rejection sampling -> n accepted drafts + a bonus token;
4. commit: emit n+1 tokens (cut at stop tokens / max_new_tokens), advance ``lengths`` by the
   emitted count, write the block's context K/V into the draft's pages (all B positions: those
   past the new ``lengths`` are never read and are overwritten by the next step).

The state's rows are the engine's slots; requests come and go between programs: ``admit_slots``,
``prefill_slots`` (ragged chunks of prompt tokens), ``engine_chunk`` (a chunk of steps on the
device, each slot's new tokens cut out for the host), ``set_page_rows``, ``release_slots``.
Shapes are fixed per engine (slots, block size, buffers, pages), so its loop never recompiles.
A row that is free, prefilling or finished reads as done and is left as it is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from dflash_jax.model import draft as draft_model
from dflash_jax.model import selector
from dflash_jax.model import target as target_model
from dflash_jax.model.cache import PagedKVCache
from dflash_jax.model.config import DraftConfig, ModelConfig
from dflash_jax.model.collectives import vocab_argmax
from dflash_jax.model.params import DraftParams, TargetParams
from dflash_jax.model.sharding import (TensorParallel, cache_specs, draft_layout, local_config, local_draft_config, specs,
                                 target_layout)
from dflash_jax.runtime.grammar import bitmask_to_bool
from dflash_jax.runtime.sampling import (SamplingRows, accept_greedy, accept_sampling, choose, leading_run, sample_probs,
                                 sampling_probs, split_keys, token_logprobs, uniform_per_row)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static choices of one compiled loop. ``draft`` None means plain decoding (block 1). The
    sampling settings travel in ``DecodeState`` (their static part, greedy or top-k, selects the
    compiled code through the state's tree structure).
    ``accept_replay`` (benchmarks only) replaces the accept decision: each draft position is
    accepted independently with probability ``replay_alpha`` (a run-time argument of
    ``engine_chunk``, so one compile serves every alpha), up to the first rejection.
    ``tensor_parallel``: the models are split over its mesh; prefill and chunk then run as one
    ``shard_map`` program each, every device on its slices with the ``local`` configs.
    ``adaptive``: each step verifies a block of one of ``widths`` (2, 4, 8, ... up to
    ``block_size``), the one with the most expected tokens per second for the rows running
    (``choose_width``); else every step verifies ``block_size``."""

    target: ModelConfig
    draft: DraftConfig | None
    block_size: int
    impl: str = "auto"
    accept_replay: bool = False
    tensor_parallel: TensorParallel | None = None
    adaptive: bool = False

    def __post_init__(self):
        if self.draft is None and self.block_size != 1:
            raise ValueError(f"block_size {self.block_size} needs a draft; plain decoding uses 1")
        if self.draft is not None and not 2 <= self.block_size <= self.draft.block_size:
            raise ValueError(f"block_size must be in [2, {self.draft.block_size}] (the draft's "
                             f"trained block size), got {self.block_size}")
        if self.adaptive and self.draft is None:
            raise ValueError("adaptive verification needs a draft")

    @property
    def widths(self) -> tuple[int, ...]:
        """The block widths a step may verify: ``block_size`` alone, or (adaptive) the powers of
        two from 2 below it and itself. Every width verifies at least one draft token, so the
        draft keeps running for every request."""
        if not self.adaptive:
            return (self.block_size,)
        return tuple(w for w in (2, 4, 8, 16, 32, 64) if w < self.block_size) + (self.block_size,)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.draft.target_layer_ids if self.draft is not None else ()

    def local(self) -> "LoopConfig":
        """What each device of the mesh runs: the configs of its shards (``sharding``)."""
        tp = self.tensor_parallel
        return dataclasses.replace(self, target=local_config(self.target, tp.size, expert_parallel=tp.expert_parallel),
                                   tensor_parallel=None,
                                   draft=None if self.draft is None else local_draft_config(self.draft, tp))


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries (B = slots; N = the engine's max_model_len plus two
    chunks of tokens and one; M = max_model_len plus two chunks of steps).

    tokens: [B, N] generated tokens (the first one comes from prefill); entries at and past
        ``num_generated`` are scratch.
    num_generated: [B] emitted so far. last_token: [B] emitted but not yet run by the target.
    done: [B] stop token seen or max_new_tokens reached.
    max_new_tokens: [B]; stop_tokens: [B, S] (-1 padded).
    sampling: ``SamplingRows``, one setting per row ([B]).
    cache: the cache; ``cache.lengths`` counts tokens the target has committed.
    steps: [B] speculation steps taken; accept_lengths: [B, M] tokens emitted per step (each
        step emits at least one); verified: [B, M] draft tokens verified per step.
    acceptance: [B, D] f32 (D = block_size - 1) the row's estimate, at each draft position, of
        the chance the draft token there is accepted when all before it were: a moving average
        of its own steps, started from the engine's running rates (``admit_slots``).
    key: [B] a PRNG key per row; iteration: scalar loop iterations run.
    logprobs: None, or the target's log-probabilities of the emitted tokens, kept beside
        ``tokens`` (``TokenLogprobs``; its top-k width is static).
    """

    tokens: jax.Array
    num_generated: jax.Array
    last_token: jax.Array
    done: jax.Array
    max_new_tokens: jax.Array
    stop_tokens: jax.Array
    sampling: SamplingRows
    cache: PagedKVCache
    steps: jax.Array
    accept_lengths: jax.Array
    verified: jax.Array
    acceptance: jax.Array
    key: jax.Array
    iteration: jax.Array
    logprobs: "TokenLogprobs | None" = None


@struct.dataclass
class TokenLogprobs:
    """Per emitted token (B rows, N positions as ``DecodeState.tokens``): chosen [B, N] its
    log-probability under the target; top_values / top_ids [B, N, K] the K most likely."""

    chosen: jax.Array
    top_values: jax.Array
    top_ids: jax.Array

    @staticmethod
    def zeros(batch: int, length: int, k: int) -> "TokenLogprobs":
        return TokenLogprobs(jnp.zeros((batch, length), jnp.float32), jnp.zeros((batch, length, k), jnp.float32),
                             jnp.zeros((batch, length, k), jnp.int32))

    def write(self, rows, values: "TokenLogprobs") -> "TokenLogprobs":
        """Each row's ``values`` [B, T(, K)] written from position rows[b] on."""
        put = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new, at, axis=0))
        return jax.tree.map(lambda full, new: put(full, new, rows), self, values)


def _logprobs_of(logits: jax.Array, tokens: jax.Array, like: TokenLogprobs, axis: str | None) -> TokenLogprobs:
    """``TokenLogprobs`` of tokens [B, T] under logits [B, T, V], as wide as ``like``'s top k."""
    return TokenLogprobs(*token_logprobs(logits, tokens, like.top_ids.shape[-1], axis))


def bucket(n: int, per_doubling: int = 8) -> int:
    """``n`` rounded up to one of ``per_doubling`` sizes between consecutive powers of two (at
    most 1/per_doubling more): the sizes that set compiled shapes (prompt padding, pages,
    buffers), so that batches of nearby sizes reuse one compilation."""
    step = max(1, (1 << (n.bit_length() - 1)) // per_doubling)
    return -(-n // step) * step


def _is_stop(tokens: jax.Array, stop_tokens: jax.Array) -> jax.Array:
    """tokens [B, T] vs stop_tokens [B, S] (-1 padded) -> [B, T] bool."""
    return jnp.any((tokens[:, :, None] == stop_tokens[:, None, :]) & (stop_tokens[:, None, :] >= 0), axis=-1)


def _prompt_chunk(target: TargetParams, draft: DraftParams | None, config: LoopConfig, tokens: jax.Array,
                  starts: jax.Array, prompt_lens: jax.Array, cache: PagedKVCache,
                  kv_proj) -> tuple[PagedKVCache, jax.Array, jax.Array]:
    """Prompt tokens [R, C] at positions starts[r] + c through the target (and their context into
    the draft's pages), committed up to each row's prompt length prompt_lens [R]. Returns the
    cache, the hidden state [R, H] at each row's last prompt token and whether that token was
    in this chunk [R] (the hidden is meaningless where not)."""
    chunk = tokens.shape[1]
    hidden, taps, cache = target_model.forward(target, config.target, tokens, starts, cache,
                                               tap_layers=config.tap_layers, impl=config.impl)
    at = prompt_lens - 1 - starts                          # each row's last prompt token, if in this chunk
    here = jnp.take_along_axis(hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
    if config.draft is not None:
        positions = starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        cache = draft_model.write_context(draft, config.draft, taps, positions, cache, impl=config.impl,
                                          kv_proj=kv_proj)
    return cache.commit(jnp.minimum(prompt_lens, starts + chunk), config.impl), here, (at >= 0) & (at < chunk)


def _propose(target: TargetParams, draft: DraftParams, state: DecodeState, block_lens: jax.Array,
             key: jax.Array, config: LoopConfig, width: int) -> tuple[jax.Array, jax.Array | None]:
    """Draft tokens [B, width-1] (and their probabilities when sampling)."""
    batch = state.last_token.shape[0]
    masks = jnp.full((batch, width - 1), config.draft.mask_token_id, jnp.int32)
    block = jnp.concatenate([state.last_token[:, None], masks], axis=1)
    vocab_axis = config.target.tensor_axis
    hidden = draft_model.block_hidden(draft, config.draft, target, block, state.cache, block_lens, impl=config.impl,
                                      vocab_axis=vocab_axis)
    logits = draft_model.draft_logits(draft, config.draft, target, hidden[:, 1:], vocab_axis)
    if config.draft.selector is not None:  # DFlash2: a path through each position's top-k candidates
        sampled = not state.sampling.greedy
        path, candidates, probs = selector.select(
            draft.selector, config.draft.selector, hidden[:, 1:], logits, state.last_token,
            state.sampling.temperature if sampled else None, key if sampled else None, vocab_axis)
        return path, None if probs is None else selector.dense_probs(candidates, probs, logits.shape[-1], vocab_axis)
    if state.sampling.greedy:
        return vocab_argmax(logits, vocab_axis), None
    probs = sampling_probs(logits, state.sampling, vocab_axis)
    return sample_probs(key, probs, vocab_axis), probs


def _accept(key: jax.Array, drafts: jax.Array, draft_probs, logits: jax.Array, block_lens: jax.Array,
            sampling: SamplingRows, config: LoopConfig,
            replay_alpha: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(accepted drafts n [B], bonus token [B]) for verify logits [B, block, V]."""
    vocab_axis = config.target.tensor_axis
    if config.draft is None:
        return jnp.zeros(logits.shape[:1], jnp.int32), choose(key, logits[:, 0], sampling, vocab_axis)
    if config.accept_replay:
        replay_key, key = split_keys(key, 2)
        hits = uniform_per_row(replay_key, drafts.shape) < replay_alpha
        accepted = leading_run(hits & (jnp.arange(drafts.shape[1])[None, :] < block_lens[:, None] - 1))
        next_logits = jnp.take_along_axis(logits, accepted[:, None, None], axis=1)[:, 0]
        return accepted, choose(key, next_logits, sampling, vocab_axis)
    if sampling.greedy:
        return accept_greedy(drafts, logits, block_lens, vocab_axis)
    return accept_sampling(key, drafts, draft_probs, sampling_probs(logits, sampling, vocab_axis), block_lens,
                           vocab_axis)


ACCEPTANCE_RATE = 0.125   # weight of a step's outcome in a row's moving acceptance estimate


def _block_lens(state: DecodeState, width: int) -> jax.Array:
    """Each row's block [B]: ``width`` tokens, fewer near max_new_tokens (a block never runs past
    it: the reference shortens its last blocks the same way)."""
    return jnp.clip(state.max_new_tokens - state.num_generated + 1, 1, width)


def draft_block(target: TargetParams, draft: DraftParams | None, state: DecodeState, config: LoopConfig,
                width: int) -> tuple[jax.Array, jax.Array | None]:
    """A step's draft tokens [B, width-1] (none without a draft) and, when sampling, their
    probabilities [B, width-1, V]; drawn with the step's own key (``verify_block`` takes the
    next one of the same split)."""
    if config.draft is None:
        return jnp.zeros((state.last_token.shape[0], 0), jnp.int32), None
    _, draft_key, _ = split_keys(state.key, 3)
    return _propose(target, draft, state, _block_lens(state, width), draft_key, config, width)


def decode_step(target: TargetParams, draft: DraftParams | None, state: DecodeState,
                config: LoopConfig, replay_alpha: jax.Array | None = None,
                context_kv_proj: tuple[jax.Array, ...] | None = None, width: int | None = None) -> DecodeState:
    """One speculation step (draft, verify, accept, commit) for every unfinished sequence, on a
    block of ``width`` tokens (default ``config.block_size``; verifying a shorter block is
    exact: the accept rule only ever looks at a prefix). ``context_kv_proj``:
    ``draft_model.context_kv_proj(draft)``, made once outside the loop."""
    width = config.block_size if width is None else width
    drafts, draft_probs = draft_block(target, draft, state, config, width)
    return verify_block(target, draft, state, drafts, draft_probs, config, replay_alpha, context_kv_proj)


def verify_block(target: TargetParams, draft: DraftParams | None, state: DecodeState, drafts: jax.Array,
                 draft_probs: jax.Array | None, config: LoopConfig, replay_alpha: jax.Array | None = None,
                 context_kv_proj: tuple[jax.Array, ...] | None = None, masks: jax.Array | None = None,
                 block_cap: jax.Array | None = None) -> DecodeState:
    """Verify, accept and commit ``draft_block``'s drafts [B, width-1]. Structured output:
    ``masks`` [B, width, ceil(V/32)] int32 bitmasks of the tokens the grammar allows at each block
    position (``grammar.GrammarMatcher.walk``), applied to the target's logits; ``block_cap`` [B]
    ends a row's block after its first draft token the grammar rejects (that one still tested,
    so that rejection sampling draws from the residual as it would: exact in distribution)."""
    width = drafts.shape[1] + 1
    cache = state.cache
    start = cache.lengths
    active = ~state.done
    remaining = state.max_new_tokens - state.num_generated
    block_lens = _block_lens(state, width)
    if block_cap is not None:
        block_lens = jnp.minimum(block_lens, block_cap)
    key, _, accept_key = split_keys(state.key, 3)
    block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    hidden, taps, cache = target_model.forward(target, config.target, block, start, cache,
                                               tap_layers=config.tap_layers, impl=config.impl)
    logits = target_model.logits(target, hidden)
    if masks is not None:
        logits = jnp.where(bitmask_to_bool(masks, logits.shape[-1]), logits, -jnp.inf)
    accepted, bonus = _accept(accept_key, drafts, draft_probs, logits,
                              block_lens, state.sampling, config, replay_alpha)

    # Emitted run: the accepted drafts then the bonus; cut at max_new_tokens and stop tokens.
    slots = jnp.arange(width)[None, :]
    emitted = jnp.where(slots < accepted[:, None], jnp.concatenate([drafts, bonus[:, None]], axis=1),
                        bonus[:, None])
    produced = jnp.minimum(accepted + 1, remaining)
    stops = _is_stop(emitted, state.stop_tokens) & (slots < produced[:, None])
    hit_stop = jnp.any(stops, axis=1)
    produced = jnp.where(hit_stop, jnp.argmax(stops, axis=1).astype(jnp.int32) + 1, produced)
    produced = jnp.where(active, produced, 0)

    # Writes at and past num_generated / steps land in scratch slots: finished rows need no mask.
    tokens = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))(
        state.tokens, emitted, state.num_generated)
    num_generated = state.num_generated + produced
    if config.draft is not None:
        positions = start[:, None] + slots
        cache = draft_model.write_context(draft, config.draft, taps, positions, cache, impl=config.impl,
                                          kv_proj=context_kv_proj)
    cache = cache.commit(start + produced, config.impl)
    logprobs = state.logprobs
    if logprobs is not None:  # emitted token j was chosen from the verify logits at block position j
        logprobs = logprobs.write(state.num_generated, _logprobs_of(logits, emitted, logprobs,
                                                                     config.target.tensor_axis))
    last = jnp.take_along_axis(emitted, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    rows = jnp.arange(start.shape[0])
    accept_lengths = state.accept_lengths.at[rows, state.steps].set(produced, mode="drop")
    verified = state.verified.at[rows, state.steps].set(jnp.where(active, block_lens - 1, 0), mode="drop")
    # Each draft position tested (all before it accepted, within the row's block) moves the row's estimate.
    positions = jnp.arange(state.acceptance.shape[1])[None, :]
    tested = active[:, None] & (positions <= accepted[:, None]) & (positions < block_lens[:, None] - 1)
    hit = (positions < accepted[:, None]).astype(jnp.float32)
    acceptance = jnp.where(tested, state.acceptance + ACCEPTANCE_RATE * (hit - state.acceptance), state.acceptance)
    return state.replace(
        tokens=tokens, num_generated=num_generated, last_token=jnp.where(active, last, state.last_token),
        done=state.done | hit_stop | (num_generated >= state.max_new_tokens), cache=cache,
        steps=state.steps + active.astype(jnp.int32), accept_lengths=accept_lengths, verified=verified,
        acceptance=acceptance,
        key=_advanced(key, state.key, active), logprobs=logprobs,
        iteration=state.iteration + 1)


def _advanced(new: jax.Array, old: jax.Array, active: jax.Array) -> jax.Array:
    """The step's new keys [B]: only active rows move on, so that a row's draws depend on its own
    steps, not on how long it waited beside others (a seeded request's output is the same
    whatever runs with it)."""
    data = jnp.where(active[:, None], jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))


def default_steps_per_check(num_steps: int) -> int:
    """Steps between the loop's stop checks unless asked otherwise: the largest of 4, 2, 1 that
    divides the chunk. Each check stalls the GPU while the host reads it (~0.2 ms per step on an
    H100/H200, benchmarks/RESULTS.md); each unchecked step after the last row finishes costs one
    wasted step, so at most 3 per chunk."""
    return next(k for k in (4, 2, 1) if num_steps % k == 0)


def check_steps_per_check(num_steps: int, steps_per_check: int) -> None:
    if steps_per_check < 1 or num_steps % steps_per_check:
        raise ValueError(f"steps_per_check ({steps_per_check}) must be >= 1 and divide the steps per "
                         f"chunk (chunk_steps {num_steps})")


def expected_tokens(state: DecodeState, widths: tuple[int, ...]) -> jax.Array:
    """Tokens [len(widths)] the running rows are expected to emit in one step verifying each
    width: per row 1 (the bonus) plus, at each draft position the block reaches (and the row's
    remaining tokens allow), the chance all drafts through it are accepted (the product of the
    row's ``acceptance``)."""
    survive = jnp.cumprod(state.acceptance, axis=1)                        # [B, D]
    remaining = state.max_new_tokens - state.num_generated
    positions = jnp.arange(survive.shape[1])[None, :]
    active = ~state.done
    within = active[:, None] & (positions < remaining[:, None] - 1)
    bonus = jnp.sum(active, dtype=jnp.float32)
    return jnp.stack([bonus + jnp.sum(jnp.where(within & (positions < w - 1), survive, 0.0)) for w in widths])


def choose_width(state: DecodeState, step_costs: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """The index into ``widths`` of the width with the most expected tokens per second for the
    running rows (``expected_tokens`` / ``step_costs`` [len(widths)], a step's measured time
    at each width for this many rows; an infinite cost rules a width out)."""
    return jnp.argmax(expected_tokens(state, widths) / step_costs).astype(jnp.int32)


def _decode_chunk(target: TargetParams, draft: DraftParams | None, state: DecodeState,
                  replay_alpha: jax.Array | None, step_costs: jax.Array | None, *, config: LoopConfig,
                  num_steps: int | jax.Array, steps_per_check: int) -> DecodeState:
    """Up to ``num_steps`` decode steps in one on-device loop (a traced count runs no new
    program; steps go in groups of ``steps_per_check``); stops early once every sequence is
    done, looking every ``steps_per_check`` steps (which must divide ``num_steps``).

    Why check less often: the stop test of a ``lax.while_loop`` is read back by the host after
    every iteration, so the GPU idles between steps; an inner loop of a fixed number of steps
    runs with no read-back. Steps taken after every row is done change nothing (done rows are
    left as they are) but cost a step's time each."""
    stop_at = state.iteration + num_steps

    def running(s: DecodeState):
        return (s.iteration < stop_at) & ~jnp.all(s.done)

    kv_proj = None if draft is None else draft_model.context_kv_proj(draft)
    branches = [functools.partial(decode_step, target, draft, config=config, replay_alpha=replay_alpha,
                                  context_kv_proj=kv_proj, width=width) for width in config.widths]

    def step(s: DecodeState) -> DecodeState:
        if len(branches) == 1:
            return branches[0](s)
        return jax.lax.switch(choose_width(s, step_costs, config.widths), branches, s)

    def steps(s: DecodeState) -> DecodeState:
        return jax.lax.fori_loop(0, steps_per_check, lambda _, s: step(s), s)

    return jax.lax.while_loop(running, steps, state)


# ----------------------------------------------------------------------------- slots
#
# A slot's page-table row holds only its own pages (a released slot's row holds the sentinel page:
# its scratch writes from the loop are dropped, never landing in pages that another request now
# owns).


@struct.dataclass
class ChunkOutput:
    """What the host reads after an engine chunk (R rows of the chunk, W = steps x block tokens).
    tokens: [R, 2W + 1] each row's tokens from the count the host had read on; num_generated,
    done, steps: [R] after the chunk; accept_lengths, verified: [R, 2 steps] per-step emitted
    counts and draft tokens verified, from the steps the host had read on; logprobs: those of
    the tokens (when the state keeps them)."""

    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array
    steps: jax.Array
    accept_lengths: jax.Array
    verified: jax.Array
    logprobs: TokenLogprobs | None = None


def _put(full: jax.Array, slots: jax.Array, rows) -> jax.Array:
    """full[slots] = rows; slot indices out of range (padding rows) write nothing."""
    return full.at[slots].set(rows, mode="drop")


def _take(full: jax.Array, slots: jax.Array, fill=0) -> jax.Array:
    """full[slots]; padding slot indices read ``fill``."""
    return jnp.take(full, slots, axis=0, mode="fill", fill_value=fill)


@functools.partial(jax.jit, donate_argnames=("state",))
def admit_slots(state: DecodeState, slots: jax.Array, page_rows: jax.Array, lengths: jax.Array,
                max_new_tokens: jax.Array, stop_tokens: jax.Array, sampling: SamplingRows,
                keys: jax.Array, acceptance: jax.Array) -> DecodeState:
    """Give slots [R] to new requests: their page-table rows [R, W], committed lengths [R] (the
    tokens of a cached prefix their pages already hold; 0 without one), max_new_tokens [R], stop
    tokens [R, S], sampling settings (values [R]; the state keeps its static part), PRNG keys [R]
    and the acceptance estimate they start from [D] (the engine's running rates); zeroed
    recurrent states and counters. They read as done until ``prefill_slots`` has run their last
    prompt token."""
    cache = state.cache
    zero = lambda pool: tuple(None if x is None else _put(x, slots, 0) for x in pool)  # noqa: E731
    cache = cache.replace(page_table=_put(cache.page_table, slots, page_rows),
                          lengths=_put(cache.lengths, slots, lengths), conv=zero(cache.conv),
                          recurrent=zero(cache.recurrent))
    values = dataclasses.replace(state.sampling, **{
        name: _put(getattr(state.sampling, name), slots, getattr(sampling, name))
        for name in ("temperature", "top_p", "top_k", "min_p")})
    return state.replace(cache=cache, done=_put(state.done, slots, True),
                         num_generated=_put(state.num_generated, slots, 0),
                         max_new_tokens=_put(state.max_new_tokens, slots, max_new_tokens),
                         stop_tokens=_put(state.stop_tokens, slots, stop_tokens), sampling=values,
                         steps=_put(state.steps, slots, 0), key=_put(state.key, slots, keys),
                         acceptance=_put(state.acceptance, slots, acceptance))


@functools.partial(jax.jit, donate_argnames=("state",))
def set_page_rows(state: DecodeState, slots: jax.Array, page_rows: jax.Array) -> DecodeState:
    """Page-table rows [R, W] of slots [R]: a request's pages as it grows."""
    cache = state.cache.replace(page_table=_put(state.cache.page_table, slots, page_rows))
    return state.replace(cache=cache)


@functools.partial(jax.jit, donate_argnames=("state",))
def release_slots(state: DecodeState, slots: jax.Array) -> DecodeState:
    """Slots [R] free again: done, no pages (sentinel row), no committed tokens."""
    cache = state.cache
    cache = cache.replace(page_table=_put(cache.page_table, slots, cache.num_pages),
                          lengths=_put(cache.lengths, slots, 0))
    return state.replace(cache=cache, done=_put(state.done, slots, True))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def prefill_slots(target: TargetParams, draft: DraftParams | None, state: DecodeState, slots: jax.Array,
                  tokens: jax.Array, prompt_lens: jax.Array, first_masks: jax.Array | None = None, *,
                  config: LoopConfig) -> tuple[DecodeState, PrefillOutput]:
    """One chunk of prompt tokens [R, C] for slots [R] (padding rows: slot index >= B), each
    from its committed length on (ragged: every row its own start; positions past a prompt's
    end are scratch). A row whose prompt ends in the chunk gets its first token, chosen with its
    own settings and key (under the grammar's mask ``first_masks`` [R, ceil(V/32)] when given:
    structured output), and starts decoding; the host reads it at once (``PrefillOutput``)."""
    if config.tensor_parallel is not None:
        body = functools.partial(_prefill_slots, config=config.local())
        specs_of_state = state_specs(state, config.tensor_parallel)
        logprob_specs = None if state.logprobs is None else TokenLogprobs(P(), P(), P())
        return _on_mesh(body, config, (target, draft, state, slots, tokens, prompt_lens, first_masks),
                        (*_param_specs(target, draft, config), specs_of_state, P(), P(), P(),
                         None if first_masks is None else P()),
                        (specs_of_state, PrefillOutput(P(), P(), logprob_specs)))
    return _prefill_slots(target, draft, state, slots, tokens, prompt_lens, first_masks, config=config)


@struct.dataclass
class PrefillOutput:
    """Per row of a prefill chunk [R]: first, the first token (meaningful where the prompt ended
    in the chunk); done, whether that token already ends the request; logprobs [R, 1(, K)] of
    it when the state keeps them."""

    first: jax.Array
    done: jax.Array
    logprobs: TokenLogprobs | None = None


def _prefill_slots(target: TargetParams, draft: DraftParams | None, state: DecodeState, slots: jax.Array,
                   tokens: jax.Array, prompt_lens: jax.Array, first_masks: jax.Array | None, *,
                   config: LoopConfig) -> tuple[DecodeState, PrefillOutput]:
    cache = state.cache
    rows = lambda pool: tuple(None if x is None else _take(x, slots) for x in pool)  # noqa: E731
    sub = cache.replace(page_table=_take(cache.page_table, slots, cache.num_pages), lengths=_take(cache.lengths, slots),
                        conv=rows(cache.conv), recurrent=rows(cache.recurrent), pending=None)
    kv_proj = None if config.draft is None else draft_model.context_kv_proj(draft)
    sub, last, ends = _prompt_chunk(target, draft, config, tokens, sub.lengths, prompt_lens, sub, kv_proj)
    back = lambda full, part: tuple(None if x is None else _put(x, slots, y) for x, y in zip(full, part))  # noqa: E731
    cache = cache.replace(k=sub.k, v=sub.v, lengths=_put(cache.lengths, slots, sub.lengths),
                          conv=back(cache.conv, sub.conv), recurrent=back(cache.recurrent, sub.recurrent))

    clipped = jnp.clip(slots, 0, state.done.shape[0] - 1)  # padding rows compute on a copy and write nothing
    sampling = jax.tree.map(lambda x: x[clipped], state.sampling)
    keys, first_keys = split_keys(state.key[clipped], 2)
    logits = target_model.logits(target, last)
    if first_masks is not None:
        logits = jnp.where(bitmask_to_bool(first_masks, logits.shape[-1]), logits, -jnp.inf)
    first = choose(first_keys, logits, sampling, config.target.tensor_axis)
    done = _is_stop(first[:, None], state.stop_tokens[clipped])[:, 0] | (state.max_new_tokens[clipped] <= 1)
    started = jnp.where(ends, slots, state.done.shape[0])  # rows whose prompt ended
    logprobs, values = state.logprobs, None
    if logprobs is not None:
        values = _logprobs_of(logits[:, None], first[:, None], logprobs, config.target.tensor_axis)
        logprobs = jax.tree.map(lambda full, new: full.at[started, 0].set(new[:, 0], mode="drop"), logprobs, values)
    state = state.replace(cache=cache, logprobs=logprobs, tokens=state.tokens.at[started, 0].set(first, mode="drop"),
                          num_generated=_put(state.num_generated, started, 1),
                          last_token=_put(state.last_token, started, first), done=_put(state.done, started, done),
                          steps=_put(state.steps, started, 0), key=_put(state.key, started, keys))
    return state, PrefillOutput(first=first, done=done, logprobs=values)


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "steps_per_check"), donate_argnames=("state",))
def engine_chunk(target: TargetParams, draft: DraftParams | None, state: DecodeState, rows: jax.Array,
                 seen: jax.Array, seen_steps: jax.Array, replay_alpha: jax.Array | None = None,
                 step_costs: jax.Array | None = None, max_steps: jax.Array | None = None, *, config: LoopConfig,
                 num_steps: int, steps_per_check: int = 1) -> tuple[DecodeState, ChunkOutput]:
    """Up to ``num_steps`` decode steps over the slots ``rows`` [R] (padding: a slot index >= B;
    the chunk computes R rows, not B: an engine of many slots running few requests runs a
    small program), then each row's tokens from ``seen`` [R] on (what the host has read; it
    may lag one chunk) and acceptance lengths from ``seen_steps`` [R] on cut out on the device
    (``ChunkOutput``, 2 chunks + 1 tokens wide): the host reads a few KB, not the buffers.
    ``replay_alpha`` (scalar) is required exactly when ``config.accept_replay`` (benchmarks);
    ``step_costs`` [len(config.widths)] exactly when ``config.adaptive``: a step's time at
    each width for R rows (``choose_width``). ``max_steps`` (scalar, a multiple of
    ``steps_per_check`` up to ``num_steps``; default ``num_steps``): this chunk's steps, fewer
    while prompts wait to be prefilled (the engine's step token budget) at no new compile."""
    if config.accept_replay != (replay_alpha is not None):
        raise ValueError("replay_alpha must be given exactly when config.accept_replay is set")
    if config.adaptive != (step_costs is not None):
        raise ValueError("step_costs must be given exactly when config.adaptive is set")
    check_steps_per_check(num_steps, steps_per_check)
    body = functools.partial(_engine_chunk, config=config if config.tensor_parallel is None else config.local(),
                             num_steps=num_steps, steps_per_check=steps_per_check)
    if config.tensor_parallel is None:
        return body(target, draft, state, rows, seen, seen_steps, replay_alpha, step_costs, max_steps)
    specs_of_state = state_specs(state, config.tensor_parallel)
    return _on_mesh(body, config, (target, draft, state, rows, seen, seen_steps, replay_alpha, step_costs, max_steps),
                    (*_param_specs(target, draft, config), specs_of_state, P(), P(), P(),
                     None if replay_alpha is None else P(), None if step_costs is None else P(),
                     None if max_steps is None else P()),
                    (specs_of_state, ChunkOutput(P(), P(), P(), P(), P(), P(),
                                                 None if state.logprobs is None else TokenLogprobs(P(), P(), P()))))


_ROW_FIELDS = ("tokens", "num_generated", "last_token", "max_new_tokens", "stop_tokens", "steps", "accept_lengths",
               "verified", "acceptance", "key")


def _gather_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """The state of slots ``rows`` [R] (over the same K/V pools); a padding row (index >= B) is
    done, with the sentinel page row and no context, so it writes nothing."""
    batch = state.done.shape[0]
    clipped = jnp.clip(rows, 0, batch - 1)
    cache = state.cache
    pool = lambda x: tuple(None if p is None else _take(p, rows) for p in x)  # noqa: E731
    sub = cache.replace(page_table=_take(cache.page_table, rows, cache.num_pages), lengths=_take(cache.lengths, rows),
                        conv=pool(cache.conv), recurrent=pool(cache.recurrent))
    taken = {name: getattr(state, name)[clipped] for name in _ROW_FIELDS}
    logprobs = None if state.logprobs is None else jax.tree.map(lambda x: x[clipped], state.logprobs)
    return state.replace(cache=sub, done=_take(state.done, rows, True), logprobs=logprobs,
                         sampling=jax.tree.map(lambda x: x[clipped], state.sampling), **taken)


def _scatter_rows(state: DecodeState, rows: jax.Array, sub: DecodeState) -> DecodeState:
    """``state`` with slots ``rows`` [R] set from ``sub`` (``_gather_rows``'s, after steps);
    padding rows write nothing."""
    cache = state.cache
    back = lambda full, part: tuple(None if x is None else _put(x, rows, y) for x, y in zip(full, part))  # noqa: E731
    cache = cache.replace(k=sub.cache.k, v=sub.cache.v, lengths=_put(cache.lengths, rows, sub.cache.lengths),
                          conv=back(cache.conv, sub.cache.conv), recurrent=back(cache.recurrent, sub.cache.recurrent))
    logprobs = None if state.logprobs is None else jax.tree.map(lambda full, part: _put(full, rows, part),
                                                                  state.logprobs, sub.logprobs)
    put = {name: _put(getattr(state, name), rows, getattr(sub, name)) for name in _ROW_FIELDS}
    return state.replace(cache=cache, done=_put(state.done, rows, sub.done), logprobs=logprobs,
                         iteration=sub.iteration, **put)


def _engine_chunk(target: TargetParams, draft: DraftParams | None, state: DecodeState, rows: jax.Array,
                  seen: jax.Array, seen_steps: jax.Array, replay_alpha: jax.Array | None,
                  step_costs: jax.Array | None, max_steps: jax.Array | None, *, config: LoopConfig, num_steps: int,
                  steps_per_check: int) -> tuple[DecodeState, ChunkOutput]:
    steps = num_steps if max_steps is None else jnp.clip(max_steps, 1, num_steps)
    sub = _decode_chunk(target, draft, _gather_rows(state, rows), replay_alpha, step_costs, config=config,
                        num_steps=steps, steps_per_check=steps_per_check)
    return _scatter_rows(state, rows, sub), _chunk_output(sub, seen, seen_steps, num_steps, config.block_size)


def _chunk_output(sub: DecodeState, seen: jax.Array, seen_steps: jax.Array, num_steps: int,
                  block_size: int) -> ChunkOutput:
    """The rows' windows after up to ``num_steps`` steps: tokens from ``seen`` [R] on, per-step
    counts from ``seen_steps`` [R] on (``ChunkOutput``)."""
    cut = lambda values, starts, width: jax.vmap(  # noqa: E731
        lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, width))(values, starts)
    width = 2 * num_steps * block_size + 1
    logprobs = None if sub.logprobs is None else jax.tree.map(lambda x: cut(x, seen, width), sub.logprobs)
    return ChunkOutput(tokens=cut(sub.tokens, seen, width), num_generated=sub.num_generated, done=sub.done,
                       steps=sub.steps, accept_lengths=cut(sub.accept_lengths, seen_steps, 2 * num_steps),
                       verified=cut(sub.verified, seen_steps, 2 * num_steps), logprobs=logprobs)


# ----------------------------------------------------------------------------- structured output
#
# A request under a grammar takes its steps one at a time, the host between the draft and the
# verify: ``grammar_draft`` gives the rows' draft tokens; the host walks them through each row's
# matcher (``grammar.GrammarMatcher.walk``: a mask per block position, and where the first token
# the grammar rejects is); ``grammar_verify`` verifies under those masks and commits.


@functools.partial(jax.jit, static_argnames=("config",))
def grammar_draft(target: TargetParams, draft: DraftParams | None, state: DecodeState, rows: jax.Array, *,
                  config: LoopConfig) -> tuple[jax.Array, jax.Array | None]:
    """Draft tokens [R, block-1] (and their probabilities when sampling) of slots ``rows`` [R]
    (padding: an index >= B); the state is left as it is."""
    return draft_block(target, draft, _gather_rows(state, rows), config, config.block_size)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def grammar_verify(target: TargetParams, draft: DraftParams | None, state: DecodeState, rows: jax.Array,
                   drafts: jax.Array, draft_probs: jax.Array | None, masks: jax.Array, block_cap: jax.Array,
                   seen: jax.Array, seen_steps: jax.Array, replay_alpha: jax.Array | None = None, *,
                   config: LoopConfig) -> tuple[DecodeState, ChunkOutput]:
    """One step of slots ``rows`` [R] on ``grammar_draft``'s drafts under the grammar's ``masks``
    [R, block, ceil(V/32)] and ``block_cap`` [R] (``verify_block``; ``replay_alpha`` exactly when
    ``config.accept_replay``, as ``engine_chunk``); their windows as an engine chunk of one step
    gives them (``ChunkOutput``)."""
    if config.accept_replay != (replay_alpha is not None):
        raise ValueError("replay_alpha must be given exactly when config.accept_replay is set")
    kv_proj = None if draft is None else draft_model.context_kv_proj(draft)
    sub = verify_block(target, draft, _gather_rows(state, rows), drafts, draft_probs, config, replay_alpha, kv_proj,
                       masks=masks, block_cap=block_cap)
    return _scatter_rows(state, rows, sub), _chunk_output(sub, seen, seen_steps, 1, config.block_size)


# ----------------------------------------------------------------------------- tensor parallelism


def _replicated_specs(tree):
    return jax.tree.map(lambda _: P(), tree)


def _param_specs(target: TargetParams, draft: DraftParams | None, config: LoopConfig) -> tuple:
    tp = config.tensor_parallel
    return (specs(target_layout(target, config.target, tp.expert_parallel)),
            None if draft is None else specs(draft_layout(draft, config.draft, tp)))


def state_specs(state: DecodeState, tensor_parallel: TensorParallel) -> DecodeState:
    """PartitionSpecs of a DecodeState (or its ShapeDtypeStructs): the cache's pools split
    (``sharding.cache_specs``), the rest replicated."""
    return _state_specs(state.sampling, cache_specs(state.cache, tensor_parallel), state.logprobs)


def _state_specs(sampling: SamplingRows, cache, logprobs: TokenLogprobs | None = None) -> DecodeState:
    rep = P()
    return DecodeState(tokens=rep, num_generated=rep, last_token=rep, done=rep, max_new_tokens=rep, stop_tokens=rep,
                       sampling=_replicated_specs(sampling), cache=cache, steps=rep, accept_lengths=rep, verified=rep,
                       acceptance=rep, key=rep, iteration=rep, logprobs=None if logprobs is None else TokenLogprobs(rep, rep, rep))


def _on_mesh(body, config: LoopConfig, args: tuple, in_specs: tuple, out_specs):
    """``body(*args)`` as one program per device of the config's mesh. The replication of
    results is not checked by jax (``check_vma=False``): every replicated value is computed
    from summed or gathered ones, identical on every device, and the tests compare whole runs."""
    return jax.shard_map(body, mesh=config.tensor_parallel.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)

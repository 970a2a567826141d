"""The decode state on the device and the programs that change it.

One ``DecodeState`` of ``slots`` rows stays on the device. Slot updates (admit, new page rows,
release) are padded to one row per slot, so each is one compiled program however many requests
it touches; prefill calls run one chunk of prompt tokens for several rows, each from its own
start; a decode chunk cuts each slot's window of new tokens out on the device
(``decode.engine_chunk``), so the host reads a few KB a chunk. Results are copied to the host
asynchronously and read (``read``) one engine step later."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.loading.models import Draft, Target
from dflash_jax.model.cache import cache_bytes_per_device, check_cache_fits, device_free_bytes, zeroed_cache
from dflash_jax.model.config import ModelConfig
from dflash_jax.model.sharding import TensorParallel, replicated
from dflash_jax.runtime.decode import (ChunkOutput, DecodeState, LoopConfig, PrefillOutput, TokenLogprobs, admit_slots,
                                       bucket, engine_chunk, grammar_draft, grammar_verify, prefill_slots,
                                       release_slots, set_page_rows)
from dflash_jax.runtime.grammar import bitmask_width
from dflash_jax.runtime.engine.request import MAX_STOP_TOKEN_IDS, Request
from dflash_jax.runtime.sampling import SamplingConfig, SamplingRows
from pallas_kernels.sizes import next_power_of_2

log = logging.getLogger(__name__)

_COMPILE_EVENTS = {"/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration"}
_compiles: list[tuple[float, float]] = []   # (when it ended, seconds): this process's compilations


def _record_compile(event: str, seconds: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        _compiles.append((time.monotonic(), seconds))


jax.monitoring.register_event_duration_secs_listener(_record_compile)


def compile_seconds(start: float, end: float) -> float:
    """Seconds this process spent tracing and compiling between two ``time.monotonic()``s (an
    engine compiles as new shapes come: timings subtract it)."""
    return sum(seconds for when, seconds in _compiles if start <= when <= end)


def default_num_pages(target: Target, draft: Draft | None, *, slots: int, pages_per_seq: int, page_size: int,
                      max_model_len: int) -> int:
    """Pages for every slot at max_model_len, or as many as 90% of the device's free memory
    holds when that is fewer (at least one request of max_model_len, else ValueError)."""
    every_slot = slots * pages_per_seq
    free = device_free_bytes()
    if free is None:
        return every_slot
    draft_model = None if draft is None else draft.config.model
    table = jax.ShapeDtypeStruct((slots, pages_per_seq), jnp.int32)
    sized = [cache_bytes_per_device(jax.eval_shape(
        lambda t, n=n: zeroed_cache(t, target.config, draft_model, n, page_size, target.params.embed.dtype, None),
        table), target.tensor_parallel) for n in (1, 2)]
    per_page, fixed = sized[1] - sized[0], 2 * sized[0] - sized[1]
    fits = int((0.9 * free - fixed) // per_page)
    if fits < pages_per_seq:
        raise ValueError(f"the device has {free / 2**30:.2f} GiB free beside the weights: not even one request "
                         f"of max_model_len {max_model_len} fits ({pages_per_seq} pages of "
                         f"{per_page / 2**20:.2f} MiB): lower max_model_len")
    if fits < every_slot:
        log.warning("KV pool: %d pages (%d tokens) fit in 90%% of the free device memory, fewer than %d slots x "
                    "max_model_len %d; requests wait for pages (lower max_model_len or max_num_seqs, or give "
                    "num_pages)", fits, fits * page_size, slots, max_model_len)
    return min(fits, every_slot)


@dataclasses.dataclass(frozen=True)
class DispatchedChunk:
    """A decode chunk in flight: its output (windows starting at ``seen`` tokens and
    ``seen_steps`` steps of each slot) and the decoding request of each slot when dispatched."""

    output: ChunkOutput
    owners: list[Request | None]
    seen: np.ndarray
    seen_steps: np.ndarray


def empty_state(target: ModelConfig, draft_model: ModelConfig | None, dtype, key: jax.Array, *, slots: int,
                num_pages: int, page_size: int, pages_per_seq: int, max_model_len: int, chunk_steps: int,
                block_size: int, stop_width: int, tensor_parallel: TensorParallel | None) -> DecodeState:
    """The decode state of ``slots`` free slots (sentinel page rows, done, greedy defaults) over
    a zeroed pool of ``num_pages`` pages (split over the mesh of ``tensor_parallel``); under
    ``jax.eval_shape``, its shapes (``dflash_jax.aot`` compiles for them)."""
    width = chunk_steps * block_size
    table = np.full((slots, pages_per_seq), num_pages, np.int32)
    cache = zeroed_cache(jnp.asarray(table), target, draft_model, num_pages, page_size, dtype, tensor_parallel)
    sampling = SamplingRows.stack([SamplingConfig()] * slots)
    rest = dict(tokens=jnp.zeros((slots, max_model_len + 2 * width + 1), jnp.int32),
                num_generated=jnp.zeros((slots,), jnp.int32), last_token=jnp.zeros((slots,), jnp.int32),
                done=jnp.ones((slots,), bool), max_new_tokens=jnp.ones((slots,), jnp.int32),
                stop_tokens=jnp.full((slots, stop_width), -1, jnp.int32),
                sampling=sampling, steps=jnp.zeros((slots,), jnp.int32),
                accept_lengths=jnp.zeros((slots, max_model_len + 2 * chunk_steps), jnp.int32),
                verified=jnp.zeros((slots, max_model_len + 2 * chunk_steps), jnp.int32),
                acceptance=jnp.zeros((slots, block_size - 1), jnp.float32),
                key=jax.random.split(key, slots), iteration=jnp.zeros((), jnp.int32))
    return DecodeState(cache=cache, **replicated(rest, tensor_parallel))


def row_buckets(slots: int) -> tuple[int, ...]:
    """The row counts a decode chunk is compiled for: powers of two below ``slots``, and
    ``slots``; a chunk runs the smallest that holds the requests decoding."""
    return tuple(sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)}))


class Device:
    """The decode state of ``slots`` slots over a pool of ``num_pages`` pages, and the calls of
    the jitted programs on it (``decode``: admit_slots, set_page_rows, release_slots,
    prefill_slots, engine_chunk). With ``config.adaptive``, ``step_costs`` maps each row
    bucket to a step's measured seconds at each verify width (``calibrate``). With
    ``prefill_rows`` (batch-invariant engines) every program has one shape: decode chunks run
    every slot, prefill calls that many rows of ``prefill_chunk`` tokens."""

    def __init__(self, target: Target, draft: Draft | None, config: LoopConfig, *, slots: int, num_pages: int,
                 page_size: int, pages_per_seq: int, max_model_len: int, chunk_steps: int, steps_per_check: int,
                 prefill_chunk: int, top_k_cap: int, max_logprobs: int, eos_ids: list[int], seed: int,
                 accept_replay: float | None, prefill_rows: int | None = None):
        self.target, self.draft, self.config = target, draft, config
        self.slots, self.num_pages, self.page_size, self.pages_per_seq = slots, num_pages, page_size, pages_per_seq
        self.max_model_len, self.chunk_steps, self.steps_per_check = max_model_len, chunk_steps, steps_per_check
        self.prefill_chunk, self.top_k_cap, self.max_logprobs = prefill_chunk, top_k_cap, max_logprobs
        self.eos_ids = eos_ids
        self._key = jax.random.key(seed)
        self.replay_alpha = None if accept_replay is None else replicated(jnp.float32(accept_replay),
                                                                         target.tensor_parallel)
        self.fixed_prefill_rows = prefill_rows
        self.row_buckets = row_buckets(slots) if prefill_rows is None else (slots,)
        self.step_costs: dict[int, np.ndarray] | None = None
        self.state = self.empty_state()

    @property
    def _draft_params(self):
        return None if self.draft is None else self.draft.params

    @property
    def stop_width(self) -> int:
        """Stop ids a slot holds: a request's own and the end-of-sequence ids, the latter
        rounded up to a power of two (engines with a few more or fewer share programs)."""
        return MAX_STOP_TOKEN_IDS + (next_power_of_2(len(self.eos_ids)) if self.eos_ids else 0)

    def empty_state(self) -> DecodeState:
        """Every slot free: sentinel page rows, done, greedy defaults."""
        tp = self.target.tensor_parallel
        state = empty_state(self.target.config, None if self.draft is None else self.draft.config.model,
                            self.target.params.embed.dtype, self._key, slots=self.slots, num_pages=self.num_pages,
                            page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                            max_model_len=self.max_model_len, chunk_steps=self.chunk_steps,
                            block_size=self.config.block_size, stop_width=self.stop_width, tensor_parallel=tp)
        check_cache_fits(jax.eval_shape(lambda: state.cache), tp)
        return state

    def reset(self) -> None:
        """A new empty state (after a failed call, which may have consumed the donated one)."""
        self.state = None                      # its buffers go before new ones are made
        self.state = self.empty_state()

    def admit(self, admitted: list[Request], running: list[Request], acceptance: np.ndarray) -> None:
        """``admit_slots`` for the admitted requests, each from its cached prefix (``running``: all
        those holding slots; ``acceptance`` [block_size - 1]: the estimate they start from)."""
        pad = self.slots - len(admitted)
        settings = [r.params.sampling for r in admitted] + [SamplingConfig()] * pad
        keys = request_keys(self._key, np.asarray([r.number for r in admitted] + [0] * pad, np.uint32),
                            np.asarray([r.params.seed or 0 for r in admitted] + [0] * pad, np.uint32),
                            np.asarray([r.params.seed is not None for r in admitted] + [False] * pad),
                            np.asarray([r.params.sample_index for r in admitted] + [0] * pad, np.uint32))
        stops = np.full((self.slots, self.state.stop_tokens.shape[1]), -1, np.int32)
        for row, request in enumerate(admitted):
            ids = list(request.params.stop_token_ids) + ([] if request.params.ignore_eos else self.eos_ids)
            stops[row, :len(ids)] = ids
        inputs = (self._slot_rows(admitted), self._page_rows(admitted),
                  jnp.asarray([r.cached_tokens for r in admitted] + [0] * pad, jnp.int32),
                  jnp.asarray([r.params.max_tokens for r in admitted] + [0] * pad, jnp.int32), jnp.asarray(stops),
                  SamplingRows.stack(settings), keys, jnp.asarray(acceptance, jnp.float32))
        self.state = self._with_statics(admit_slots(self.state, *replicated(inputs, self.target.tensor_parallel)),
                                        running)

    def set_pages(self, grown: list[Request]) -> None:
        """``set_page_rows`` for the requests that grew."""
        self.state = set_page_rows(self.state, *replicated((self._slot_rows(grown), self._page_rows(grown)),
                                                           self.target.tensor_parallel))

    def release(self, slots: list[int], running: list[Request]) -> None:
        """``release_slots`` for the slots given back, padded to one row per slot (one program
        however many; ``running``: the requests still holding slots)."""
        rows = jnp.asarray(list(slots) + [self.slots] * (self.slots - len(slots)), jnp.int32)
        self.state = self._with_statics(release_slots(self.state, *replicated((rows,), self.target.tensor_parallel)),
                                        running)

    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(rows, tokens) of a prefill call: rows a power of two, tokens a power of four from 16 up
        to ``prefill_chunk`` (few shapes to compile; short remainders pad at most 4x)."""
        if self.fixed_prefill_rows is not None:
            return bucket(self.fixed_prefill_rows, per_doubling=1), self.prefill_chunk
        chunk = 16
        while chunk < min(longest, self.prefill_chunk):
            chunk *= 4
        return bucket(rows, per_doubling=1), min(chunk, self.prefill_chunk)

    def prefill(self, rows: list[Request]) -> PrefillOutput:
        """Dispatch the next chunk of each row's prompt (their ``prefilled`` counts advance)."""
        count, chunk = self.prefill_shape(len(rows), max(len(r.prompt_ids) - r.prefilled for r in rows))
        tokens = np.zeros((count, chunk), np.int32)
        slots = np.full((count,), self.slots, np.int32)          # padding rows: out of range, write nothing
        lens = np.zeros((count,), np.int32)
        for row, request in enumerate(rows):
            piece = request.prompt_ids[request.prefilled:request.prefilled + chunk]
            tokens[row, :len(piece)] = piece
            slots[row], lens[row] = request.slot, len(request.prompt_ids)
        masks = None   # structured output: the first token under its grammar; the other rows allow all
        if any(r.matcher is not None for r in rows):
            masks = np.full((count, bitmask_width(self.target.config.vocab_size)), -1, np.int32)
            for row, request in enumerate(rows):
                if request.matcher is not None:
                    request.matcher.allowed(into=masks[row])
        self.state, output = self._prefill_call(slots, tokens, lens, masks)
        jax.tree.map(lambda x: x.copy_to_host_async(), output)
        for request in rows:
            request.prefilled = min(len(request.prompt_ids), request.prefilled + chunk)
        return output

    def _prefill_call(self, slots: np.ndarray, tokens: np.ndarray, lens: np.ndarray, masks: np.ndarray | None = None):
        return prefill_slots(self.target.params, self._draft_params, self.state,
                             *replicated((jnp.asarray(slots), jnp.asarray(tokens), jnp.asarray(lens),
                                          None if masks is None else jnp.asarray(masks)), self.target.tensor_parallel),
                             config=self.config)

    def grammar_step(self, requests: list[Request]) -> tuple[ChunkOutput, DispatchedChunk]:
        """One step of the decoding requests under grammars (structured output), on the smallest
        row bucket holding them: their draft tokens read back, walked through each request's
        matcher (a mask per block position; the block ends after the first token the grammar
        rejects), then verified under those masks. Returns the step's output, read, and the
        rows' window bookkeeping (as a decode chunk's)."""
        count = self.row_bucket(len(requests))
        rows = np.asarray([r.slot for r in requests] + [self.slots] * (count - len(requests)), np.int32)
        owners = requests + [None] * (count - len(requests))
        tp, block = self.target.tensor_parallel, self.config.block_size
        drafts, draft_probs = grammar_draft(self.target.params, self._draft_params, self.state,
                                            replicated(jnp.asarray(rows), tp), config=self.config)
        drafts_host = _on_host(drafts)
        masks = np.full((count, block, bitmask_width(self.target.config.vocab_size)), -1, np.int32)
        cap = np.full((count,), block, np.int32)
        # The block runs through the first draft token the grammar rejects: the target still tests it
        # (so rejection sampling draws from the residual as it must). Replayed acceptance (benchmarks)
        # does not test tokens, so there the block ends before it.
        tested = 1 if self.replay_alpha is not None else 2
        for row, request in enumerate(requests):
            masks[row], legal = request.matcher.walk(drafts_host[row])
            cap[row] = min(legal + tested, block)
        seen = np.asarray([0 if r is None else r.delivered for r in owners], np.int32)
        seen_steps = np.asarray([0 if r is None else len(r.accept_lengths) for r in owners], np.int32)
        self.state, output = grammar_verify(
            self.target.params, self._draft_params, self.state, *replicated(
                (jnp.asarray(rows), drafts, draft_probs, jnp.asarray(masks), jnp.asarray(cap), jnp.asarray(seen),
                 jnp.asarray(seen_steps)), tp), self.replay_alpha, config=self.config)
        return _on_host(output), DispatchedChunk(output, owners, seen, seen_steps)

    def row_bucket(self, count: int) -> int:
        """The rows a chunk of ``count`` decoding requests runs (``row_buckets``)."""
        return next(rows for rows in self.row_buckets if rows >= count)

    def chunk(self, owners: list[Request | None], steps: int | None = None) -> DispatchedChunk:
        """Dispatch a decode chunk of ``steps`` steps (default ``chunk_steps``) for the decoding
        requests (``owners``: each slot's, or None) on the smallest row bucket that holds them;
        each row's window of tokens starts at its request's delivered count."""
        slots = [slot for slot, request in enumerate(owners) if request is not None]
        count = self.row_bucket(len(slots))
        requests = [owners[slot] for slot in slots] + [None] * (count - len(slots))
        rows = np.asarray(slots + [self.slots] * (count - len(slots)), np.int32)
        seen = np.asarray([0 if r is None else r.delivered for r in requests], np.int32)
        seen_steps = np.asarray([0 if r is None else len(r.accept_lengths) for r in requests], np.int32)
        self.state, output = self._chunk_call(rows, seen, seen_steps, steps=steps)
        jax.tree.map(lambda x: x.copy_to_host_async(), output)
        return DispatchedChunk(output, requests, seen, seen_steps)

    def _chunk_call(self, rows: np.ndarray, seen: np.ndarray, seen_steps: np.ndarray,
                    step_costs: np.ndarray | None = None, steps: int | None = None):
        """``engine_chunk`` on ``rows`` for ``steps`` steps (default ``chunk_steps``);
        ``step_costs`` default: the measured ones of the bucket."""
        if self.config.adaptive and step_costs is None:
            step_costs = self.step_costs[len(rows)]
        costs = None if step_costs is None else jnp.asarray(step_costs, jnp.float32)
        tp = self.target.tensor_parallel
        steps = jnp.int32(self.chunk_steps if steps is None else steps)
        return engine_chunk(self.target.params, self._draft_params, self.state,
                            *replicated((jnp.asarray(rows), jnp.asarray(seen), jnp.asarray(seen_steps)), tp),
                            self.replay_alpha, replicated(costs, tp), replicated(steps, tp), config=self.config,
                            num_steps=self.chunk_steps, steps_per_check=self.steps_per_check)

    def calibrate(self, context: int = 512, repeats: int = 2) -> dict[int, np.ndarray]:
        """Measure a decode step's seconds at each verify width for each row bucket (every row
        running at ``context`` tokens, its draft tokens proposed and verified as in serving),
        for ``choose_width``; sets and returns ``step_costs``. Before any request: it runs on
        the live state, then makes a fresh one."""
        widths = self.config.widths
        context = max(0, min(context, self.max_model_len - self.chunk_steps * self.config.block_size - 1))
        costs = {}
        for count in self.row_buckets:
            seconds = np.zeros(len(widths))
            for index in range(len(widths)):
                forced = np.full(len(widths), np.inf, np.float32)
                forced[index] = 1.0
                runs = []
                for _ in range(repeats):
                    self.state = self._all_running(count, context)
                    started = time.perf_counter()
                    self.state, output = self._chunk_call(np.arange(count, dtype=np.int32),
                                                          np.zeros(count, np.int32), np.zeros(count, np.int32),
                                                          step_costs=forced)
                    jax.block_until_ready(output)
                    runs.append((time.perf_counter() - started) / self.chunk_steps)
                seconds[index] = min(runs)
            costs[count] = seconds
        self.reset()
        self.step_costs = costs
        log.info("verify widths %s: seconds per step by rows running %s", widths,
                 {count: [round(1e3 * t, 3) for t in row] for count, row in costs.items()})
        return costs

    def _all_running(self, count: int, context: int) -> DecodeState:
        """The state with slots 0 .. count-1 decoding at ``context`` tokens over distinct pages
        (wrapping around a small pool), no stop tokens and no end within a chunk (``calibrate``)."""
        state = self.state
        table = (np.arange(self.slots * self.pages_per_seq, dtype=np.int32) % self.num_pages).reshape(self.slots, -1)
        lengths = np.where(np.arange(self.slots) < count, context, 0).astype(np.int32)
        done = np.arange(self.slots) >= count
        tp = self.target.tensor_parallel
        zeros = np.zeros(self.slots, np.int32)   # (two fields, two buffers: the state is donated)
        table, lengths, done, stops, generated, steps, budget = replicated(tuple(jnp.asarray(x) for x in (
            table, lengths, done, np.full(state.stop_tokens.shape, -1, np.int32), zeros, zeros,
            np.full(self.slots, 2 * self.chunk_steps * self.config.block_size, np.int32))), tp)
        cache = state.cache.replace(page_table=table, lengths=lengths)
        return state.replace(cache=cache, done=done, stop_tokens=stops, num_generated=generated, steps=steps,
                             max_new_tokens=budget)

    def read(self, output):
        """A dispatched call's output on the host (waits for it)."""
        return _on_host(output)

    def warmup(self, prompt_lengths: Sequence[int] | None, tokens: int, rows: int) -> int:
        """Compile the prefill shapes of up to ``rows`` rows and ``tokens`` tokens, the most an
        engine's call holds (padding rows only, which write nothing), the slot updates and the greedy decode chunk of
        each row bucket (padding rows only: it returns at once). ``prompt_lengths``: only the
        shapes prompts of these lengths use; by default every shape. Returns the number of
        programs run."""
        if prompt_lengths is None:
            remainders = {1, 17, 65, 257, 1025, 4097, self.prefill_chunk}
        else:
            remainders = {length - start for length in prompt_lengths for start in range(0, length, self.prefill_chunk)}
        shapes = sorted({shape for count in range(1, rows + 1) for longest in remainders
                         if math.prod(shape := self.prefill_shape(count, longest)) <= tokens})
        for count, chunk in shapes:
            self.state, _ = self._prefill_call(np.full((count,), self.slots, np.int32),
                                               np.zeros((count, chunk), np.int32), np.zeros((count,), np.int32))
        self.admit([], [], np.zeros(self.config.block_size - 1, np.float32))
        self.set_pages([])
        self.release([], [])
        for count in self.row_buckets:   # every row padding: each returns at once
            zeros = np.zeros(count, np.int32)
            self.state, _ = self._chunk_call(np.full(count, self.slots, np.int32), zeros, zeros,
                                             step_costs=np.ones(len(self.config.widths)) if self.config.adaptive
                                             else None)
        jax.block_until_ready(self.state)
        return len(shapes) + 3 + len(self.row_buckets)

    def _with_statics(self, state: DecodeState, running: list[Request]) -> DecodeState:
        """The state's static choices for the requests holding slots: greedy when all are; the
        top-k candidates capped at ``top_k_cap`` (one compiled variant for any top-k); the
        log-probability buffers while one asks for them."""
        statics = SamplingRows.statics([r.params.sampling for r in running], top_k_cap=self.top_k_cap)
        state = state.replace(sampling=dataclasses.replace(state.sampling, **statics))
        wanted = any(r.params.logprobs is not None for r in running)
        if wanted and state.logprobs is None:
            logprobs = TokenLogprobs.zeros(*state.tokens.shape, max(self.max_logprobs, 1))
            state = state.replace(logprobs=replicated(logprobs, self.target.tensor_parallel))
        elif not wanted and state.logprobs is not None:
            state = state.replace(logprobs=None)
        return state

    def _slot_rows(self, requests: list[Request]) -> jax.Array:
        """The requests' slots [slots]; the rows after them out of range (padding)."""
        return jnp.asarray([r.slot for r in requests] + [self.slots] * (self.slots - len(requests)), jnp.int32)

    def _page_rows(self, requests: list[Request]) -> jax.Array:
        """The requests' page-table rows [slots, W]; the rows after them the sentinel page."""
        table = np.full((self.slots, self.pages_per_seq), self.num_pages, np.int32)
        for row, request in enumerate(requests):
            table[row, :len(request.pages)] = request.pages
        return jnp.asarray(table)


@jax.jit
def request_keys(engine_key: jax.Array, numbers: jax.Array, seeds: jax.Array, seeded: jax.Array,
                 sample_indices: jax.Array) -> jax.Array:
    """Each row's sampling key [rows]: ``jax.random.key(seed)`` where ``seeded``, else the engine's
    key folded with the request's arrival number; then its sample index folded in. One program
    for all rows (stacking one key per request compiled a concatenation of thousands)."""
    own = jax.random.key_data(jax.vmap(jax.random.key)(seeds))
    drawn = jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(engine_key, numbers))
    keys = jax.random.wrap_key_data(jnp.where(seeded[:, None], own, drawn), impl=jax.random.key_impl(engine_key))
    return jax.vmap(jax.random.fold_in)(keys, sample_indices)


def _on_host(tree):
    """A tree of replicated device arrays as numpy (any local device's copy: several processes
    each read their own)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)

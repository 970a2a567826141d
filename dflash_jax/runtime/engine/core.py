"""The engine: requests in from any thread, one engine step at a time driving the parts (the
scheduler, the device state, the output processor)."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from dflash_jax.loading.models import Draft, Target
from dflash_jax.loading.tokenizer import TextStream, Tokenizer
from dflash_jax.model.cache import check_page_size
from dflash_jax.model.kernel_shapes import check_kernel_shapes
from dflash_jax.model.sharding import replicated
from dflash_jax.runtime.decode import LoopConfig, PrefillOutput, bucket, default_steps_per_check
from dflash_jax.runtime.engine.device import Device, DispatchedChunk, default_num_pages
from dflash_jax.runtime.engine.output import EngineStats, OutputProcessor
from dflash_jax.runtime.engine.prefix_cache import prefix_caching_unsupported
from dflash_jax.runtime.engine.request import MAX_STOP_TOKEN_IDS, Request, RequestOutput, RequestParams
from dflash_jax.runtime.grammar import GrammarMatcher, grammar_tokenizer
from dflash_jax.runtime.engine.scheduler import QueueFullError, Scheduler

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512   # prompt tokens a row runs per engine step, unless an engine is given another
SPECULATIVE_POLICIES = ("fixed", "adaptive")


class Engine:
    """Continuous batching over ``max_num_seqs`` slots (the package docstring). ``submit`` from
    any thread; ``step`` (or ``start``: a background thread calling it) drives the device.

    max_model_len: prompt + generated tokens a request may hold (default: the target's
    max_position_embeddings); num_pages: the KV pages of the pool (default: enough for every
    slot at max_model_len); prefill_chunk: prompt tokens a row runs per engine step;
    prefill_rows: requests of whole ``prefill_chunk`` pieces prefilled together per step (a prefill
    call holds up to ``prefill_rows`` x ``prefill_chunk`` tokens: more rows when their remainders
    are shorter, such as prompts after a cached prefix, except for hybrid targets and
    batch-invariant engines); chunk_steps: decode steps per chunk;
    max_waiting: requests the queue holds before ``submit`` refuses; top_k_cap: the largest top_k
    a request may sample with; max_logprobs: the most top log-probabilities a request may ask
    for (computed only while a running request asks). prefix_caching: reuse the KV pages of cached
    prompt prefixes (``prefix_cache``; None: on unless the models are hybrids, which it does not
    support). accept_replay (benchmarks only): each draft token is accepted with this probability
    instead of by the target (``decode.LoopConfig``).
    max_num_batched_tokens: the token budget of an engine step while prompts wait to be
    prefilled: its prefill call's prompt tokens plus its decode chunk's (steps x rows x block).
    Every step runs both (a burst of arrivals never stalls the requests decoding, and the
    decoding ones never hold the new ones back a whole chunk): the prefill call takes the rows
    that fit beside one group of decode steps (at least one row), the decode chunk the steps
    that fit beside it (at least ``steps_per_check``, whole groups of them, at most
    ``chunk_steps``). Default: a whole prefill call (``prefill_rows`` x ``prefill_chunk``
    tokens) beside one group of decode steps of every slot.
    speculative_policy: "fixed" verifies the whole block every step; "adaptive" (with a draft)
    verifies, each step, the block width (2, 4, 8, ... up to the block) with the most expected
    tokens per second for the requests running, from each request's acceptance so far and a
    step's time at each width measured on the device (``Device.calibrate``, at ``warmup`` or
    before the first request): lossless either way. batch_invariant: every program runs at one
    shape whatever the load (all slots in each decode chunk, full prefill calls), so a request's
    greedy tokens do not depend on what runs beside it, in bfloat16 too; it needs the fixed
    policy and leaves prefix caching off."""

    def __init__(self, target: Target, draft: Draft | None = None, tokenizer: Tokenizer | None = None, *,
                 max_num_seqs: int = 8, max_model_len: int | None = None, num_pages: int | None = None,
                 page_size: int = 16, block_size: int | None = None, chunk_steps: int = 8,
                 steps_per_check: int | None = None, prefill_chunk: int = PREFILL_CHUNK, prefill_rows: int = 8,
                 max_waiting: int = 1024, impl: str = "auto", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, top_k_cap: int = 64, max_logprobs: int = 20,
                 max_num_batched_tokens: int | None = None, prefix_caching: bool | None = None,
                 accept_replay: float | None = None, speculative_policy: str = "fixed",
                 batch_invariant: bool = False):
        config = target.config
        for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size), ("chunk_steps", chunk_steps),
                            ("prefill_chunk", prefill_chunk), ("prefill_rows", prefill_rows),
                            ("max_waiting", max_waiting), ("top_k_cap", top_k_cap)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_page_size(config, page_size)
        if batch_invariant and speculative_policy == "adaptive" and draft is not None:
            raise ValueError("batch_invariant needs speculative_policy 'fixed' (adaptive widths follow the load)")
        unsupported = prefix_caching_unsupported(config, None if draft is None else draft.config.model)
        if batch_invariant and not unsupported:
            unsupported = ("batch-invariant mode: a prompt after a cached prefix is prefilled in other chunks than "
                           "the same prompt alone, so its numbers could differ")
        self.prefix_caching_unsupported = unsupported
        if prefix_caching and unsupported:
            raise ValueError(f"prefix caching is not supported here: {unsupported}. Leave prefix_caching unset "
                             "(off for such models) or pass False; the server: --no-prefix-caching")
        self.prefix_caching = not unsupported if prefix_caching is None else prefix_caching
        if unsupported and prefix_caching is None:
            log.info("prefix caching off: %s", unsupported)
        if draft is not None:
            draft.config.check_target(config)
            block_size = draft.config.block_size if block_size is None else block_size
            if draft.tensor_parallel != target.tensor_parallel:
                raise ValueError("the draft and the target must be on the same mesh")
        elif block_size not in (None, 1):
            raise ValueError("block_size needs a draft")
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        if speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {SPECULATIVE_POLICIES}, got {speculative_policy!r}")
        if speculative_policy == "adaptive" and draft is not None and jax.process_count() > 1:
            raise ValueError("speculative_policy 'adaptive' runs in one process (each process would time its own "
                             "step costs and choose its own widths); use 'fixed' across several processes")
        if accept_replay is not None and (draft is None or not 0 <= accept_replay <= 1):
            raise ValueError(f"accept_replay needs a draft and a probability in [0, 1], got {accept_replay}")
        self.config = LoopConfig(target=config, draft=None if draft is None else draft.config,
                                 block_size=1 if block_size is None else block_size, impl=impl,
                                 accept_replay=accept_replay is not None, tensor_parallel=target.tensor_parallel,
                                 adaptive=draft is not None and speculative_policy == "adaptive")
        local = self.config if target.tensor_parallel is None else self.config.local()
        check_kernel_shapes(impl, [local.target] + ([local.draft.model] if draft is not None else []), page_size,
                            self.config.block_size, target.params.embed.dtype.itemsize)
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if not 2 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}] (the target's "
                             f"max_position_embeddings), got {self.max_model_len}")
        self.page_size, self.slots = page_size, max_num_seqs
        self.pages_per_seq = math.ceil((self.max_model_len + self.config.block_size) / page_size)
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages or default_num_pages(target, draft, slots=max_num_seqs,
                                                        pages_per_seq=self.pages_per_seq, page_size=page_size,
                                                        max_model_len=self.max_model_len)
        self.chunk_steps = chunk_steps
        self.steps_per_check = steps_per_check or default_steps_per_check(chunk_steps)
        self.prefill_chunk = min(bucket(prefill_chunk, per_doubling=1), bucket(self.max_model_len, per_doubling=1))
        self.prefill_rows, self.max_waiting, self.top_k_cap = prefill_rows, max_waiting, top_k_cap
        # A prefill call's tokens, and its rows: any number within those, but prefill_rows for
        # batch-invariant engines (one shape) and hybrid targets (a row's recurrent state is gathered
        # for the call, tens of MiB a row at real shapes).
        self.prefill_tokens = bucket(min(prefill_rows, max_num_seqs), per_doubling=1) * self.prefill_chunk
        self.prefill_row_cap = min(prefill_rows, max_num_seqs) if config.recurrent_layers or batch_invariant \
            else max_num_seqs
        if max_num_batched_tokens is not None and (not isinstance(max_num_batched_tokens, int)
                                                   or max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens = max_num_batched_tokens or (
            self.prefill_tokens + max_num_seqs * self.config.block_size * self.steps_per_check)
        if not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        self.eos_ids = list(stop_token_ids if stop_token_ids is not None
                            else (tokenizer.stop_token_ids if tokenizer is not None else []))
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._in_flight: DispatchedChunk | None = None     # the chunk dispatched and not yet delivered
        self._released: list[int] = []                      # slots released, not yet freed on the device
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        positions = max(self.config.block_size - 1, 0)
        self.stats = EngineStats(accepted_per_position=[0] * positions, verified_per_position=[0] * positions)
        self.scheduler = Scheduler(slots=max_num_seqs, num_pages=self.num_pages, page_size=page_size,
                                   block_size=self.config.block_size, max_waiting=max_waiting,
                                   prefix_caching=self.prefix_caching)
        self.output = OutputProcessor(tokenizer, self.eos_ids, self.stats, release=self._release,
                                      draft_tokens=None if draft is None else self.config.block_size - 1)
        self.device = Device(target, draft, self.config, slots=max_num_seqs, num_pages=self.num_pages,
                             page_size=page_size, pages_per_seq=self.pages_per_seq, max_model_len=self.max_model_len,
                             chunk_steps=chunk_steps, steps_per_check=self.steps_per_check,
                             prefill_chunk=self.prefill_chunk, top_k_cap=top_k_cap, max_logprobs=max_logprobs,
                             eos_ids=self.eos_ids, seed=seed, accept_replay=accept_replay,
                             prefill_rows=min(prefill_rows, max_num_seqs) if batch_invariant else None)

    # ------------------------------------------------------------------ requests

    def check_request(self, prompt_ids: Sequence[int], params: RequestParams) -> None:
        """ValueError naming what is wrong with a request, before it is queued."""
        vocab = self.target.config.vocab_size
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab})")
        if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens: with max_tokens {params.max_tokens} it needs "
                             f"{len(prompt_ids) + params.max_tokens}, more than the maximum context length "
                             f"{self.max_model_len}")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(params.stop_token_ids)}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the engine has none)")
        if any(not isinstance(s, str) or not s for s in params.stop):
            raise ValueError("stop strings must be non-empty strings")
        if params.sampling.top_k > self.top_k_cap and not params.sampling.greedy:
            raise ValueError(f"top_k must be at most {self.top_k_cap} (this engine's top_k_cap), got "
                             f"{params.sampling.top_k}")
        if params.logprobs is not None and not 0 <= params.logprobs <= self.max_logprobs:
            raise ValueError(f"logprobs must be in [0, {self.max_logprobs}] (this engine's max_logprobs), got "
                             f"{params.logprobs}")
        if params.grammar is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer (the engine has none)")
            if self.target.tensor_parallel is not None:
                raise ValueError("structured output under tensor parallelism is not supported yet (--tp 1)")
        pages = self.scheduler.pages_for(len(prompt_ids), params.max_tokens)
        if pages > self.num_pages:
            raise ValueError(f"the request needs {pages} pages of {self.page_size} tokens, more than the engine's "
                             f"{self.num_pages}")

    def submit(self, prompt_ids: Sequence[int], params: RequestParams = RequestParams(), *,
               request_id: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> Request:
        """Queue a request (ValueError for a bad one, QueueFullError when the queue is full or
        the engine is stopping). ``on_output`` is called from the engine's thread with each
        ``RequestOutput``; it must not block."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        number = next(self._ids)
        request = Request(id=request_id or f"req-{number}", number=number, prompt_ids=prompt_ids, params=params,
                          on_output=on_output or (lambda output: None))
        if self.tokenizer is not None:
            request.stream = TextStream(self.tokenizer)
        if params.grammar is not None:
            request.matcher = GrammarMatcher(self.grammar_tokenizer, params.grammar)
        with self._lock:
            if not self._accepting:
                raise QueueFullError("the engine is shutting down")
            self.scheduler.enqueue(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (it finishes with "abort" and frees its pages at the next step)."""
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    @functools.cached_property
    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer (``grammar.grammar_tokenizer``), built at the first
        request under a grammar (seconds for a 150k vocabulary) and shared by all."""
        return grammar_tokenizer(self.tokenizer, self.target.config.vocab_size)

    @property
    def accepting(self) -> bool:
        """False once ``stop`` was called: new requests are refused."""
        return self._accepting

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def pages_in_use(self) -> int:
        """KV pages some request references (cached pages nobody references are not in use)."""
        return self.scheduler.pages_in_use

    @property
    def cached_pages(self) -> int:
        """KV pages in the prefix cache, referenced or not."""
        return self.scheduler.cached_pages

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting) or self.num_running > 0 or self._in_flight is not None

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One engine step: settle cancellations, admit, one prefill chunk, dispatch a decode
        chunk and deliver the previous one's tokens. False when there was nothing to do."""
        try:
            with self._lock:
                for request in self.scheduler.take_cancelled():
                    self.output.finish(request, "abort")
                self._free_released()
                if self.has_work():
                    self._calibrate_once()
                self._admit()
            if not self.has_work():
                return False
            prefilled = self._prefill()
            if prefilled is not None:
                # First tokens before the decode chunk is dispatched: on a GPU that dispatch returns
                # only when the chunk ends (its loop's stop test is read back every iteration).
                output, rows, _ = prefilled
                self.output.first_tokens(self.device.read(output), rows)
            chunk = self._dispatch_chunk(0 if prefilled is None else prefilled[2])
            self._grammar_step()
            previous, self._in_flight = self._in_flight, chunk
            if previous is not None:
                self.output.chunk_tokens(self.device.read(previous.output), previous)
            self._free_released()
        except Exception as error:  # noqa: BLE001 - every in-flight request learns of it, then it is raised
            self._fail_all(f"{type(error).__name__}: {error}")
            raise
        return True

    def prefill_waiting(self) -> list[Request]:
        """Admit the waiting requests that fit and run their whole prompts, dispatching no decode
        chunk; returns the requests decoding. Benchmarks start each timed decode chunk so, from
        a known context."""
        if self._in_flight is not None:
            raise RuntimeError("prefill_waiting runs with no decode chunk in flight")
        with self._lock:
            self._calibrate_once()
            self._admit()
        while prefilled := self._prefill():
            output, rows, _ = prefilled
            self.output.first_tokens(self.device.read(output), rows)
        self._free_released()
        return [r for r in self.scheduler.decoding() if r is not None]

    def close(self) -> None:
        """Let go of the device state (the KV pool) now rather than when the engine is collected;
        the engine takes no more requests."""
        self.stop(drain=False)
        self._in_flight = None
        self.device.state = None

    def set_accept_replay(self, probability: float) -> None:
        """Benchmarks: the acceptance probability the next decode chunks replay (an engine made
        with ``accept_replay``; no new compile)."""
        if self.device.replay_alpha is None:
            raise ValueError("set_accept_replay needs an engine made with accept_replay")
        if not 0 <= probability <= 1:
            raise ValueError(f"accept_replay must be a probability in [0, 1], got {probability}")
        self.device.replay_alpha = replicated(jnp.float32(probability), self.target.tensor_parallel)

    def run_until_done(self) -> None:
        """Step until no request is waiting or running (the offline path)."""
        while self.step():
            pass

    def start(self) -> None:
        """Step in a background thread until ``stop``."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._thread = threading.Thread(target=self._serve, name="dflash-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.has_work():
                    self._lock.wait(timeout=0.5)
                if self._stopping and not self.has_work():
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - logged; step aborted the requests it held
                log.exception("engine step failed; the requests holding slots were aborted")

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; with ``drain`` finish the queued and running ones first, else
        abort them; then end the background thread."""
        with self._lock:
            self._accepting = False
            if not drain:
                for request in list(self.scheduler.waiting) + self.scheduler.running:
                    request.cancelled = True
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def warmup(self, prompt_lengths: Sequence[int] | None = None) -> int:
        """Compile what the first requests would otherwise wait for: the prefill shapes, the slot
        updates (admit, grow, release) and the greedy decode chunk of each row bucket
        (``Device.warmup``); with the adaptive policy, measure the step costs. Returns
        the number of programs run. Before any request is submitted. ``prompt_lengths``: only the
        shapes prompts of these lengths use (a benchmark's fixed lengths); by default every
        shape."""
        if self.has_work():
            raise RuntimeError("warmup runs before the first request")
        programs = self.device.warmup(prompt_lengths, tokens=self.prefill_tokens, rows=self.prefill_row_cap)
        self._calibrate_once()
        return programs

    def _calibrate_once(self) -> None:
        """With the adaptive policy, measure the step costs (``Device.calibrate``) before the
        first request is admitted (it runs on the live state); nothing otherwise. If that fails,
        the waiting requests finish with "abort" and the error (none is left waiting on an
        engine that cannot step), the state is rebuilt, and the error is raised; the next
        request tries again."""
        if self.config.adaptive and self.device.step_costs is None:
            if self.scheduler.running or self._in_flight is not None:
                raise RuntimeError("the step costs are measured before any request is admitted")
            log.info("measuring a decode step's time at each verify width %s (adaptive verification)",
                     self.config.widths)
            try:
                self.device.calibrate()
            except Exception as error:
                self.device.reset()
                message = f"measuring the step costs of adaptive verification failed: {type(error).__name__}: {error}"
                while self.scheduler.waiting:
                    self.output.finish(self.scheduler.waiting.popleft(), "abort", error=message)
                raise

    # ------------------------------------------------------------------ internals

    def _admit(self) -> None:
        """Admit the waiting requests that fit (``Scheduler.admit``) into their slots on the device;
        count their prompts' prefix-cache lookups."""
        admitted = self.scheduler.admit()
        if not admitted:
            return
        self.device.admit(admitted, self.scheduler.running, self.output.acceptance_prior())
        if self.prefix_caching:
            self.stats.prefix_cache_queries += sum(len(r.prompt_ids) for r in admitted)
            self.stats.prefix_cache_hits += sum(r.cached_tokens for r in admitted)

    def _decode_tokens(self, steps: int, decoding: int | None = None) -> int:
        """Tokens a decode chunk of ``steps`` steps computes for ``decoding`` rows (default: the
        requests decoding now without a grammar): their row bucket x the block."""
        if decoding is None:
            decoding = sum(r is not None and r.matcher is None for r in self.scheduler.decoding())
        return 0 if not decoding else steps * self.device.row_bucket(decoding) * self.config.block_size

    def _prefill(self) -> tuple[PrefillOutput, list[Request], int] | None:
        """Dispatch one chunk of prompt tokens for the requests still prefilling: as many as the
        call holds (``prefill_tokens``: the rows' bucket x their longest remainder's piece; at most
        ``prefill_row_cap`` rows, ``prefill_rows`` with a grammar's masks) and fit the step's token
        budget beside one group of decode steps (at least one), then cache the full prompt pages
        it wrote; returns its output, those requests and the tokens it computes."""
        rows = self.scheduler.prefilling(self.slots)
        # a grammar's masked calls compile at first use, not at warmup: few shapes
        rows = rows[:self.prefill_rows if any(r.matcher is not None for r in rows) else self.prefill_row_cap]
        if not rows:
            return None
        decoding = sum(r is not None and r.matcher is None for r in self.scheduler.decoding())
        sizes, fitting, longest, starting = {}, [], 0, 0
        for count, request in enumerate(rows, 1):
            rest = len(request.prompt_ids) - request.prefilled
            longest = max(longest, rest)
            sizes[count] = size = math.prod(self.device.prefill_shape(count, longest))
            if size > self.prefill_tokens:
                break
            # it starts decoding after this call when its rest fits a piece: the call's piece is the
            # longest rest's (all fit) or prefill_chunk
            starting += request.matcher is None and rest <= self.prefill_chunk
            if size + self._decode_tokens(self.steps_per_check, decoding + starting) <= self.max_num_batched_tokens:
                fitting.append(count)
        smallest = min(sizes.values())    # none fits: the most rows of the smallest call (one shape: all)
        rows = rows[:max(fitting or [count for count, size in sizes.items() if size == smallest])]
        tokens = sizes[len(rows)]
        before = sum(r.prefilled for r in rows)
        output = self.device.prefill(rows)
        self.scheduler.cache_prefilled(rows)
        self.stats.prefill_tokens_computed += sum(r.prefilled for r in rows) - before
        self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in rows if r.decoding)
        return output, rows, tokens

    def _chunk_steps(self, prefill_tokens: int) -> int:
        """The decode chunk's steps: all ``chunk_steps`` when no prompt waits to be prefilled,
        else the whole groups of ``steps_per_check`` that fit the step's token budget beside the
        prefill call's ``prefill_tokens`` (at least one group)."""
        if not self.scheduler.prefilling(1):
            return self.chunk_steps
        group = self._decode_tokens(self.steps_per_check)
        groups = (self.max_num_batched_tokens - prefill_tokens) // group if group else 0
        return self.steps_per_check * min(max(groups, 1), self.chunk_steps // self.steps_per_check)

    def _dispatch_chunk(self, prefill_tokens: int) -> DispatchedChunk | None:
        """Grow pages for two chunks ahead (the host's counts lag one chunk), then dispatch a
        decode chunk for the decoding requests without a grammar, of the steps that fit the
        step's token budget beside the prefill call's ``prefill_tokens`` (``_chunk_steps``)."""
        owners = self.scheduler.decoding()
        decoding = [r for r in owners if r is not None]
        if not decoding:
            return None
        ahead = 2 * self.chunk_steps * self.config.block_size + self.config.block_size + 1
        grown = self.scheduler.grow(decoding, {r: len(r.prompt_ids) + r.delivered + ahead for r in decoding})
        if grown:
            self.device.set_pages(grown)
        owners = [None if r is None or r.matcher is not None else r for r in owners]
        if not any(owners):
            return None
        return self.device.chunk(owners, self._chunk_steps(prefill_tokens))

    def _grammar_step(self) -> None:
        """One step of the decoding requests under grammars, their tokens delivered at once (the
        next step's masks depend on them; ``Device.grammar_step``)."""
        requests = [r for r in self.scheduler.decoding() if r is not None and r.matcher is not None
                    and r.delivered and not r.finished]
        if requests:
            self.output.chunk_tokens(*self.device.grammar_step(requests))
    def _release(self, request: Request) -> None:
        """A finishing request's slot and pages back; the device frees the slots of a step's
        finished requests together (``_free_released``), before any slot is handed out again."""
        slot = self.scheduler.release(request)
        if slot is not None:
            self._released.append(slot)

    def _free_released(self) -> None:
        """The slots released since the last call freed on the device, in one program."""
        if self._released:
            slots, self._released = self._released, []
            self.device.release(slots, self.scheduler.running)

    def _fail_all(self, message: str) -> None:
        """After a failed step: the device state rebuilt (a failed call may have consumed its
        donated buffers), every request holding a slot finished with "abort" and ``message``, the
        prefix cache emptied (the new pool holds none of its pages); the waiting ones stay
        queued."""
        self._in_flight = None
        self._released = []
        self.device.reset()
        for request in self.scheduler.running:
            self.scheduler.release(request)             # the new state holds nothing of it
            self.output.finish(request, "abort", error=message)
        self.scheduler.drop_prefix_cache()

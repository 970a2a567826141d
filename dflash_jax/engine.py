"""The serving engine: slots, continuous batching, chunked ragged prefill, pages as requests grow.

One ``DecodeState`` of ``max_num_seqs`` slots stays on the device. Between decode chunks the host
admits waiting requests into free slots (by free slots and by pages not yet promised: a request
is admitted only when its whole worst case fits, so nothing runs out of pages mid-run; one that
can never fit is refused at once), runs one chunk of prompt tokens for the requests still
prefilling (each row its own start: no padding to the longest prompt, and a long prompt takes
one chunk per engine step instead of stalling the others for its whole prefill), hands out
pages as the requests grow and frees them when one finishes, is cancelled or fails.

Host work overlaps device work: chunk k is dispatched before chunk k-1's tokens are read,
detokenized, checked for stop strings and delivered; so the host's view lags one chunk, and a
request stopped by a stop string or cancelled is released one chunk later (the tokens the
device made for it meanwhile are dropped). Each slot's window of new tokens is cut out on the
device (``decode.engine_chunk``), so the host reads a few KB a chunk.

Every request keeps its own sampling settings (``SamplingConfig``), seed, stop tokens and
strings and max_tokens in the one batch; DFlash stays exact per row (``sampling``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cache import (cache_bytes_per_device, check_cache_fits, check_page_size, device_free_bytes,
                              zeroed_cache)
from dflash_jax.decode import (ChunkOutput, DecodeState, LoopConfig, PrefillOutput, TokenLogprobs, admit_slots,
                               bucket, default_steps_per_check, engine_chunk, prefill_slots, release_slots,
                               set_page_rows)
from dflash_jax.models import Draft, Target
from dflash_jax.ops import check_kernel_shapes
from dflash_jax.sampling import SamplingConfig, SamplingRows
from dflash_jax.sharding import replicated
from dflash_jax.tokenizer import TextStream, Tokenizer

log = logging.getLogger("dflash_jax.engine")

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

MAX_STOP_TOKEN_IDS = 16   # stop token ids a request may give (besides the model's end-of-sequence ids)


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (or it is shutting down): try again later."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's settings. ``seed`` None draws from the engine's own stream; ``sample_index``
    tells apart the n samples of one prompt under one seed. ``stop``: strings that end the
    output (matched on the text, not included in it); ``stop_token_ids``: tokens that end it
    (included in the tokens, not in the text); ``ignore_eos``: the model's end-of-sequence
    tokens do not stop it."""

    max_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    sample_index: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (its raw logits, before sampling
    settings) and the ``RequestParams.logprobs`` most likely tokens' (id, log-probability)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RequestOutput:
    """What a request has produced since its previous output. ``text`` and ``token_ids`` are the
    new pieces (text held back while it may still turn into a stop string, or ends in a partial
    character); ``accept_lengths`` the new DFlash steps' emitted counts. The last output has
    ``finished`` set and ``finish_reason`` "stop" (an end-of-sequence or stop token or string),
    "length" (max_tokens) or "abort" (cancelled, or the engine failed: ``error``). ``logprobs``:
    one per new token, when the request asked for them."""

    request_id: str
    text: str
    token_ids: list[int]
    accept_lengths: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """A request and its progress through the engine (host side)."""

    id: str
    number: int                     # order of arrival (keys of unseeded requests)
    prompt_ids: list[int]
    params: RequestParams
    on_output: Callable[[RequestOutput], None]
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    promised_pages: int = 0
    prefilled: int = 0              # prompt tokens run so far
    delivered: int = 0              # generated tokens the host has read
    token_ids: list[int] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    text: str = ""                  # the generated text so far (cut at a stop string)
    sent_text: int = 0              # characters of ``text`` delivered
    stream: TextStream | None = None
    pending_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)   # of the next output
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.prompt_ids)


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (spec-decode ones named as vLLM's metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)


class Engine:
    """Continuous batching over ``max_num_seqs`` slots (module docstring). ``submit`` from any
    thread; ``step`` (or ``start``: a background thread calling it) drives the device.

    max_model_len: prompt + generated tokens a request may hold (default: the target's
    max_position_embeddings); num_pages: the KV pages of the pool (default: enough for every
    slot at max_model_len); prefill_chunk: prompt tokens a row runs per engine step;
    prefill_rows: requests prefilled together per step; chunk_steps: decode steps per chunk;
    max_waiting: requests the queue holds before ``submit`` refuses; top_k_cap: the largest top_k
    a request may sample with; max_logprobs: the most top log-probabilities a request may ask
    for (computed only while a running request asks). accept_replay (benchmarks only): each draft
    token is accepted with this probability instead of by the target (``decode.LoopConfig``)."""

    def __init__(self, target: Target, draft: Draft | None = None, tokenizer: Tokenizer | None = None, *,
                 max_num_seqs: int = 8, max_model_len: int | None = None, num_pages: int | None = None,
                 page_size: int = 16, block_size: int | None = None, chunk_steps: int = 8,
                 steps_per_check: int | None = None, prefill_chunk: int = 512, prefill_rows: int = 8,
                 max_waiting: int = 1024, impl: str = "auto", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, top_k_cap: int = 64, max_logprobs: int = 20,
                 accept_replay: float | None = None):
        config = target.config
        for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size), ("chunk_steps", chunk_steps),
                            ("prefill_chunk", prefill_chunk), ("prefill_rows", prefill_rows),
                            ("max_waiting", max_waiting), ("top_k_cap", top_k_cap)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_page_size(config, page_size)
        if draft is not None:
            draft.config.check_target(config)
            block_size = draft.config.block_size if block_size is None else block_size
            if draft.tensor_parallel != target.tensor_parallel:
                raise ValueError("the draft and the target must be on the same mesh")
        elif block_size not in (None, 1):
            raise ValueError("block_size needs a draft")
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        if accept_replay is not None and (draft is None or not 0 <= accept_replay <= 1):
            raise ValueError(f"accept_replay needs a draft and a probability in [0, 1], got {accept_replay}")
        self.config = LoopConfig(target=config, draft=None if draft is None else draft.config,
                                 block_size=1 if block_size is None else block_size, impl=impl,
                                 accept_replay=accept_replay is not None, tensor_parallel=target.tensor_parallel)
        self._replay_alpha = None if accept_replay is None else replicated(jnp.float32(accept_replay),
                                                                         target.tensor_parallel)
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
        self.num_pages = num_pages or self._default_num_pages(max_num_seqs * self.pages_per_seq)
        self.chunk_steps = chunk_steps
        self.steps_per_check = steps_per_check or default_steps_per_check(chunk_steps)
        self.prefill_chunk = min(bucket(prefill_chunk, per_doubling=1), bucket(self.max_model_len, per_doubling=1))
        self.prefill_rows, self.max_waiting, self.top_k_cap = prefill_rows, max_waiting, top_k_cap
        if not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        self.eos_ids = list(stop_token_ids if stop_token_ids is not None
                            else (tokenizer.stop_token_ids if tokenizer is not None else []))
        self._key = jax.random.key(seed)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._owners: list[Request | None] = [None] * max_num_seqs
        self._free_pages = list(range(self.num_pages))
        self._promised = 0
        self._in_flight: tuple | None = None     # the chunk dispatched and not yet delivered
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self.stats = EngineStats(accepted_per_position=[0] * max(self.config.block_size - 1, 0))
        self._state = self._empty_state()

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
        if self._pages_for(len(prompt_ids), params.max_tokens) > self.num_pages:
            raise ValueError(f"the request needs {self._pages_for(len(prompt_ids), params.max_tokens)} pages of "
                             f"{self.page_size} tokens, more than the engine's {self.num_pages}")

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
        with self._lock:
            if not self._accepting:
                raise QueueFullError("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"the queue is full ({self.max_waiting} waiting requests)")
            self._waiting.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (it finishes with "abort" and frees its pages at the next step)."""
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    @property
    def accepting(self) -> bool:
        """False once ``stop`` was called: new requests are refused."""
        return self._accepting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._owners)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free_pages)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.num_running > 0 or self._in_flight is not None

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One engine step: settle cancellations, admit, one prefill chunk, dispatch a decode
        chunk and deliver the previous one's tokens. False when there was nothing to do."""
        try:
            with self._lock:
                self._settle_cancelled()
                self._admit()
            if not self.has_work():
                return False
            prefilled = self._prefill()
            chunk = self._dispatch_chunk()
            if prefilled is not None:
                self._deliver_first(*prefilled)
            previous, self._in_flight = self._in_flight, chunk
            if previous is not None:
                self._deliver(*previous)
        except Exception as error:  # noqa: BLE001 - every in-flight request learns of it, then it is raised
            self._fail_all(f"{type(error).__name__}: {error}")
            raise
        return True

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
                for request in list(self._waiting) + [r for r in self._owners if r is not None]:
                    request.cancelled = True
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    # ------------------------------------------------------------------ internals

    def _pages_for(self, prompt_len: int, max_tokens: int) -> int:
        """Pages a request may touch: its prompt, its tokens and the last block's scratch."""
        return math.ceil((prompt_len + max_tokens + self.config.block_size) / self.page_size)

    def _default_num_pages(self, every_slot: int) -> int:
        """Pages for every slot at max_model_len, or as many as 90% of the device's free memory
        holds when that is fewer (at least one request of max_model_len, else ValueError)."""
        free = device_free_bytes()
        if free is None:
            return every_slot
        draft_model = None if self.draft is None else self.draft.config.model
        table = jax.ShapeDtypeStruct((self.slots, self.pages_per_seq), jnp.int32)
        sized = [cache_bytes_per_device(jax.eval_shape(
            lambda t, n=n: zeroed_cache(t, self.target.config, draft_model, n, self.page_size,
                                        self.target.params.embed.dtype, None), table), self.target.tensor_parallel)
            for n in (1, 2)]
        per_page, fixed = sized[1] - sized[0], 2 * sized[0] - sized[1]
        fits = int((0.9 * free - fixed) // per_page)
        if fits < self.pages_per_seq:
            raise ValueError(f"the device has {free / 2**30:.2f} GiB free beside the weights: not even one request "
                             f"of max_model_len {self.max_model_len} fits ({self.pages_per_seq} pages of "
                             f"{per_page / 2**20:.2f} MiB): lower max_model_len")
        if fits < every_slot:
            log.warning("KV pool: %d pages (%d tokens) fit in 90%% of the free device memory, fewer than %d slots x "
                        "max_model_len %d; requests wait for pages (lower max_model_len or max_num_seqs, or give "
                        "num_pages)", fits, fits * self.page_size, self.slots, self.max_model_len)
        return min(fits, every_slot)

    def _empty_state(self) -> DecodeState:
        """Every slot free: sentinel page rows, done, greedy defaults."""
        b, tp = self.slots, self.target.tensor_parallel
        width = self.chunk_steps * self.config.block_size
        table = np.full((b, self.pages_per_seq), self.num_pages, np.int32)
        draft_model = None if self.draft is None else self.draft.config.model
        cache = zeroed_cache(jnp.asarray(table), self.target.config, draft_model, self.num_pages, self.page_size,
                              self.target.params.embed.dtype, tp)
        check_cache_fits(jax.eval_shape(lambda: cache), tp)
        sampling = SamplingRows.stack([SamplingConfig()] * b)
        rest = dict(tokens=jnp.zeros((b, self.max_model_len + 2 * width + 1), jnp.int32),
                    num_generated=jnp.zeros((b,), jnp.int32), last_token=jnp.zeros((b,), jnp.int32),
                    done=jnp.ones((b,), bool), max_new_tokens=jnp.ones((b,), jnp.int32),
                    stop_tokens=jnp.full((b, MAX_STOP_TOKEN_IDS + len(self.eos_ids)), -1, jnp.int32),
                    sampling=sampling, steps=jnp.zeros((b,), jnp.int32),
                    accept_lengths=jnp.zeros((b, self.max_model_len + 2 * self.chunk_steps), jnp.int32),
                    key=jax.random.split(self._key, b), iteration=jnp.zeros((), jnp.int32))
        return DecodeState(cache=cache, **replicated(rest, tp))

    def _settle_cancelled(self) -> None:
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "abort")
        for request in [r for r in self._owners if r is not None and r.cancelled]:
            self._finish(request, "abort")

    def _admit(self) -> None:
        """Waiting requests into free slots, first come first served, while their worst case
        fits the pages not promised yet."""
        free = [s for s, owner in enumerate(self._owners) if owner is None]
        admitted = []
        while self._waiting and free:
            request = self._waiting[0]
            need = self._pages_for(len(request.prompt_ids), request.params.max_tokens)
            if self._promised + need > self.num_pages:
                break
            self._waiting.popleft()
            request.slot, request.promised_pages = free.pop(0), need
            self._promised += need
            self._owners[request.slot] = request
            admitted.append(request)
        if not admitted:
            return
        self._grow_pages(admitted, {r: len(r.prompt_ids) for r in admitted})
        self._admit_on_device(admitted)

    def _admit_on_device(self, admitted: list[Request]) -> None:
        """``admit_slots`` for the admitted requests, padded to one row per slot (rows past them
        write nothing): one program whatever the number admitted."""
        pad = self.slots - len(admitted)
        settings = [r.params.sampling for r in admitted] + [SamplingConfig()] * pad
        keys = jnp.stack([self._request_key(r) for r in admitted] + [self._key] * pad)
        stops = np.full((self.slots, self._state.stop_tokens.shape[1]), -1, np.int32)
        for row, request in enumerate(admitted):
            ids = list(request.params.stop_token_ids) + ([] if request.params.ignore_eos else self.eos_ids)
            stops[row, :len(ids)] = ids
        inputs = (self._slot_rows(admitted), self._page_rows(admitted),
                  jnp.asarray([r.params.max_tokens for r in admitted] + [0] * pad, jnp.int32), jnp.asarray(stops),
                  SamplingRows.stack(settings), keys)
        self._state = self._with_statics(admit_slots(self._state, *replicated(inputs, self.target.tensor_parallel)))

    def _set_pages_on_device(self, grown: list[Request]) -> None:
        """``set_page_rows`` for the requests that grew, padded to one row per slot."""
        self._state = set_page_rows(self._state, *replicated((self._slot_rows(grown), self._page_rows(grown)),
                                                             self.target.tensor_parallel))

    def _request_key(self, request: Request) -> jax.Array:
        seed = request.params.seed
        key = jax.random.fold_in(self._key, request.number) if seed is None else jax.random.key(seed)
        return jax.random.fold_in(key, request.params.sample_index)

    def _with_statics(self, state: DecodeState) -> DecodeState:
        """The state's static choices for the requests holding slots: greedy when all are; the
        top-k candidates capped at ``top_k_cap`` (one compiled variant for any top-k); the
        log-probability buffers while one asks for them."""
        live = [r for r in self._owners if r is not None]
        statics = SamplingRows.statics([r.params.sampling for r in live], top_k_cap=self.top_k_cap)
        state = state.replace(sampling=dataclasses.replace(state.sampling, **statics))
        wanted = any(r.params.logprobs is not None for r in live)
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

    def _grow_pages(self, requests: list[Request], positions: dict[Request, int]) -> list[Request]:
        """Give each request pages for ``positions[request]`` positions (capped by its promise);
        return those that got new pages."""
        grown = []
        for request in requests:
            want = min(math.ceil(positions[request] / self.page_size), request.promised_pages)
            if want > len(request.pages):
                request.pages += [self._free_pages.pop() for _ in range(want - len(request.pages))]
                grown.append(request)
        return grown

    def _prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(rows, tokens) of a prefill call: rows a power of two, tokens a power of four from 16 up
        to ``prefill_chunk`` (few shapes to compile; short remainders pad at most 4x)."""
        chunk = 16
        while chunk < min(longest, self.prefill_chunk):
            chunk *= 4
        return bucket(rows, per_doubling=1), min(chunk, self.prefill_chunk)

    def _prefill(self) -> tuple[PrefillOutput, list[Request]] | None:
        """Dispatch one chunk of prompt tokens for up to ``prefill_rows`` requests still
        prefilling; returns its output and the requests whose prompt it ends."""
        rows = [r for r in self._owners if r is not None and not r.decoding][:self.prefill_rows]
        if not rows:
            return None
        count, chunk = self._prefill_shape(len(rows), max(len(r.prompt_ids) - r.prefilled for r in rows))
        tokens = np.zeros((count, chunk), np.int32)
        slots = np.full((count,), self.slots, np.int32)          # padding rows: out of range, write nothing
        lens = np.zeros((count,), np.int32)
        for row, request in enumerate(rows):
            piece = request.prompt_ids[request.prefilled:request.prefilled + chunk]
            tokens[row, :len(piece)] = piece
            slots[row], lens[row] = request.slot, len(request.prompt_ids)
        self._state, output = self._prefill_call(slots, tokens, lens)
        jax.tree.map(lambda x: x.copy_to_host_async(), output)
        for request in rows:
            request.prefilled = min(len(request.prompt_ids), request.prefilled + chunk)
            self.stats.prompt_tokens += 0 if request.prefilled < len(request.prompt_ids) else len(request.prompt_ids)
        return output, rows

    def _prefill_call(self, slots: np.ndarray, tokens: np.ndarray, lens: np.ndarray):
        return prefill_slots(self.target.params, None if self.draft is None else self.draft.params, self._state,
                             *replicated((jnp.asarray(slots), jnp.asarray(tokens), jnp.asarray(lens)),
                                         self.target.tensor_parallel), config=self.config)

    def _deliver_first(self, output: PrefillOutput, rows: list[Request]) -> None:
        """The first token of each request whose prompt the prefill chunk ended (time to first
        token: the prefill, not a decode chunk after it)."""
        out = _on_host(output)
        now = time.monotonic()
        for row, request in enumerate(rows):
            if not request.decoding or request.delivered or request.finished:
                continue
            token = int(out.first[row])
            if request.params.logprobs is not None and out.logprobs is not None:
                k = request.params.logprobs
                request.pending_logprobs = [TokenLogprob(token, float(out.logprobs.chosen[row, 0]), tuple(zip(
                    out.logprobs.top_ids[row, 0, :k].tolist(), out.logprobs.top_values[row, 0, :k].tolist())))]
            request.delivered, request.first_token_time = 1, now
            reason = None
            if out.done[row]:
                reason = "stop" if self._stopped_by_token(request, [token]) else "length"
            self._emit(request, [token], [], reason)

    def warmup(self, prompt_lengths: Sequence[int] | None = None) -> int:
        """Compile what the first requests would otherwise wait for: the prefill shapes
        (``_prefill_shape``; padding rows only, which write nothing), the slot updates (admit,
        grow, release) and the greedy decode chunk (every slot free: it returns at once). Returns the number of programs run. Before any
        request is submitted. ``prompt_lengths``: only the shapes prompts of these lengths use
        (a benchmark's fixed lengths); by default every shape."""
        if self.has_work():
            raise RuntimeError("warmup runs before the first request")
        if prompt_lengths is None:
            remainders = {1, 17, 65, 257, 1025, 4097, self.prefill_chunk}
        else:
            remainders = {length - start for length in prompt_lengths for start in range(0, length, self.prefill_chunk)}
        shapes = sorted({self._prefill_shape(rows, longest) for rows in range(1, min(self.prefill_rows, self.slots) + 1)
                         for longest in remainders})
        for rows, chunk in shapes:
            self._state, _ = self._prefill_call(np.full((rows,), self.slots, np.int32),
                                                np.zeros((rows, chunk), np.int32), np.zeros((rows,), np.int32))
        self._admit_on_device([])
        self._set_pages_on_device([])
        self._state = release_slots(self._state, *replicated((jnp.asarray([self.slots], jnp.int32),),
                                                             self.target.tensor_parallel))
        zeros = replicated(jnp.zeros((self.slots,), jnp.int32), self.target.tensor_parallel)
        self._state, _ = engine_chunk(self.target.params, None if self.draft is None else self.draft.params,
                                      self._state, zeros, zeros, self._replay_alpha, config=self.config,
                                      num_steps=self.chunk_steps, steps_per_check=self.steps_per_check)
        jax.block_until_ready(self._state)
        return len(shapes) + 4

    def _dispatch_chunk(self) -> tuple[ChunkOutput, list[Request | None], np.ndarray, np.ndarray] | None:
        """Grow pages for two chunks ahead (the host's counts lag one chunk), then dispatch a
        decode chunk; its window of tokens starts at each slot's delivered count."""
        owners = list(self._owners)
        decoding = [r for r in owners if r is not None and r.decoding]
        if not decoding:
            return None
        ahead = 2 * self.chunk_steps * self.config.block_size + self.config.block_size + 1
        grown = self._grow_pages(decoding, {r: len(r.prompt_ids) + r.delivered + ahead for r in decoding})
        if grown:
            self._set_pages_on_device(grown)
        owners = [r if r is not None and r.decoding else None for r in owners]
        seen = np.asarray([0 if r is None else r.delivered for r in owners], np.int32)
        seen_steps = np.asarray([0 if r is None else len(r.accept_lengths) for r in owners], np.int32)
        self._state, output = engine_chunk(self.target.params, None if self.draft is None else self.draft.params,
                                           self._state, *replicated((jnp.asarray(seen), jnp.asarray(seen_steps)),
                                                                     self.target.tensor_parallel), self._replay_alpha,
                                           config=self.config, num_steps=self.chunk_steps,
                                           steps_per_check=self.steps_per_check)
        jax.tree.map(lambda x: x.copy_to_host_async(), output)
        return output, owners, seen, seen_steps

    def _deliver(self, output: ChunkOutput, owners: list[Request | None], seen: np.ndarray,
                 seen_steps: np.ndarray) -> None:
        """Read a chunk's windows: new tokens and acceptance lengths to each request that still
        owns its slot; finish those done (on the device, or by a stop string)."""
        out = _on_host(output)
        now = time.monotonic()
        for slot, request in enumerate(owners):
            if request is None or request.finished:
                continue
            count = int(out.num_generated[slot])
            new = out.tokens[slot, request.delivered - seen[slot]:count - seen[slot]].tolist()
            steps = out.accept_lengths[slot, len(request.accept_lengths) - seen_steps[slot]:
                                       int(out.steps[slot]) - seen_steps[slot]].tolist()
            if request.params.logprobs is not None and out.logprobs is not None:
                span = slice(request.delivered - seen[slot], count - seen[slot])
                k = request.params.logprobs
                request.pending_logprobs = [
                    TokenLogprob(t, float(c), tuple(zip(ids[:k].tolist(), values[:k].tolist())))
                    for t, c, values, ids in zip(new, out.logprobs.chosen[slot, span],
                                                 out.logprobs.top_values[slot, span], out.logprobs.top_ids[slot, span])]
            request.delivered = count
            if new and request.first_token_time is None:
                request.first_token_time = now
            self._count_steps(steps)
            reason = None
            if out.done[slot]:
                reason = "length" if count >= request.params.max_tokens and not self._stopped_by_token(request, new) \
                    else "stop"
            self._emit(request, new, steps, reason)

    def _stopped_by_token(self, request: Request, new: list[int]) -> bool:
        ids = set(request.params.stop_token_ids) | (set() if request.params.ignore_eos else set(self.eos_ids))
        return bool(new) and new[-1] in ids

    def _count_steps(self, steps: list[int]) -> None:
        if self.draft is None:
            return
        for emitted in steps:
            accepted = max(emitted - 1, 0)
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += self.config.block_size - 1
            self.stats.num_accepted_tokens += accepted
            for position in range(accepted):
                self.stats.accepted_per_position[position] += 1

    def _emit(self, request: Request, new: list[int], steps: list[int], reason: str | None) -> None:
        """Deliver new tokens with their text. A stop token's text is not output; a stop string
        cuts the text before it and the tokens after the one that completes it, and finishes
        the request."""
        before = len(request.token_ids)
        request.token_ids += new
        request.accept_lengths += steps
        logprobs, request.pending_logprobs = request.pending_logprobs, []
        text_out = ""
        if request.stream is not None:
            by_token = reason == "stop" and self._stopped_by_token(request, new)
            shown = request.token_ids[:-1] if by_token else request.token_ids
            request.text += request.stream.update(shown, final=reason is not None)
            found = _first_stop(request.text, request.params.stop, request.sent_text)
            if found is not None:
                start, end = found
                kept = self._tokens_through(request.token_ids, end, before)
                new, logprobs = new[:kept - before], logprobs[:kept - before]
                request.token_ids, request.text, reason = request.token_ids[:kept], request.text[:start], "stop"
            hold = 0 if reason is not None else _stop_prefix_length(request.text, request.params.stop)
            text_out = request.text[request.sent_text:len(request.text) - hold]
            request.sent_text += len(text_out)
        request.logprobs += logprobs
        logprobs = logprobs if request.params.logprobs is not None else None
        self.stats.generation_tokens += len(new)
        if reason is None:
            if new or text_out:
                request.on_output(RequestOutput(request.id, text_out, new, steps, logprobs=logprobs))
            return
        self._finish(request, reason, text_out, new, steps, logprobs=logprobs)

    def _tokens_through(self, token_ids: list[int], end: int, sent: int) -> int:
        """The fewest tokens (more than ``sent``, those already delivered) whose text reaches
        character ``end``: the tokens through the one that completes a stop string."""
        low, high = sent + 1, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if len(self.tokenizer.decode(token_ids[:middle]).rstrip("\ufffd")) >= end:
                high = middle
            else:
                low = middle + 1
        return high

    def _finish(self, request: Request, reason: str, text: str = "", new: list[int] | None = None,
                steps: list[int] | None = None, error: str | None = None,
                logprobs: list[TokenLogprob] | None = None, release: bool = True) -> None:
        """Free the request's slot and pages (on the device too, unless the state was just
        rebuilt) and send its last output."""
        if request.slot is not None:
            slot, self._owners[request.slot] = request.slot, None
            self._free_pages += request.pages
            self._promised -= request.promised_pages
            request.pages, request.promised_pages, request.slot = [], 0, None
            if release:
                self._state = self._with_statics(release_slots(self._state, jnp.asarray([slot], jnp.int32)))
        request.finish_reason, request.finish_time = reason, time.monotonic()
        self.stats.requests_finished += 1
        if logprobs is None and request.params.logprobs is not None:
            logprobs = []
        request.on_output(RequestOutput(request.id, text, new or [], steps or [], finished=True,
                                        finish_reason=reason, error=error, logprobs=logprobs))

    def _fail_all(self, message: str) -> None:
        """After a failed step: the device state rebuilt (a failed call may have consumed its
        donated buffers), every request holding a slot finished with "abort" and ``message``;
        the waiting ones stay queued."""
        self._in_flight = None
        self._state = None                      # its buffers go before new ones are made
        self._state = self._empty_state()
        for request in [r for r in self._owners if r is not None]:
            self._finish(request, "abort", error=message, release=False)


def _on_host(tree):
    """A tree of replicated device arrays as numpy (any local device's copy: several processes
    each read their own)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _first_stop(text: str, stops: tuple[str, ...], sent: int) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text`` (searched from where it could first
    appear unsent), or None."""
    found = [(i, i + len(s)) for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
    return min(found) if found else None


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (held back when
    streaming: the next tokens may complete it)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)

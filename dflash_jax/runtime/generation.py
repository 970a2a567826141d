"""The library's ``generate()``: a batch of token-id prompts through the serving engine.

``generate`` builds an ``Engine`` sized for the batch and drives it with ``run_requests``, the
one loop over engine steps that the command line shares; the jitted programs are the engine's
(``decode.prefill_slots``, ``decode.engine_chunk``), the ones the server runs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from dflash_jax.loading.models import Draft, Target
from dflash_jax.loading.tokenizer import Tokenizer
from dflash_jax.model.config import ModelConfig
from dflash_jax.runtime.decode import bucket
from dflash_jax.runtime.engine import (MAX_STOP_TOKEN_IDS, PREFILL_CHUNK, Engine, Request, RequestOutput,
                                       RequestParams, compile_seconds)
from dflash_jax.runtime.sampling import SamplingConfig
from pallas_kernels.sizes import next_power_of_2


PREFILL_TOKENS = 16384   # prompt tokens a batch engine's step prefills, at most (bounds the activations)


@dataclasses.dataclass
class GenerationStats:
    """Per-sequence acceptance lengths (tokens emitted per step, bonus included, as the paper
    counts τ) and timings. Compile time is measured apart and excluded from the others."""

    accept_lengths: list[list[int]]
    new_tokens: list[int]
    block_size: int
    compile_seconds: float
    prefill_seconds: float         # to the first token of the batch
    decode_seconds: float          # from it to the last
    # per sequence: "stop" (ended at a stop token) or "length" (cut at its max_new_tokens)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [len(a) for a in self.accept_lengths]

    @property
    def tau(self) -> float:
        """Mean tokens per speculation step over all sequences."""
        flat = [n for seq in self.accept_lengths for n in seq]
        return float(np.mean(flat)) if flat else float("nan")

    def tau_per_sequence(self) -> list[float]:
        return [float(np.mean(a)) if a else float("nan") for a in self.accept_lengths]

    def histogram(self) -> list[int]:
        """counts[k-1] = steps that emitted k tokens, k = 1..block_size."""
        counts = np.zeros(self.block_size, np.int64)
        for seq in self.accept_lengths:
            for n in seq:
                counts[n - 1] += 1
        return counts.tolist()

    def position_acceptance(self) -> list[float]:
        """rate[i-1] = fraction of steps whose draft token i (1..block-1) was accepted. Steps cut
        short by a stop token or max_new_tokens count as rejections from the cut on."""
        flat = np.array([n for seq in self.accept_lengths for n in seq])
        if flat.size == 0:
            return []
        return [float(np.mean(flat > i)) for i in range(1, self.block_size)]

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens emitted after the first one, over the decode time (NaN when
        none was: max_new_tokens 1, or every sequence stopped at its first token)."""
        decoded = sum(self.new_tokens) - len(self.new_tokens)
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else float("nan")

    def speedup_over(self, baseline: GenerationStats) -> float | None:
        """Decode tok/s over ``baseline``'s; None when either decoded nothing."""
        ours, theirs = self.tokens_per_second, baseline.tokens_per_second
        return None if math.isnan(ours) or math.isnan(theirs) else ours / theirs

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    def summary(self) -> dict:
        """The statistics as JSON values; tau and tok/s are None when undefined (no step taken,
        nothing decoded after the first token)."""
        defined = lambda x: None if math.isnan(x) else x  # noqa: E731
        return {"tau": defined(self.tau), "steps": self.steps,
                "new_tokens": self.new_tokens, "histogram": self.histogram(),
                "position_acceptance": self.position_acceptance(),
                "tokens_per_second": defined(self.tokens_per_second), "time_to_first_token": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "compile_seconds": self.compile_seconds,
                "finish_reasons": self.finish_reasons}


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]        # new tokens per sequence (stop token included when hit)
    stats: GenerationStats
    texts: list[str] | None = None  # the detokenized tokens (stop tokens left out), with a tokenizer


def _per_sequence(value, batch: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries for {batch} prompts")
        return list(value)
    return [value] * batch


def _integers(values, name: str) -> list[int]:
    """``values`` (a sequence or array of integers) as ints; ValueError naming ``name`` otherwise
    (floats would be truncated silently)."""
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    return array.tolist()


def _stop_lists(stop_token_ids, batch: int, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """(stop ids of every row, each row's own) from None, one id, one list for every row or a list
    per row (lists, tuples or arrays); ids outside the vocabulary are named in a warning and left
    out (they never stop)."""
    def scalar(x) -> bool:  # a number, numpy's and jax's 0-d arrays included
        return isinstance(x, numbers.Number) or getattr(x, "ndim", None) == 0

    if stop_token_ids is None:
        return [], [[] for _ in range(batch)]
    items = [stop_token_ids] if scalar(stop_token_ids) else list(stop_token_ids)
    if all(scalar(item) for item in items):  # one list for every row
        return in_vocabulary(_integers(items, "stop_token_ids"), vocab_size), [[] for _ in range(batch)]
    rows = [_integers(row, f"stop_token_ids[{i}]") for i, row in enumerate(_per_sequence(items, batch, "stop_token_ids"))]
    in_vocabulary([t for row in rows for t in row], vocab_size)
    rows = [[t for t in row if 0 <= t < vocab_size] for row in rows]
    for i, row in enumerate(rows):
        if len(set(row)) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids[{i}] has {len(set(row))} ids: a row may have at most "
                             f"{MAX_STOP_TOKEN_IDS} of its own (ids for every row have no limit)")
    return [], [sorted(set(row)) for row in rows]


def in_vocabulary(stop_ids: Sequence[int], vocab_size: int, source: str = "") -> list[int]:
    """The stop ids that a sequence can emit; a warning (prefixed ``source``) names the others."""
    outside = sorted({t for t in stop_ids if not 0 <= t < vocab_size})
    if outside:
        warnings.warn(f"{source}stop token id(s) {outside} lie outside the vocabulary ({vocab_size} tokens) and "
                      "can never stop a sequence", stacklevel=2)
    return [t for t in stop_ids if 0 <= t < vocab_size]


def check_prompts(config: ModelConfig, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int | Sequence[int], names: Sequence[str] | None = None) -> list[int]:
    """Each row's max_new_tokens, after checking that the prompts are non-empty token ids of the
    target's vocabulary and fit its positions with their new tokens (ValueError naming the
    prompt: as ``names`` has it, else ``prompt i``); needs only the target's config, so a CLI can
    check before loading weights."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    names = names or [f"prompt {i}" for i in range(len(prompts))]
    vocab, limit = config.vocab_size, config.max_position_embeddings
    max_new = _integers(_per_sequence(max_new_tokens, len(prompts), "max_new_tokens"), "max_new_tokens")
    if min(max_new) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    for name, prompt, m in zip(names, prompts, max_new, strict=True):
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        ids = _integers(prompt, name)
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab})")
        n = len(prompt)
        if n + m > limit:
            fits = f"at most {limit - n} new tokens fit after it" if n < limit else "the prompt alone is too long"
            raise ValueError(f"{name} has {n} tokens: with max_new_tokens {m} it needs {n + m} positions, "
                             f"more than the target's max_position_embeddings {limit} ({fits})")
    return max_new


def check_seed(seed) -> None:
    """ValueError unless ``seed`` is an int in [0, 2**32): jax.random.key takes it modulo 2**32,
    so any other value would silently repeat another seed's samples."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def batch_engine(target: Target, draft: Draft | None, prompt_lengths: Sequence[int], max_new_tokens: Sequence[int],
                 *, max_num_seqs: int | None = None, tokenizer: Tokenizer | None = None, **engine_options) -> Engine:
    """An engine for a known batch: slots for every prompt (or ``max_num_seqs``) and a context
    for the longest prompt with the most new tokens, both rounded up (a power of two of slots;
    positions to one of four sizes per doubling, at most a quarter more) so that nearby batches
    run the same compiled programs; its queue holds the whole batch, and each step prefills up
    to ``PREFILL_TOKENS`` prompt tokens (a large batch of short prompts starts decoding in a few
    steps: a call holds more rows of short prompts than of whole chunks)."""
    slots = next_power_of_2(len(prompt_lengths))
    if max_num_seqs is not None:
        slots = min(slots, max_num_seqs)
    needed = max(prompt_lengths) + max(max_new_tokens)
    max_model_len = min(bucket(needed, per_doubling=4), target.config.max_position_embeddings)
    chunk = min(next_power_of_2(engine_options.get("prefill_chunk", PREFILL_CHUNK)), next_power_of_2(max_model_len))
    prefill_rows = min(slots, max(8, PREFILL_TOKENS // chunk))   # a call's rows of whole chunks; shorter pack more
    return Engine(target, draft, tokenizer, max_num_seqs=slots, max_model_len=max_model_len,
                  max_waiting=max(len(prompt_lengths), 1), prefill_rows=prefill_rows, **engine_options)


def run_requests(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[RequestParams], *,
                 on_output: Callable[[int, Request, RequestOutput], None] | None = None,
                 on_step: Callable[[list[Request]], None] | None = None) -> tuple[list[Request], GenerationStats]:
    """Submit every prompt with its settings and step the engine until all are done: the loop
    that ``generate`` and the command line share. ``on_output(index, request, output)`` gets
    each request's outputs (from inside the step); ``on_step(requests)`` runs between steps (the
    command line stops there on Ctrl-C). Timings leave out the compiles that happened meanwhile and
    the callbacks' time.

    Every engine step runs a prompt chunk or a decode chunk (which emits a token for every
    decoding request) for some request, so the prompts and max_tokens bound the steps: a run past
    the bound is a bug, reported rather than run for ever."""
    start = time.monotonic()
    requests, errors, in_callbacks = [], {}, []   # in_callbacks: (when one ended, its seconds)

    def timed(callback, *args) -> None:
        began = time.monotonic()
        callback(*args)
        ended = time.monotonic()
        in_callbacks.append((ended, ended - began))

    def deliver(index: int, output: RequestOutput) -> None:
        if output.error is not None:
            errors.setdefault(index, output.error)
        if on_output is not None:
            timed(on_output, index, requests[index], output)

    for index, (prompt, setting) in enumerate(zip(prompts, params, strict=True)):
        requests.append(engine.submit(prompt, setting, on_output=lambda output, i=index: deliver(i, output)))
    bound = 2 + sum(-(-len(r.prompt_ids) // engine.prefill_chunk) + -(-r.params.max_tokens // engine.chunk_steps) + 2
                    for r in requests)
    for _ in range(bound):
        if not engine.step():
            break
        if on_step is not None:
            timed(on_step, requests)
    else:
        unfinished = [i for i, r in enumerate(requests) if r.finish_reason is None]
        raise RuntimeError(f"prompts {unfinished} were not done after {bound} engine steps, more than their prompts "
                           "and max_tokens need (a bug)")
    end = time.monotonic()
    if errors:
        index, error = min(errors.items())
        raise RuntimeError(f"prompt {index} failed: {error}")

    def busy(since: float, until: float) -> float:
        """Seconds compiling or in callbacks between two ``time.monotonic()`` readings."""
        return compile_seconds(since, until) + sum(s for when, s in in_callbacks if since <= when <= until)

    first = min(r.first_token_time for r in requests)
    stats = GenerationStats(accept_lengths=[r.accept_lengths for r in requests],
                            new_tokens=[len(r.token_ids) for r in requests], block_size=engine.config.block_size,
                            compile_seconds=compile_seconds(start, end),
                            prefill_seconds=first - start - busy(start, first),
                            decode_seconds=end - first - busy(first, end),
                            finish_reasons=[r.finish_reason for r in requests])
    return requests, stats


def generate(target: Target, prompts: Sequence[Sequence[int]], *, draft: Draft | None = None,
             max_new_tokens: int | Sequence[int] = 128, sampling: SamplingConfig | None = None,
             stop_token_ids: int | Sequence[int] | Sequence[Sequence[int]] | None = None,
             block_size: int | None = None, page_size: int = 16, num_pages: int | None = None,
             seed: int = 0, impl: str = "auto", chunk_steps: int = 8, steps_per_check: int | None = None,
             max_num_seqs: int | None = None, tokenizer: Tokenizer | None = None,
             on_output: Callable[[int, Request, RequestOutput], None] | None = None,
             on_chunk: Callable[[list[list[int]]], None] | None = None,
             on_step: Callable[[], None] | None = None, accept_replay: float | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths, on the serving engine.

    With ``draft`` it runs DFlash speculative decoding (block size = the draft's unless
    ``block_size`` is given); without, plain autoregressive decoding. Greedy output is the same
    either way; sampled output is exact in distribution, each prompt ``i`` drawn from ``seed``
    and ``i`` (as the command line and the server's ``seed`` draw). ``max_new_tokens`` may be
    per sequence; ``stop_token_ids`` one id, one list for every sequence or a list per sequence
    (a sequence ends at the first it emits, which is kept in its tokens). Every prompt runs at
    once unless ``max_num_seqs`` caps the slots (the rest wait for one). ``chunk_steps`` decode
    steps run on the device between host reads; inside a chunk the loop looks for finished
    rows every ``steps_per_check`` steps (``decode.default_steps_per_check``; the output is the
    same for any value, only speed changes). ``impl`` picks kernels or references
    (``dflash_jax.model.ops``). ``tokenizer``: the results carry text too.

    Callbacks: ``on_output(index, request, output)`` per request output (``Engine.submit``);
    ``on_chunk(tokens)`` every sequence's tokens so far, after each engine step that produced
    some; ``on_step()`` between engine steps. ``accept_replay`` is a benchmark-only override of
    the accept decision (each draft accepted with that probability).
    """
    sampling = sampling or SamplingConfig()
    check_seed(seed)
    max_new = check_prompts(target.config, prompts, max_new_tokens)
    if draft is not None:
        draft.config.check_target(target.config)
    if draft is not None and draft.params.fc.dtype != target.params.embed.dtype:
        raise ValueError(f"the draft's weights are {draft.params.fc.dtype} and the target's "
                         f"{target.params.embed.dtype}: load both in one dtype (their K/V share one cache)")
    if accept_replay is not None and draft is None:
        raise ValueError("accept_replay replays the acceptance of a draft's proposals: it needs a draft")
    if accept_replay is not None and not 0 <= accept_replay <= 1:
        raise ValueError(f"accept_replay (an acceptance probability) must be in [0, 1], got {accept_replay}")
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    common_stops, own_stops = _stop_lists(stop_token_ids, len(prompts), target.config.vocab_size)
    engine = batch_engine(target, draft, [len(p) for p in prompts], max_new, max_num_seqs=max_num_seqs,
                          tokenizer=tokenizer, num_pages=num_pages, page_size=page_size, block_size=block_size,
                          chunk_steps=chunk_steps, steps_per_check=steps_per_check, impl=impl,
                          stop_token_ids=common_stops, top_k_cap=max(sampling.top_k, 1), seed=seed,
                          accept_replay=accept_replay)
    params = [RequestParams(max_tokens=m, sampling=sampling, seed=seed, sample_index=i, stop_token_ids=tuple(stops))
              for i, (m, stops) in enumerate(zip(max_new, own_stops))]
    delivered = 0

    def between_steps(requests: list[Request]) -> None:
        nonlocal delivered
        if on_chunk is not None and (count := sum(len(r.token_ids) for r in requests)) != delivered:
            delivered = count
            on_chunk([list(r.token_ids) for r in requests])
        if on_step is not None:
            on_step()

    try:
        done, stats = run_requests(engine, prompts, params, on_output=on_output, on_step=between_steps)
    finally:
        engine.close()
    return GenerationResult(tokens=[r.token_ids for r in done], stats=stats,
                            texts=None if tokenizer is None else [r.text for r in done])

"""Delivering what the device made: each request's new tokens and acceptance lengths, their text
(detokenized as the tokenizer decodes the whole; cut at a stop string, held back while it may
still become one), stop tokens, log-probabilities; finishing requests; the engine's counters."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from dflash_jax.loading.tokenizer import Tokenizer
from dflash_jax.runtime.decode import ChunkOutput, PrefillOutput
from dflash_jax.runtime.engine.device import DispatchedChunk
from dflash_jax.runtime.engine.request import Request, RequestOutput, TokenLogprob

ACCEPTANCE_PRIOR = 0.75   # a draft position's acceptance assumed before the engine has seen any
PRIOR_WEIGHT = 16.0       # steps of evidence that prior is worth


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (spec-decode and prefix-cache ones named as vLLM's
    metrics). prompt_tokens: the prompt tokens of requests whose prefill ended (cached or run);
    prefill_tokens_computed: prompt tokens prefill ran (a cached prefix's are not run);
    prefix_cache_queries: prompt tokens of the requests admitted with prefix caching on;
    prefix_cache_hits: those of them found in the prefix cache."""

    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0           # draft tokens verified
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    verified_per_position: list[int] = dataclasses.field(default_factory=list)
    reached_per_position: list[int] = dataclasses.field(default_factory=list)   # verified, all before accepted


class OutputProcessor:
    """Turns the device's outputs (read on the host) into each request's ``RequestOutput``s.
    ``eos_ids``: the model's end-of-sequence tokens; ``draft_tokens``: a DFlash step's draft
    tokens (None without a draft); ``release``: gives a finishing request's slot back."""

    def __init__(self, tokenizer: Tokenizer | None, eos_ids: list[int], stats: EngineStats, *,
                 draft_tokens: int | None, release: Callable[[Request], None]):
        self.tokenizer, self.eos_ids, self.stats = tokenizer, eos_ids, stats
        self.draft_tokens, self.release = draft_tokens, release
        if draft_tokens is not None and not stats.reached_per_position:
            stats.reached_per_position = [0] * draft_tokens

    def acceptance_prior(self, prior: float = ACCEPTANCE_PRIOR, weight: float = PRIOR_WEIGHT) -> np.ndarray:
        """[draft_tokens] the chance, at each draft position, that its token is accepted when all
        before it were: the engine's rates so far, pulled toward ``prior`` by ``weight`` steps
        (a new request's estimate starts here; ``decode.DecodeState.acceptance``)."""
        if self.draft_tokens is None:
            return np.zeros(0, np.float32)
        accepted = np.asarray(self.stats.accepted_per_position, np.float64)
        reached = np.asarray(self.stats.reached_per_position, np.float64)
        return ((accepted + prior * weight) / (reached + weight)).astype(np.float32)

    def first_tokens(self, out: PrefillOutput, rows: list[Request]) -> None:
        """The first token of each request whose prompt the prefill chunk ended (time to first
        token: the prefill, not a decode chunk after it)."""
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
                reason = "stop" if self.stopped_by_token(request, [token]) else "length"
            self.emit(request, [token], [], reason)

    def chunk_tokens(self, out: ChunkOutput, chunk: DispatchedChunk) -> None:
        """A decode chunk's windows: new tokens and acceptance lengths to each request that still
        owns its slot; finish those done (on the device, or by a stop string)."""
        now = time.monotonic()
        seen, seen_steps = chunk.seen, chunk.seen_steps
        for row, request in enumerate(chunk.owners):
            if request is None or request.finished:
                continue
            count = int(out.num_generated[row])
            new = out.tokens[row, request.delivered - seen[row]:count - seen[row]].tolist()
            step_span = slice(len(request.accept_lengths) - seen_steps[row], int(out.steps[row]) - seen_steps[row])
            steps = out.accept_lengths[row, step_span].tolist()
            if request.params.logprobs is not None and out.logprobs is not None:
                span = slice(request.delivered - seen[row], count - seen[row])
                k = request.params.logprobs
                request.pending_logprobs = [
                    TokenLogprob(t, float(c), tuple(zip(ids[:k].tolist(), values[:k].tolist())))
                    for t, c, values, ids in zip(new, out.logprobs.chosen[row, span],
                                                 out.logprobs.top_values[row, span], out.logprobs.top_ids[row, span])]
            request.delivered = count
            if new and request.first_token_time is None:
                request.first_token_time = now
            self._count_steps(steps, out.verified[row, step_span].tolist())
            reason = None
            if out.done[row]:
                reason = "length" if count >= request.params.max_tokens and not self.stopped_by_token(request, new) \
                    else "stop"
            self.emit(request, new, steps, reason)

    def stopped_by_token(self, request: Request, new: list[int]) -> bool:
        ids = set(request.params.stop_token_ids) | (set() if request.params.ignore_eos else set(self.eos_ids))
        return bool(new) and new[-1] in ids

    def _count_steps(self, steps: list[int], verified: list[int]) -> None:
        """Count DFlash steps of ``steps`` emitted tokens each, ``verified`` draft tokens each."""
        if self.draft_tokens is None:
            return
        stats = self.stats
        for emitted, checked in zip(steps, verified):
            accepted = max(emitted - 1, 0)
            stats.num_drafts += 1
            stats.num_draft_tokens += checked
            stats.num_accepted_tokens += accepted
            for position in range(checked):
                stats.verified_per_position[position] += 1
                stats.reached_per_position[position] += position <= accepted
                stats.accepted_per_position[position] += position < accepted

    def emit(self, request: Request, new: list[int], steps: list[int], reason: str | None) -> None:
        """Deliver new tokens with their text. A stop token's text is not output; a stop string
        cuts the text before it and the tokens after the one that completes it, and finishes
        the request."""
        before = len(request.token_ids)
        if request.matcher is not None:
            request.matcher.advance(new)
        request.token_ids += new
        request.accept_lengths += steps
        logprobs, request.pending_logprobs = request.pending_logprobs, []
        text_out = ""
        if request.stream is not None:
            by_token = reason == "stop" and self.stopped_by_token(request, new)
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
        self.finish(request, reason, text_out, new, steps, logprobs=logprobs)

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

    def finish(self, request: Request, reason: str, text: str = "", new: list[int] | None = None,
               steps: list[int] | None = None, error: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> None:
        """Give the request's slot back and send its last output."""
        self.release(request)
        request.finish_reason, request.finish_time = reason, time.monotonic()
        self.stats.requests_finished += 1
        if logprobs is None and request.params.logprobs is not None:
            logprobs = []
        request.on_output(RequestOutput(request.id, text, new or [], steps or [], finished=True,
                                        finish_reason=reason, error=error, logprobs=logprobs))


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

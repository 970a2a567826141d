"""A request: its settings, the outputs it is sent, and its progress through the engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from dflash_jax.loading.tokenizer import TextStream
from dflash_jax.runtime.grammar import GrammarMatcher
from dflash_jax.runtime.sampling import SamplingConfig

MAX_STOP_TOKEN_IDS = 16   # stop token ids a request may give (besides the model's end-of-sequence ids)


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's settings. ``seed`` None draws from the engine's own stream; ``sample_index``
    tells apart the n samples of one prompt under one seed. ``stop``: strings that end the
    output (matched on the text, not included in it); ``stop_token_ids``: tokens that end it
    (included in the tokens, not in the text); ``ignore_eos``: the model's end-of-sequence
    tokens do not stop it; ``grammar``: llguidance's grammar the output must follow (structured
    output, ``grammar.grammar_from_request``), None for free text."""

    max_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    sample_index: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None


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
    page_hashes: list[bytes] | None = None   # chain hashes of the prompt's full pages (prefix caching)
    cached_tokens: int = 0          # prompt tokens found in the prefix cache at admission (not prefilled)
    offered_pages: int = 0          # leading pages offered to the prefix cache (cached, or kept own)
    prefilled: int = 0              # prompt tokens in the cache so far (cached or run)
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
    matcher: GrammarMatcher | None = None   # the grammar's state over the tokens delivered (structured output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.prompt_ids)

"""Structured output: the grammar a request asks for, and per request a matcher that gives the
token masks the engine applies to the target's logits, on the host, in numpy.

The grammar engine is llguidance (Earley parsing over lazily built lexer automata; JSON
schema, regular expressions, Lark and GBNF grammars) rather than xgrammar:

- llguidance ships one abi3 wheel per platform (``cp39-abi3``: any CPython >= 3.10, its
  Requires-Python) with no Python dependencies; xgrammar's wheels are built per CPython version
  (``cp311-cp311``) and it requires torch, transformers, triton, pydantic and apache-tvm-ffi.
- llguidance has a numpy interface (``llguidance.numpy``: masks computed straight into an int32
  array); xgrammar's mask helpers allocate and apply torch tensors (``bitmask_dtype =
  torch.int32``, ``allocate_token_bitmask`` returns a ``torch.Tensor``).
- Its matcher rolls back consumed tokens, which checking a draft block needs, and its
  ``LLExecutor`` computes the masks of many requests' draft blocks on a thread pool without the
  GIL (``walk_batch``).

Masks are bitmasks: int32 words ``[ceil(V / 32)]`` for a model vocabulary of V logits, token t
allowed when ``(mask[t >> 5] >> (t & 31)) & 1`` (``bitmask_to_bool`` expands them, in numpy or
jax). That is the form llguidance writes, and a 32nd of the bytes to send to the device (a DFlash
block of 17 masks of a 152k vocabulary: 323 KB, not 2.6 MB per request)."""

from __future__ import annotations

from typing import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from dflash_jax.loading.tokenizer import Tokenizer


def grammar_from_request(response_format: dict | None = None, guided_regex: str | None = None,
                         guided_grammar: str | None = None) -> str | None:
    """llguidance's grammar for a request's structured-output options, None when it has none.

    ``response_format`` (OpenAI's): ``{"type": "text"}`` (no grammar), ``{"type":
    "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}`` (JSON valid under the schema, whatever ``strict`` says).
    vLLM's ``guided_regex`` (a regular expression, Rust's regex syntax: no lookahead, lookbehind or
    backreferences) and ``guided_grammar`` (a Lark grammar in llguidance's dialect, with a
    ``start`` rule, or a GBNF one, llama.cpp's). At most one of them; ValueError naming the field
    for a malformed option or a grammar llguidance rejects (with its message)."""
    schema = None if response_format is None else _response_format_schema(response_format)
    given = {field: value for field, value in (("response_format", schema), ("guided_regex", guided_regex),
                                               ("guided_grammar", guided_grammar)) if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of response_format, guided_regex and guided_grammar, got "
                         f"{' and '.join(given)}")
    (field, value), = given.items()
    if field == "response_format":
        field = "response_format.json_schema.schema"  # json_object's schema is valid: only a given one fails
        grammar = llguidance.LLMatcher.grammar_from_json_schema(value)
    else:
        if not isinstance(value, str):
            raise ValueError(f"{field} must be a string, got {type(value).__name__}")
        try:
            grammar = llguidance.grammar_from("regex" if field == "guided_regex" else "grammar", value)
        except ValueError as error:  # a GBNF grammar that does not convert to Lark
            raise ValueError(f"{field}: {error}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ValueError(f"{field}: {messages[0].strip()}")
    return grammar


def _response_format_schema(response_format) -> dict | None:
    """The JSON schema a response_format asks for, None for plain text."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ValueError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format.json_schema must be an object with a "schema" object, got '
                         f"{type(spec).__name__}")
    if not isinstance(spec.get("name", ""), str):
        raise ValueError(f"response_format.json_schema.name must be a string, got {spec['name']!r}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ValueError(f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema must be a JSON object, got {type(schema).__name__}")
    return schema


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` for a model of ``vocab_size`` logits: masks have
    ``vocab_size`` bits, the ids past the tokenizer's own (a model's padded embedding rows) never
    allowed, and the tokenizer's stop ids allowed wherever the grammar may end. Building it walks
    the whole vocabulary (seconds for 150k tokens): build one per model, share it."""
    if not tokenizer.stop_token_ids:
        raise ValueError(f"{tokenizer.directory}: the tokenizer has no stop token (eos_token_id), "
                         "so no grammar could end")
    try:
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=tokenizer.stop_token_ids)
    except ValueError as error:  # a model vocabulary smaller than the tokenizer's
        raise ValueError(f"{tokenizer.directory}: no grammar tokenizer for a {vocab_size}-logit model ({error})") from None


def bitmask_width(vocab_size: int) -> int:
    """The int32 words of a mask of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def bitmask_to_bool(bitmask, vocab_size: int):
    """The bool masks ``[..., vocab_size]`` of bitmasks ``[..., ceil(vocab_size / 32)]``, numpy
    or jax arrays alike (the device expands what the host sends)."""
    ids = np.arange(vocab_size, dtype=np.int32)
    return ((bitmask[..., ids >> 5] >> (ids & 31)) & 1).astype(bool)


class GrammarMatcher:
    """One request's grammar state over the tokens it has emitted. The engine asks for the mask
    of the next token (``allowed``), or of each position of a draft block (``walk``), applies it
    to the target's logits, then ``advance``s by the tokens it emitted. A stop token ends the
    text: legal where the grammar may end, nothing after it is checked."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        """``tokenizer`` from ``grammar_tokenizer``, ``grammar`` from ``grammar_from_request``.
        Compiles the grammar's lexer (milliseconds to tens of them for a JSON schema)."""
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"invalid grammar: {self._matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self.width = bitmask_width(self.vocab_size)
        self._stop_ids = frozenset(tokenizer.eos_tokens)

    @property
    def is_finished(self) -> bool:
        """The grammar takes no more tokens but a stop token (or has taken one): the engine may
        end the request."""
        return self._matcher.is_stopped()

    @property
    def accepts_eos(self) -> bool:
        """The text so far is complete under the grammar: a stop token may come next."""
        return self._matcher.is_accepting()

    def allowed(self, into: np.ndarray | None = None) -> np.ndarray:
        """The bitmask int32 ``[width]`` of the tokens allowed next, written into ``into`` when
        given (a C-contiguous int32 ``[width]`` array, a row of a batch's masks)."""
        if into is None:
            into = np.empty(self.width, np.int32)
        elif into.shape != (self.width,) or into.dtype != np.int32 or not into.flags.c_contiguous:
            raise ValueError(f"a mask is a C-contiguous int32 array of shape ({self.width},), got "
                             f"{into.dtype} {into.shape}")
        self._matcher.unsafe_compute_mask_ptr(into.ctypes.data, into.nbytes)
        return into

    def walk(self, draft_tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """The masks of a draft block, int32 ``[k + 1, width]`` for k draft tokens, and how many
        of its tokens the grammar takes in order (``legal``, stopping at the first it rejects, or
        after a stop token). Row i is the mask before draft token i (row k: after the last), for
        i <= legal; the rest, never read, allow every token (no row is all -inf logits). The
        target's masked choice at row ``legal`` cannot be the rejected token, so the tokens it
        accepts are legal. The matcher is left as it was (the walk is rolled back)."""
        draft_tokens = self._checked_ids(draft_tokens)
        masks = np.full((len(draft_tokens) + 1, self.width), -1, np.int32)
        self.allowed(into=masks[0])
        legal = consumed = 0
        while legal < len(draft_tokens) and _allows(masks[legal], draft_tokens[legal]):
            token = draft_tokens[legal]
            legal += 1
            if token in self._stop_ids:
                break
            self._consume(token)
            consumed += 1
            self.allowed(into=masks[legal])
        self._matcher.rollback(consumed)
        return masks, legal

    def advance(self, tokens: Sequence[int]) -> None:
        """Takes the tokens the engine emitted; ValueError, the matcher unchanged, for one the
        grammar does not allow (the masks were not applied: a caller's bug)."""
        tokens = self._checked_ids(tokens)
        end = next((i for i, token in enumerate(tokens) if token in self._stop_ids), len(tokens))
        if end < len(tokens) - 1:
            raise ValueError(f"tokens {tokens[end + 1:]} follow the stop token {tokens[end]}")
        consumed = self._matcher.try_consume_tokens(tokens[:end])
        if consumed < end or (end < len(tokens) and not self._matcher.is_accepting()):
            self._matcher.rollback(consumed)
            raise ValueError(f"token {tokens[consumed]} (position {consumed} of {tokens}) is not allowed by the grammar")
        if end < len(tokens):
            self._consume(tokens[end])

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # the mask allowed it: llguidance disagrees with itself
            raise RuntimeError(f"llguidance's mask allowed token {token} that it then rejected: "
                               f"{self._matcher.get_error()}")

    def _checked_ids(self, tokens: Sequence[int]) -> list[int]:
        tokens = [int(token) for token in tokens]
        if any(not 0 <= token < self.vocab_size for token in tokens):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {tokens}")
        return tokens


def walk_batch(matchers: Sequence[GrammarMatcher], draft_tokens: np.ndarray,
               executor: llguidance.LLExecutor) -> tuple[np.ndarray, np.ndarray]:
    """``GrammarMatcher.walk`` of many requests on ``executor``'s threads (llguidance's, without
    the GIL): ``draft_tokens`` int ``[B, k]`` (k may be 0: the next token's masks) gives masks
    int32 ``[B, k + 1, width]`` and ``legal`` int ``[B]``, as ``walk`` would row by row."""
    draft_tokens = np.asarray(draft_tokens)
    if draft_tokens.ndim != 2 or len(draft_tokens) != len(matchers):
        raise ValueError(f"draft_tokens must be [{len(matchers)}, k] (one row per matcher), got {draft_tokens.shape}")
    widths = {matcher.width for matcher in matchers}
    if len(widths) != 1:
        raise ValueError(f"the matchers must share one vocabulary, got mask widths {sorted(widths)}")
    batch, k = draft_tokens.shape
    drafts = [matcher._checked_ids(row) for matcher, row in zip(matchers, draft_tokens)]
    masks = np.full((batch, k + 1, widths.pop()), -1, np.int32)
    rows = masks.reshape(batch * (k + 1), -1)
    if k:
        # llguidance's walk: row i before draft token i, up to the first token its matcher
        # rejects; it goes on past a stop token by one row, cleared below
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
            executor, [(matcher._matcher, b * (k + 1), draft) for b, (matcher, draft) in enumerate(zip(matchers, drafts))],
            rows)
    else:
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(matcher._matcher, b) for b, matcher in enumerate(matchers)],
                                                     rows)
    legal = np.empty(batch, np.int64)
    for b, (matcher, draft) in enumerate(zip(matchers, drafts)):
        legal[b], last_row = k, k
        for i, token in enumerate(draft):
            if not _allows(masks[b, i], token):
                legal[b] = last_row = i
                break
            if token in matcher._stop_ids:
                legal[b], last_row = i + 1, i
                break
        masks[b, last_row + 1:] = -1
    return masks, legal


def _allows(bitmask: np.ndarray, token: int) -> bool:
    return bool((bitmask[token >> 5] >> (token & 31)) & 1)

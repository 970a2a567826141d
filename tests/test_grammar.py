"""Structured output's grammar layer (dflash_jax.runtime.grammar) over the default model's
tokenizer: generations restricted to the masks parse, draft walks stop at the first illegal token
and leave the matcher as it was, bad request options name their field."""

import json
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest

from dflash_jax.loading.tokenizer import Tokenizer
from dflash_jax.runtime.grammar import (GrammarMatcher, bitmask_to_bool, bitmask_width, grammar_from_request,
                                        grammar_tokenizer, walk_batch)

TARGET = Path(__file__).resolve().parents[1] / "dflash_jax" / "default_model" / "target"
PADDED_VOCAB = 8192 + 100   # a model vocabulary past the tokenizer's 8192 ids
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(TARGET)


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    return grammar_tokenizer(tokenizer, PADDED_VOCAB)


def matcher_for(llg_tokenizer, **options) -> GrammarMatcher:
    return GrammarMatcher(llg_tokenizer, grammar_from_request(**options))


def generate(tokenizer, matcher: GrammarMatcher, seed: int, free_steps: int = 12, max_steps: int = 400) -> str:
    """A random generation under the masks: uniform over the allowed tokens for ``free_steps``
    tokens, then weighted toward tokens that close strings, objects and arrays (those that open
    one never) and toward the stop token, so that it ends. Checks each mask's padded ids are off
    and that the stop token is allowed exactly where the grammar may end."""
    rng = np.random.default_rng(seed)
    texts = [tokenizer.token_text(i) for i in range(8192)]
    closing = np.array([any(c in t for c in '"}]') for t in texts] + [False] * (PADDED_VOCAB - 8192))
    opening = np.array([any(c in t for c in "{[") for t in texts] + [False] * (PADDED_VOCAB - 8192))
    stop = tokenizer.stop_token_ids[0]
    emitted = []
    for step in range(max_steps):
        allowed = bitmask_to_bool(matcher.allowed(), PADDED_VOCAB)
        assert not allowed[8192:].any()
        assert allowed[stop] == matcher.accepts_eos
        weights = allowed.astype(float)
        if step >= free_steps:
            weights *= np.where(opening, 0.0, np.where(closing, 50.0, 1.0))
            weights[stop] *= 1e6
            if not weights.any():   # only opening tokens: take one
                weights = allowed.astype(float)
        token = int(rng.choice(PADDED_VOCAB, p=weights / weights.sum()))
        matcher.advance([token])
        if token == stop:
            assert matcher.is_finished
            return tokenizer.decode(emitted)
        emitted.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokenizer.decode(emitted)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_object_generations_parse(tokenizer, llg_tokenizer, seed):
    text = generate(tokenizer, matcher_for(llg_tokenizer, response_format={"type": "json_object"}), seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_generations_validate(tokenizer, llg_tokenizer, seed):
    text = generate(tokenizer, matcher_for(llg_tokenizer, response_format=PERSON), seed)
    value = json.loads(text)
    assert isinstance(value, dict) and isinstance(value["name"], str), text
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool), text


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_lark_generations_match(tokenizer, llg_tokenizer, seed):
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext [0-9]{1,4})?"   # \d: any Unicode digit, as in Rust
    assert re.fullmatch(phone, generate(tokenizer, matcher_for(llg_tokenizer, guided_regex=phone), seed))
    lark = 'start: answer ("," answer)*\nanswer: "yes" | "no" | /[0-9]+/'
    assert re.fullmatch(r"(yes|no|[0-9]+)(,(yes|no|[0-9]+))*",
                        generate(tokenizer, matcher_for(llg_tokenizer, guided_grammar=lark), seed))
    gbnf = 'root ::= "a" [0-9]+'
    assert re.fullmatch(r"a[0-9]+", generate(tokenizer, matcher_for(llg_tokenizer, guided_grammar=gbnf), seed))


def stepwise_masks(matcher: GrammarMatcher, tokens: list[int]) -> list[np.ndarray]:
    """The masks before each token and after the last, by advancing one token at a time."""
    masks = [matcher.allowed()]
    for token in tokens:
        matcher.advance([token])
        masks.append(matcher.allowed())
    return masks


def test_walk_stops_at_the_first_illegal_token_and_leaves_the_matcher_as_it_was(tokenizer, llg_tokenizer):
    matcher = matcher_for(llg_tokenizer, response_format=PERSON)
    matcher.advance(tokenizer.encode('{"name": "Al'))
    before = matcher.allowed()
    legal = tokenizer.encode('ice", "age": 4')
    illegal = tokenizer.encode("x")
    masks, legal_len = matcher.walk(legal + illegal + tokenizer.encode("2}"))
    assert legal_len == len(legal)
    assert masks.shape == (len(legal) + 4, bitmask_width(PADDED_VOCAB)) and masks.dtype == np.int32
    np.testing.assert_array_equal(matcher.allowed(), before)
    assert not matcher.accepts_eos and not matcher.is_finished
    assert (masks[legal_len + 1:] == -1).all()
    assert not bitmask_to_bool(masks[legal_len], PADDED_VOCAB)[illegal[0]]
    # the masks the walk gave are those of advancing token by token
    np.testing.assert_array_equal(masks[:legal_len + 1], np.stack(stepwise_masks(matcher, legal)))
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        matcher.advance(illegal)
    np.testing.assert_array_equal(matcher.allowed(), masks[legal_len])   # a rejected advance changes nothing


def test_walk_ends_at_a_legal_stop_token(tokenizer, llg_tokenizer):
    stop = tokenizer.stop_token_ids[0]
    matcher = matcher_for(llg_tokenizer, guided_regex="ab+")
    tokens = tokenizer.encode("abb")
    masks, legal = matcher.walk([*tokens, stop, *tokenizer.encode("b")])
    assert legal == len(tokens) + 1
    assert (masks[len(tokens) + 1:] == -1).all() and bitmask_to_bool(masks[len(tokens)], PADDED_VOCAB)[stop]
    np.testing.assert_array_equal(masks[:len(tokens) + 1], np.stack(stepwise_masks(matcher, tokens)))
    # a stop token where the grammar cannot end, and tokens after a stop token, are rejected
    with pytest.raises(ValueError, match="follow the stop token"):
        matcher_for(llg_tokenizer, guided_regex="ab+").advance([*tokens, stop, tokens[-1]])
    early = matcher_for(llg_tokenizer, guided_regex="ab+")
    with pytest.raises(ValueError, match=f"token {stop} .* not allowed"):
        early.advance([*tokenizer.encode("a"), stop])
    assert early.walk([])[1] == 0 and not early.accepts_eos
    matcher.advance([stop])
    assert matcher.is_finished


def test_walk_batch_equals_walk(tokenizer, llg_tokenizer):
    stop = tokenizer.stop_token_ids[0]
    options = [{"response_format": PERSON}, {"guided_regex": "ab+"}, {"guided_regex": "ab"},
               {"response_format": {"type": "json_object"}}]
    matchers = [matcher_for(llg_tokenizer, **option) for option in options]
    k = 8
    object_start = tokenizer.encode('{"a": ')
    drafts = np.array([tokenizer.encode('{"name": "x", "age": 3')[:k],   # all legal
                       tokenizer.encode("ab") + [stop] + tokenizer.encode("b") * (k - 2),
                       tokenizer.encode("ab") + [stop] + tokenizer.encode("b") * (k - 2),   # "ab": stopped, then the stop token
                       (object_start + tokenizer.encode("x") * k)[:k]])   # "x" is no key
    executor = llguidance.LLExecutor(2)
    for width in (k, 0):
        before = [matcher.allowed() for matcher in matchers]
        masks, legal = walk_batch(matchers, drafts[:, :width], executor)
        for b, matcher in enumerate(matchers):
            row_masks, row_legal = matcher.walk(drafts[b, :width])
            assert legal[b] == row_legal, b
            np.testing.assert_array_equal(masks[b], row_masks)
            np.testing.assert_array_equal(matcher.allowed(), before[b])
    assert list(legal) == [0] * 4   # width 0: just the next token's masks
    assert list(walk_batch(matchers, drafts, executor)[1]) == [k, 2, 2, len(object_start)]


def test_padded_vocabulary_and_jax_expansion(tokenizer, llg_tokenizer):
    import jax.numpy as jnp

    assert llg_tokenizer.vocab_size == PADDED_VOCAB
    matcher = matcher_for(llg_tokenizer, response_format={"type": "json_object"})
    mask = matcher.allowed()
    allowed = bitmask_to_bool(mask, PADDED_VOCAB)
    assert mask.shape == (bitmask_width(PADDED_VOCAB),) and not allowed[8192:].any()
    assert set(np.flatnonzero(allowed)) == {i for i in range(8192) if tokenizer.token_text(i) in ("{", "{}")}
    np.testing.assert_array_equal(np.asarray(bitmask_to_bool(jnp.asarray(mask), PADDED_VOCAB)), allowed)
    with pytest.raises(ValueError, match=r"in \[0, 8292\)"):
        matcher.walk([PADDED_VOCAB])
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance([8192 + 5])   # a padded row's id
    with pytest.raises(ValueError, match="C-contiguous int32"):
        matcher.allowed(into=np.empty(mask.size, np.int64))
    with pytest.raises(ValueError, match="8000-logit model .*too small"):
        grammar_tokenizer(tokenizer, 8000)


@pytest.mark.parametrize("options, message", [
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema must be a JSON object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema: Invalid type: nope"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "at most one of .* got response_format and guided_regex"),
    ({"guided_regex": "a(b"}, "(?s)guided_regex: .*unclosed group"),
    ({"guided_regex": 5}, "guided_regex must be a string"),
    ({"guided_grammar": "start: foo"}, 'guided_grammar: .*unknown name: "foo"'),
    ({"guided_grammar": "root ::= ("}, "guided_grammar: Failed to convert"),
])
def test_bad_options_name_their_field(options, message):
    with pytest.raises(ValueError, match=message):
        grammar_from_request(**options)


def test_no_grammar_and_text_format():
    assert grammar_from_request() is None
    assert grammar_from_request(response_format={"type": "text"}) is None
    assert grammar_from_request(response_format={"type": "text"}, guided_regex="a+") is not None


def test_tokenizer_json_drops_padding(tmp_path):
    spec = json.loads((TARGET / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    padded = Tokenizer(tmp_path)
    assert json.loads(padded.to_json())["padding"] is None
    assert len(padded.encode("a")) == 16   # the tokenizer itself keeps its padding

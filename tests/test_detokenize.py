"""Incremental detokenization (``TextStream``): however the tokens arrive (one at a time, in blocks
of any size, the last one ending inside a character), the pieces join to the tokenizer's decode of
all of them, and no piece is ever taken back. Tokenizers of each kind are built here: byte-level
BPE (Qwen3's), SentencePiece-style Metaspace (a Unigram, as T5's) and byte-fallback BPE (Llama 2's
and Mistral's, whose decoder strips the first space)."""

import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from dflash_jax.loading.tokenizer import TextStream, Tokenizer

# Random texts of these split multi-byte characters over tokens and put word-start tokens after newlines.
PIECES = ["a", "b", "ab", " a", " b", " +", "+", "\n", "\n\n", " ", "  ", "日本", " 日", "é", "🙂", "x\n", " é\n",
          "\t", "e\u0301"]


def _texts(rng: random.Random, count: int, longest: int = 24) -> list[str]:
    return ["".join(rng.choices(PIECES, k=rng.randint(1, longest))) for _ in range(count)]


def byte_level_bpe() -> HFTokenizer:
    """Qwen3's kind: byte-level BPE (every byte a token; merges learnt on the pieces, some of
    them parts of a character), a special end token."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(_texts(random.Random(0), 200), trainer)
    return tokenizer


def metaspace_unigram() -> HFTokenizer:
    """SentencePiece's Metaspace (T5's kind): a space is "▁" at the start of a piece, dropped at
    the start of a decode."""
    pieces = ["<unk>", "</s>", "▁", "▁+", "+", "\n", "▁a", "a", "b", "▁b", "x", "日", "本", "▁日", "é", "🙂", "\t", "e",
              "\u0301", "▁\n"]
    tokenizer = HFTokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0))   # the fewest pieces
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens([AddedToken("</s>", special=True)])
    return tokenizer


def byte_fallback_bpe() -> HFTokenizer:
    """Llama 2's and Mistral's kind: SentencePiece BPE whose unknown characters are byte tokens
    (<0xE6>...), decoded by Replace, ByteFallback, Fuse and Strip (one leading space)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "+", "a", "b", "x", "é", "▁+", "▁a", "▁▁", "▁b"]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = HFTokenizer(models.BPE(vocab, [("▁", "+"), ("▁", "a"), ("▁", "▁"), ("▁", "b")], unk_token="<unk>",
                                       byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tokenizer


KINDS = {"byte_level": byte_level_bpe, "metaspace": metaspace_unigram, "byte_fallback": byte_fallback_bpe}


def save(tokenizer: HFTokenizer, folder) -> Tokenizer:
    """The engine's ``Tokenizer`` over ``tokenizer`` (a model folder holding its tokenizer.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    return {kind: save(build(), tmp_path_factory.mktemp(kind)) for kind, build in KINDS.items()}


def _id_sequences(tokenizer: Tokenizer, seed: int, count: int = 12) -> list[list[int]]:
    """Encoded random texts, and random ids (invalid UTF-8, special tokens and all)."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(text) for text in _texts(rng, count)]
    vocab = tokenizer._tok.get_vocab_size()
    return encoded + [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(count)]


def _deliver(tokenizer: Tokenizer, ids: list[int], sizes) -> str:
    """Stream ``ids`` in blocks of ``sizes`` (0: a call with nothing new); at each call the text
    so far is a prefix of the whole, and is all of the decode of the ids so far unless that ends
    inside a character or in byte tokens. Returns the joined pieces."""
    stream, shown, count, whole = TextStream(tokenizer), "", 0, tokenizer.decode(ids)
    for size in sizes:
        count = min(count + size, len(ids))
        shown += stream.update(ids[:count], final=count == len(ids))
        assert whole.startswith(shown), (ids[:count], shown, whole)
        so_far = tokenizer.decode(ids[:count])
        if not so_far.endswith("\ufffd") and (count == 0 or ids[count - 1] not in tokenizer.byte_tokens):
            assert shown == so_far, (ids[:count], shown, so_far)
        if count == len(ids):
            return shown
    raise AssertionError("the sizes do not cover the ids")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pieces_join_to_the_decode_however_the_tokens_arrive(tokenizers, kind):
    tokenizer, rng = tokenizers[kind], random.Random(1)
    for ids in _id_sequences(tokenizer, seed=2):
        whole = tokenizer.decode(ids)
        for block in range(1, len(ids) + 1):
            assert _deliver(tokenizer, ids, [block] * len(ids)) == whole, (ids, block)
        for _ in range(5):
            sizes = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(len(ids))] + [len(ids)]
            assert _deliver(tokenizer, ids, sizes) == whole, (ids, sizes)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_sequences_hold_the_hard_cases(tokenizers, kind):
    """What went wrong is in the sequences above: a word-start token right after a newline, and
    (in the byte kinds) characters split over tokens."""
    tokenizer = tokenizers[kind]
    sequences = _id_sequences(tokenizer, seed=2)
    pairs = [(a, b) for ids in sequences for a, b in zip(ids, ids[1:])]
    assert any(tokenizer.decode([a]).endswith("\n") and tokenizer._tok.id_to_token(b)[0] in "▁Ġ" for a, b in pairs)
    if kind != "metaspace":
        assert any(tokenizer.decode([t]).endswith("\ufffd") for ids in sequences for t in ids)


@pytest.mark.parametrize("kind", ["metaspace", "byte_fallback"])
def test_a_word_start_token_after_a_newline_keeps_its_space(tokenizers, kind):
    """The reported case: "▁+" tokens after a newline token printed "\\n+ + +" where the
    tokenizer decodes "\\n + + +"."""
    tokenizer = tokenizers[kind]
    ids = tokenizer.encode("x\n + + +")
    assert tokenizer.decode(ids) == "x\n + + +"
    for block in range(1, len(ids) + 1):
        assert _deliver(tokenizer, ids, [block] * len(ids)) == "x\n + + +"


def test_a_stream_cut_inside_a_character_ends_as_the_decode(tokenizers):
    """The last tokens may end inside a character: held back until the final update, which
    returns them as the tokenizer decodes them. Byte-level BPE replaces the cut character;
    ByteFallback turns the whole run of byte tokens into U+FFFDs, so none of it is shown early."""
    byte_level, byte_fallback = tokenizers["byte_level"], tokenizers["byte_fallback"]
    cut = [byte_level._tok.token_to_id("æ"), byte_level._tok.token_to_id("ľ")]    # 0xE6 0x9C: half of 本
    for tokenizer, ids, last in ((byte_level, byte_level.encode("a 日") + cut, "\ufffd"),
                                 (byte_fallback, byte_fallback.encode("a 日本")[:-1], "\ufffd" * 5)):
        stream = TextStream(tokenizer)
        pieces = [stream.update(ids[:n]) for n in range(1, len(ids) + 1)]
        assert "".join(pieces) == tokenizer.decode(ids).removesuffix(last)
        assert stream.update(ids, final=True) == last


def test_a_long_stream_decodes_a_bounded_window(tmp_path):
    """Each update decodes the new tokens after the previous piece's, not the whole stream: the
    longest window (here 日本's six byte tokens, the token after them and one more) does not grow
    with the stream, and the tokens decoded per token stay a few."""
    tokenizer = save(byte_fallback_bpe(), tmp_path)
    real = tokenizer.decode

    def windows(repeats: int) -> tuple[int, float]:
        decoded: list[int] = []
        tokenizer.decode = lambda ids: decoded.append(len(ids)) or real(ids)
        ids = tokenizer.encode("a\n + b 日本 é🙂" * repeats)
        stream = TextStream(tokenizer)
        text = "".join(stream.update(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1))
        assert text == real(ids)
        return max(decoded), sum(decoded) / len(ids)

    (short, _), (long, per_token) = windows(10), windows(100)
    assert short == long == 8 and per_token < 4

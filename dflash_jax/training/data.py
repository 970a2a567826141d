"""Training data: the offline stdlib corpus, tokenizer training, token files, anchor sampling.

A *token file* (``.npz``) holds fixed-length rows: ``tokens`` [N, T] int32 and ``loss_mask``
[N, T] bool (True where a token is supervised: the response, never padding or prompt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import sys
import sysconfig
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
HELDOUT_PER_MILLE = 20  # files whose path hashes below this (of 1000) are held out
HELDOUT_RULE = (f"crc32(relative path) % 1000 < {HELDOUT_PER_MILLE}; in a folder where no file passes, "
                "the one file of smallest crc32(relative path) % 1000")


# ---------------------------------------------------------------------------------------------
# Corpus.

def stdlib_root() -> Path:
    """Source folder of the running interpreter's standard library (present on every machine)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _path_hash(relative_path: str) -> int:
    return zlib.crc32(relative_path.encode()) % 1000


def is_heldout(relative_path: str) -> bool:
    """Deterministic evaluation split: by CRC32 of the path relative to the corpus root."""
    return _path_hash(relative_path) < HELDOUT_PER_MILLE


def source_files(root: str | Path) -> tuple[list[Path], list[Path]]:
    """(train, held-out) ``*.py`` files under ``root``, sorted; site-packages excluded. Held out
    as ``HELDOUT_RULE`` says: ``is_heldout`` files, or, in a small folder where none is, one file
    (so that every folder of two or more files has an evaluation split)."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*.py")
                   if p.is_file() and "site-packages" not in p.relative_to(root).parts)  # no dangling links
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}")
    if len(files) == 1:
        raise ValueError(f"{root} holds a single *.py file: a corpus folder needs at least 2, as its files "
                         "are split into training and held-out ones")
    relative = {p: p.relative_to(root).as_posix() for p in files}
    heldout = [p for p in files if is_heldout(relative[p])] or [min(files, key=lambda p: _path_hash(relative[p]))]
    held = set(heldout)
    return [p for p in files if p not in held], heldout


def corpus_manifest(root: Path, heldout: Sequence[Path]) -> dict:
    """What the evaluation split was: the source tree, the rule and the held-out files."""
    manifest = {"corpus": str(root), "heldout_rule": HELDOUT_RULE,
                "heldout_files": [p.relative_to(root).as_posix() for p in heldout]}
    if Path(root) == stdlib_root():
        manifest.update(corpus="stdlib", python=sys.version.split()[0])
    return manifest


def read_texts(paths: Iterable[Path]) -> list[str]:
    """UTF-8 text of each file (a byte-order mark dropped); empty files skipped. Undecodable
    bytes become U+FFFD, and the files that hold them are named in a warning (a UTF-16 or
    Latin-1 file would otherwise train as replacement characters unnoticed)."""
    texts, not_utf8 = [], []
    for path in paths:
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = raw.decode("utf-8-sig", errors="replace")
            not_utf8.append(str(path))
        if text.strip():
            texts.append(text)
    if not_utf8:
        warnings.warn(f"{len(not_utf8)} file(s) are not UTF-8; their undecodable bytes read as U+FFFD: "
                      + ", ".join(not_utf8[:5]) + (", ..." if len(not_utf8) > 5 else ""))
    return texts


def data_digest(texts: Iterable[str], token_files: Iterable[TokenRows] = ()) -> str:
    """sha256 of a run's training data (texts in order, then token files' rows), recorded so
    that resuming refuses data that changed behind the same paths."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    for rows in token_files:
        digest.update(hashlib.sha256(rows.tokens.tobytes() + rows.loss_mask.tobytes()).digest())
    return digest.hexdigest()


def expand_paths(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths or glob patterns (recursive ``**`` allowed), sorted, de-duplicated.
    FileNotFoundError for a pattern that names no file, folders only included."""
    found = set()
    for pattern in patterns:
        matches = glob.glob(pattern, recursive=True) or ([pattern] if Path(pattern).exists() else [])
        files = [Path(m) for m in matches if Path(m).is_file()]
        if not files:
            raise FileNotFoundError(f"{pattern!r} matches folders only, no file" if matches
                                    else f"no file matches {pattern!r}")
        found.update(files)
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Tokenizer.

def train_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: str | Path):
    """Byte-level BPE (``tokenizers``) with <|endoftext|> and <|mask|>; writes tokenizer.json and
    tokenizer_config.json (eos, no BOS) so both this library and transformers can load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {str(tokenizer.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False}
               for t in SPECIAL_TOKENS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "bos_token": None, "add_bos_token": False, "model_max_length": 1 << 20,
        "added_tokens_decoder": special}, indent=2))
    return tokenizer


def load_tokenizer(directory: str | Path):
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the model folder needs a tokenizer.json")
    return Tokenizer.from_file(str(path))


def encode_documents(tokenizer, texts: Sequence[str], eos_id: int | None) -> list[np.ndarray]:
    """Token ids of each text, <|endoftext|> appended when ``eos_id`` is given. Special-token
    strings in the text (source code may spell "<|endoftext|>") are encoded as plain text: the
    only control tokens in training rows are the ones the recipe puts there."""
    tail = [] if eos_id is None else [eos_id]
    previous, tokenizer.encode_special_tokens = tokenizer.encode_special_tokens, True
    try:
        encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = previous
    return [np.asarray(enc.ids + tail, np.int32) for enc in encodings]


# ---------------------------------------------------------------------------------------------
# Token rows and token files.

@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Fixed-length training rows: tokens [N, T] int32, loss_mask [N, T] bool."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self):
        if self.tokens.ndim != 2 or self.tokens.shape != self.loss_mask.shape:
            raise ValueError(f"tokens {self.tokens.shape} and loss_mask {self.loss_mask.shape} must be "
                             "equal [rows, seq_len]")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of a step, a pure function of (seed, step): resuming replays the same batches."""
        rows = np.random.default_rng((seed, step)).integers(0, len(self), batch_size)
        return self.tokens[rows], self.loss_mask[rows]


def pack_stream(documents: Sequence[np.ndarray], seq_len: int, name: str = "the documents") -> TokenRows:
    """Concatenate documents (each ending in EOS) and cut the stream into full rows, all
    supervised (plain LM data: the target's pretraining, or drafts trained on raw text).
    ``name`` says what the documents are when there are too few tokens for one row."""
    stream = np.concatenate(documents) if documents else np.zeros((0,), np.int32)
    count = len(stream) // seq_len
    if count == 0:
        raise ValueError(f"{name} hold {len(stream)} tokens, fewer than one row of {seq_len}")
    tokens = stream[:count * seq_len].reshape(count, seq_len).astype(np.int32)
    return TokenRows(tokens, np.ones_like(tokens, bool))


def prompt_response_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         seq_len: int, pad_id: int) -> TokenRows:
    """Rows prompt + response (truncated/padded to seq_len); only response tokens supervised."""
    tokens = np.full((len(prompts), seq_len), pad_id, np.int32)
    mask = np.zeros((len(prompts), seq_len), bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        row = (list(prompt) + list(response))[:seq_len]
        tokens[i, :len(row)] = row
        mask[i, len(prompt):len(row)] = True
    return TokenRows(tokens, mask)


@contextlib.contextmanager
def written_whole(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only when the block completes: written as a hidden
    sibling and renamed into place, removed on any failure (Ctrl-C included), so an interrupted
    write never leaves a truncated file that reads as complete, nor replaces a whole one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as file:
            yield file
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def save_token_file(path: str | Path, rows: TokenRows, *, record: str | None = None) -> None:
    """Rows as .npz, written whole (``written_whole``); ``record`` (optional text) says what they
    were made from."""
    extra = {} if record is None else {"record": np.array(record)}
    with written_whole(path) as file:  # a file, not a name: savez would append ".npz" to a name
        np.savez_compressed(file, tokens=rows.tokens, loss_mask=rows.loss_mask, **extra)


@contextlib.contextmanager
def _token_file(path: str | Path) -> Iterator[np.lib.npyio.NpzFile]:
    """``np.load`` of a token file, arrays read inside the block; ValueError naming the file
    when it is damaged (a truncated or corrupt archive) or not a token file."""
    damaged = (ValueError, EOFError, zipfile.BadZipFile, zlib.error)  # opening it, reading an array
    try:
        arrays = np.load(path)
    except damaged as error:
        raise ValueError(f"{path}: not a readable token file ({error})") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):  # one .npy array under an .npz name
        raise ValueError(f"{path}: not a token file (one array, not an .npz archive of tokens and loss_mask)")
    with arrays:
        if not {"tokens", "loss_mask"} <= set(arrays.files):
            raise ValueError(f"{path}: not a token file (it holds {sorted(arrays.files)}, not tokens and loss_mask)")
        try:
            yield arrays
        except damaged as error:
            raise ValueError(f"{path}: a damaged token file ({error})") from None


def load_token_file(path: str | Path) -> TokenRows:
    with _token_file(path) as arrays:
        return TokenRows(arrays["tokens"].astype(np.int32), arrays["loss_mask"].astype(bool))


def token_file_record(path: str | Path) -> str | None:
    """The ``record`` a token file was saved with, if any."""
    with _token_file(path) as arrays:
        return str(arrays["record"]) if "record" in arrays else None


def concat_rows(parts: Sequence[TokenRows]) -> TokenRows:
    lengths = {p.seq_len for p in parts}
    if len(lengths) != 1:
        raise ValueError(f"token files have different row lengths {sorted(lengths)}")
    return TokenRows(np.concatenate([p.tokens for p in parts]), np.concatenate([p.loss_mask for p in parts]))


# ---------------------------------------------------------------------------------------------
# Anchors and blocks (DFlash training; the recipe is in train_draft's module docstring).

def anchor_positions(loss_mask):
    """Where an anchor may open a block [R, T-1]: positions t where tokens t and t+1 are both
    supervised, so the block predicts at least one supervised token (numpy or jax)."""
    return loss_mask[:, :-1] & loss_mask[:, 1:]


def check_token_ids(rows: TokenRows, vocab_size: int, where: str) -> None:
    """ValueError unless every token id of ``rows`` is in [0, vocab_size): an embedding lookup
    would clamp or wrap a stray id and train on it without a word."""
    if rows.tokens.size and (rows.tokens.min() < 0 or rows.tokens.max() >= vocab_size):
        raise ValueError(f"{where}: token ids span [{rows.tokens.min()}, {rows.tokens.max()}], outside the "
                         f"target's vocabulary [0, {vocab_size}) (made with another tokenizer?)")


def trainable_rows(rows: TokenRows, vocab_size: int, where: str = "the training rows") -> TokenRows:
    """The rows with at least one anchor position, their ids checked (``check_token_ids``). A row
    without one would train on a zero loss while the optimizer still steps (a warning counts
    them); ValueError when no row has one."""
    check_token_ids(rows, vocab_size, where)
    anchorable = anchor_positions(rows.loss_mask).any(axis=1)
    if not anchorable.any():
        raise ValueError(f"nothing to train on: no row of the {len(rows)} training rows has two consecutive "
                         f"supervised tokens ({int(rows.loss_mask.sum())} supervised in all), so no block "
                         "can be anchored")
    if not anchorable.all():
        warnings.warn(f"{where}: {int((~anchorable).sum())} of {len(rows)} rows have no two consecutive supervised "
                      "tokens (no block can be anchored there) and are left out", stacklevel=2)
        rows = TokenRows(rows.tokens[anchorable], rows.loss_mask[anchorable])
    return rows


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> jax.Array:
    """Up to ``num_anchors`` distinct random anchors per row [B, N] (-1 = unused slot), at
    ``anchor_positions``. Valid anchors come first, in random order."""
    valid = anchor_positions(loss_mask)
    scores = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
    top, index = jax.lax.top_k(scores, min(num_anchors, valid.shape[1]))
    anchors = jnp.where(top >= 0, index, -1).astype(jnp.int32)
    if num_anchors > valid.shape[1]:
        anchors = jnp.pad(anchors, ((0, 0), (0, num_anchors - valid.shape[1])), constant_values=-1)
    return anchors


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Draft blocks of a batch, flattened per row: N anchors x B block positions.

    tokens/positions: [R, N*B] block inputs ([token_t, mask x (B-1)]) at positions t..t+B-1;
    labels: [R, N, B-1] tokens t+1..t+B-1; label_mask: [R, N, B-1] supervised, in-range labels
    of used anchors.
    """

    tokens: jax.Array
    positions: jax.Array
    labels: jax.Array
    label_mask: jax.Array


def make_blocks(tokens: jax.Array, loss_mask: jax.Array, anchors: jax.Array, block_size: int,
                mask_token_id: int) -> Blocks:
    """Block inputs, positions and labels for anchors [R, N] (-1 = unused) of rows [R, T]."""
    rows, seq_len = tokens.shape
    num = anchors.shape[1]
    used = anchors >= 0
    start = jnp.where(used, anchors, 0)
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    positions = start[:, :, None] + offsets                            # [R, N, B]
    inside = positions < seq_len
    clipped = jnp.minimum(positions, seq_len - 1)
    gathered = jnp.take_along_axis(tokens, clipped.reshape(rows, -1), axis=1).reshape(rows, num, block_size)
    supervised = jnp.take_along_axis(loss_mask, clipped.reshape(rows, -1), axis=1).reshape(rows, num, block_size)
    block = jnp.where(offsets == 0, gathered, mask_token_id)
    return Blocks(tokens=block.reshape(rows, -1).astype(jnp.int32),
                  positions=positions.reshape(rows, -1).astype(jnp.int32),
                  labels=gathered[:, :, 1:].astype(jnp.int32),
                  label_mask=(supervised & inside & used[:, :, None])[:, :, 1:])


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """Loss weight exp(-(k-1)/gamma) of block position k = 1..B-1 [B-1]."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def default_gamma(block_size: int) -> float:
    """The paper's decay (7 for B=16, 5 for B=10, 4 for B=8); other sizes scale 7 by B/16."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0 * block_size / 16)

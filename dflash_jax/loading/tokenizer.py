"""Tokenizer (``tokenizers``) and chat template (jinja2) read from an HF model folder, and prompt
files (text lines, or JSON Lines of prompts and chats) rendered through them."""

from __future__ import annotations

import copy
import datetime
import json
import warnings
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from dflash_jax.model.config import int_list, read_json


class Tokenizer:
    """Encode/decode plus the folder's chat template and stop tokens."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the model folder needs a tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{path}: not a readable tokenizer ({error})") from error
        self.directory = directory
        config_path = directory / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.is_file() else {}
        if not isinstance(self.config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
        map_path = directory / "special_tokens_map.json"
        self.special_tokens_map = read_json(map_path) if map_path.is_file() else {}
        if not isinstance(self.special_tokens_map, dict):
            raise ValueError(f"{map_path} is not a JSON object")
        self.stop_token_ids = self._stop_tokens(directory)
        self.byte_tokens = self._byte_tokens()

    def _stop_tokens(self, directory: Path) -> list[int]:
        """eos_token_id of generation_config.json and config.json, and the eos_token of
        tokenizer_config.json or special_tokens_map.json (transformers reads both)."""
        ids = []
        for name in ("generation_config.json", "config.json"):
            path = directory / name
            if path.is_file():
                raw = read_json(path)
                ids += int_list(raw, "eos_token_id", str(path), ()) if isinstance(raw, dict) else ()
        for path, config in ((directory / "tokenizer_config.json", self.config),
                             (directory / "special_tokens_map.json", self.special_tokens_map)):
            token = config.get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            if token is None:
                continue
            token_id = self._tok.token_to_id(token) if isinstance(token, str) else None
            if token_id is None:
                warnings.warn(f"{path}: eos_token {token!r} is not in the vocabulary; it does not stop "
                              "generation")
            else:
                ids.append(token_id)
        return sorted(set(ids))

    def _byte_tokens(self) -> frozenset[int]:
        """The ids of the <0x00>..<0xFF> tokens when the decoder reads them as bytes (ByteFallback,
        SentencePiece's): it decodes a run of them as a whole, all U+FFFD when any is invalid."""
        decoder = self._tok.decoder
        if decoder is None or not _has_byte_fallback(json.loads(decoder.__getstate__())):
            return frozenset()
        return frozenset(i for b in range(256) if (i := self._tok.token_to_id(f"<0x{b:02X}>")) is not None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, padding and truncation off: what a grammar
        engine (llguidance's LLTokenizer) rebuilds it from."""
        backend = self._tok
        if backend.padding is not None or backend.truncation is not None:
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
        return backend.to_str()

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (how log-probabilities name tokens)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        """chat_template.jinja (where newer transformers save it), else tokenizer_config.json's,
        else chat_template.json's (a multimodal release's processor template, Qwen3.5's); read
        when a chat is rendered, so a broken template does not stop plain prompts."""
        template_file = self.directory / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(encoding="utf-8")
        if self.config.get("chat_template") is None and (self.directory / "chat_template.json").is_file():
            processor = self.directory / "chat_template.json"
            return _default_template(json.loads(processor.read_text(encoding="utf-8")).get("chat_template"), processor)
        return _default_template(self.config.get("chat_template"), self.directory / "tokenizer_config.json")

    def apply_chat_template(self, messages: str | list[dict], *, enable_thinking: bool | None = None) -> str:
        """Render a chat (a list of {"role", "content"} messages; a string is one user turn) with
        the generation prompt, as transformers would: in a sandbox (a model folder's template
        must not run code), with its globals and filters. ``enable_thinking`` is passed to
        templates that read it (Qwen3's); one that does not is an error, not ignored."""
        template = self.chat_template
        if not template:
            raise ValueError(f"{self.directory} has no chat template (neither chat_template.jinja nor a "
                             "chat_template in tokenizer_config.json); drop --chat")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        check_messages(messages)
        switches = {}
        if enable_thinking is not None:
            if "enable_thinking" not in template:
                raise ValueError(f"{self.directory}: the chat template has no enable_thinking switch")
            switches["enable_thinking"] = enable_thinking
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        # bos_token, eos_token, ...: tokenizer_config.json's over special_tokens_map.json's, as in transformers
        special = {k: (v.get("content") if isinstance(v, dict) else v)
                   for k, v in {**self.special_tokens_map, **self.config}.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        try:
            return env.from_string(template).render(
                messages=messages, add_generation_prompt=True, tools=None, documents=None,
                **special, **switches)
        except jinja2.TemplateError as error:
            raise ValueError(f"{self.directory}: chat template failed: {error}") from error


def _has_byte_fallback(decoder: dict) -> bool:
    return decoder.get("type") == "ByteFallback" or any(_has_byte_fallback(d) for d in decoder.get("decoders", ()))


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's text for
    training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def check_messages(messages) -> None:
    """A chat is a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a chat must be a non-empty list of messages, got {str(messages)[:60]}")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError('each chat message must be an object with "role" and "content" strings, '
                             f"got {str(message)[:60]}")


def read_prompt_file(path: str | Path, flag: str) -> dict[int, str | list[dict]]:
    """The prompts of a file given as ``flag`` by their line numbers (from 1): its non-blank lines
    (.txt), or per line an object with a "prompt" string or a "messages" chat (.jsonl); a warning
    names the blank lines skipped. UTF-8, a byte-order mark dropped. A pipe is read as a file is
    (``/dev/stdin``, a shell's ``<(...)``), as lines of text."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder: give a .txt or .jsonl file")
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist")
    if path.suffix.lower() == ".json":
        raise ValueError(f"{flag} {path}: a .json file is not read as JSON; write one "
                         '{"prompt": ...} object per line in a .jsonl file')
    try:  # utf-8-sig: a byte-order mark is not part of the first prompt
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({error})") from error
    # Lines end at "\n", "\r\n" or "\r" (read_text's newline translation), not at form feeds,
    # U+2028 and the like, where str.splitlines would also split: prompts and JSON strings may
    # hold them.
    numbered = dict(enumerate(text.removesuffix("\n").split("\n"), 1))
    lines = {number: line for number, line in numbered.items() if line.strip()}
    blank = sorted(numbered.keys() - lines.keys())
    if not lines:
        raise ValueError(f"{flag} {path} holds no prompts")
    if blank:
        more = f" and {len(blank) - 10} more" if len(blank) > 10 else ""
        warnings.warn(f"{flag} {path}: blank line(s) {', '.join(map(str, blank[:10]))}{more} skipped "
                      "(the prompts keep their line numbers)", stacklevel=2)
    if path.suffix.lower() != ".jsonl":
        return lines
    return {number: _jsonl_prompt(line, f"{path}:{number}") for number, line in lines.items()}


def _jsonl_prompt(line: str, where: str) -> str | list[dict]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from error
    if isinstance(record, dict) and "messages" in record and "prompt" not in record:
        try:
            check_messages(record["messages"])
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return record["messages"]
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{where}: expected an object with a "prompt" string or a "messages" list, '
                         f"got {line.strip()[:60]}")
    if not record["prompt"]:
        raise ValueError(f"{where}: the prompt is empty")
    return record["prompt"]


def chat_options(args) -> dict:
    """``render_prompts``' chat, system and enable_thinking from the flags
    ``entrypoints.arguments.add_chat_arguments`` defines; ValueError for --system or --no-thinking without --chat."""
    for flag in ("system", "no_thinking"):
        if getattr(args, flag) and not args.chat:
            raise ValueError(f"--{flag.replace('_', '-')} needs --chat")
    return {"chat": args.chat, "system": args.system, "enable_thinking": False if args.no_thinking else None}


def render_prompts(tokenizer: Tokenizer, prompts: list[str | list[dict]], *, chat: bool, system: str | None = None,
                   enable_thinking: bool | None = None, flag: str) -> list[str]:
    """The prompts as the text to encode: through the chat template when ``chat`` (a text prompt
    is one user turn, after a ``system`` message if given), as they are otherwise (a "messages"
    chat from the file given as ``flag`` then is an error)."""
    if not chat:
        if any(isinstance(p, list) for p in prompts):
            raise ValueError(f'{flag} holds "messages" chats: add --chat to render them')
        return prompts
    system_turn = [{"role": "system", "content": system}] if system else []
    return [tokenizer.apply_chat_template(p if isinstance(p, list) else [*system_turn, {"role": "user", "content": p}],
                                          enable_thinking=enable_thinking) for p in prompts]


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (jinja2's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _default_template(template, where: Path) -> str | None:
    """A tokenizer_config chat_template: a string, or (an older form) a list of named templates,
    of which transformers renders the one named 'default' when no tools are given."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates with "
                     "one named 'default'")


def _raise(message: str):
    raise jinja2.TemplateError(message)


class TextStream:
    """Incremental detokenization: the pieces ``update`` returns join to the tokenizer's decode of
    all the ids, however many arrive at a time.

    As vLLM and text-generation-inference do: the new ids are decoded after the ids of the
    previous piece (``ids[prefix:read]``), and the piece is the text they add to that context's.
    A token decoded first can read differently than within a text (SentencePiece's Metaspace
    drops a word-start space at the start of a decode); after the context it reads as in the
    whole. Only the last pieces' tokens are decoded again, so a long stream costs linear time."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0     # ids[prefix:read]: the previous piece's tokens; ids[read:] unshown
        self.context = 0                # the length of their text decoded alone

    def update(self, ids: list[int], *, final: bool = False) -> str:
        """The text of ``ids`` (all the tokens so far, extending the previous call's) not
        returned yet. Unless ``final``, text is held back while it ends in a partial UTF-8
        character (U+FFFD) or in byte tokens (``Tokenizer.byte_tokens``: later ones may turn
        the run into U+FFFDs); ``final`` returns the rest as it is."""
        end = len(ids)
        while not final and end > self.read and ids[end - 1] in self.tokenizer.byte_tokens:
            end -= 1
        text = self.tokenizer.decode(ids[self.prefix:end])
        if len(text) <= self.context or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, end
        piece, self.context = text[self.context:], len(self.tokenizer.decode(ids[self.prefix:self.read]))
        return piece

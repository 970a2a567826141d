"""Tokenizer (``tokenizers``) and chat template (jinja2) read from an HF model folder."""

from __future__ import annotations

from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from dflash_jax.config import read_json, token_ids


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
        template_file = directory / "chat_template.jinja"  # where newer transformers save it
        self.chat_template = (template_file.read_text() if template_file.is_file()
                              else _default_template(self.config.get("chat_template"), config_path))
        self.stop_token_ids = self._stop_tokens(directory)

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def _stop_tokens(self, directory: Path) -> list[int]:
        ids = []
        for name in ("generation_config.json", "config.json"):
            path = directory / name
            if path.is_file():
                raw = read_json(path)
                ids += token_ids(raw.get("eos_token_id") if isinstance(raw, dict) else None)
        eos_token = self._token_id(self.config.get("eos_token"))
        if eos_token is not None:
            ids.append(eos_token)
        return sorted(set(ids))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, user_message: str) -> str:
        """Render one user turn with the generation prompt, as transformers would."""
        if not self.chat_template:
            raise ValueError(f"{self.directory} has no chat template (neither chat_template.jinja nor a "
                             "chat_template in tokenizer_config.json); drop --chat")
        # as transformers renders templates: loop controls ({% break %}) on
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                                 extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self.config.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_message}], add_generation_prompt=True, **special)
        except jinja2.TemplateError as error:
            raise ValueError(f"{self.directory}: chat template failed: {error}") from error


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
    """Incremental detokenization: the pieces it returns join to the decoded text of all the ids."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.printed = tokenizer, ""

    def update(self, ids: list[int], *, final: bool = False) -> str:
        """The text of ``ids`` (all tokens so far) not returned yet. Unless ``final``, text that
        ends in a partial UTF-8 character (U+FFFD) is held back until more tokens complete it;
        ``final`` returns the rest as it is."""
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.printed = text[len(self.printed):], text
        return new

"""Reading HF ``config.json`` files: typed field access whose errors name the field and the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the offending field named."""


REQUIRED = object()

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "an object", list: "a list"}


def field(raw: dict, name: str, where: str, kind: type, default: Any = REQUIRED) -> Any:
    """``raw[name]`` as ``kind`` (int, float, bool, str, dict or list); an absent or null field
    takes ``default``. ConfigError naming the field when it is missing without a default or has
    another type (a JSON bool is not a number, and "false" is not a bool)."""
    value = raw.get(name)
    if value is None:
        if default is REQUIRED:
            raise ConfigError(f"{where}: required field '{name}' is missing")
        return default
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{where}: field '{name}' must be {_KIND_NAMES[kind]}, got {value!r}")
    return value


def int_list(raw: dict, name: str, where: str, default: Any = REQUIRED) -> Any:
    """A list of integers (or a single integer; null entries skipped) as a tuple, such as an
    ``eos_token_id``; ConfigError naming the field and ``where`` for anything else."""
    value = raw.get(name)
    if value is None:
        return field(raw, name, where, list, default)
    items = value if isinstance(value, list) else [value]
    return tuple(field({name: item}, name, where, int) for item in items if item is not None)


def architectures(raw: dict[str, Any]) -> list[str]:
    """config.json's ``architectures`` as a list of names (a lone string counts as one)."""
    names = raw.get("architectures")
    if isinstance(names, str):
        names = [names]
    return [str(name) for name in names] if isinstance(names, list) else []


def read_json(path: str | Path) -> Any:
    """A JSON file of a model folder; ConfigError naming the file when it does not parse."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from error


def read_config_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected an HF model folder with config.json")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw

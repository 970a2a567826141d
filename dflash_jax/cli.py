"""Pieces shared by the command lines (generate, convert, the training CLIs and the benchmarks):
argparse types whose bad values are one usage error naming the flag, the one-line report of
refused input, and one-line warnings."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Callable, Iterator


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type of an integer flag >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value
    return parse


def positive_float(text: str) -> float:
    """argparse type of a finite float flag > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


@contextlib.contextmanager
def reported_as_errors() -> Iterator[None]:
    """Around a CLI's reading of the user's input: the library's refusals (OSError, ValueError:
    missing or clashing folders, bad configs or data) become one ``error: ...`` line and exit
    status 2, as ``python -m dflash_jax.generate`` reports them."""
    try:
        yield
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"{'warning' if category is UserWarning else category.__name__}: {message}\n"


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Within it (a CLI's ``main``; also a decorator), warnings print as ``warning: message``
    (other categories: ``Category: message``), not with the file, line and source line that
    raised them as Python's default does."""
    previous, warnings.formatwarning = warnings.formatwarning, _one_line
    try:
        yield
    finally:
        warnings.formatwarning = previous

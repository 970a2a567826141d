"""Pieces shared by the command lines (the training CLIs and the benchmarks): argparse types
whose bad values are one usage error naming the flag, and the one-line report of refused input."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
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

"""Pieces shared by the command lines (generate, convert, the training CLIs and the benchmarks):
argparse types whose bad values are one usage error naming the flag, --help naming each flag's
default, the dtype a command runs in when none is named, the one-line report of refused input,
one-line warnings, interrupts deferred to the end of a training step, the folder that keeps
compiled programs between runs, and how a command line exits.

Importing it does not import jax (the functions that need it import it when called), so a
command line can parse its arguments, and answer --help, before paying for jax."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn


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


def _finite_float(text: str, bound: str) -> float:
    """A finite float parsed from ``text`` that is ``bound`` ("> 0" or ">= 0"), else an argparse error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if bound == "> 0" else value >= 0)):
        raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type of a finite float flag > 0."""
    return _finite_float(text, "> 0")


def non_negative_float(text: str) -> float:
    """argparse type of a finite float flag >= 0."""
    return _finite_float(text, ">= 0")


def random_seed(text: str) -> int:
    """argparse type of a random seed: an integer in [0, 2**32) (jax.random.key would take a
    larger one modulo 2**32 or fail)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


DTYPE_DEFAULT_HELP = "default: float32 on CPU, bfloat16 on GPU/TPU"


def default_dtype() -> str:
    """The dtype of a run whose user named none (``--dtype`` left out): float32 on a CPU, where
    bfloat16 runs 2-3x slower and a tiny model's greedy output in it drifts from transformers'
    float32 output; bfloat16 on an accelerator. Asks jax for its default backend, so a command
    calls it after setting up its devices (``distributed.initialize``)."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@contextlib.contextmanager
def reported_as_errors() -> Iterator[None]:
    """Around a CLI's reading of the user's input: the library's refusals (OSError, ValueError:
    missing or clashing folders, bad configs or data) become one ``error: ...`` line and exit
    status 2, as ``python -m dflash_jax.generate`` reports them."""
    try:
        yield
    except BrokenPipeError:  # not the user's input: the reader of our output left (``exit_with``)
        raise
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def or_na(value: float | None, template: str) -> str:
    """``template.format(value)``, or "n/a" when ``value`` is undefined (None or NaN)."""
    return "n/a" if value is None or math.isnan(value) else template.format(value)


@contextlib.contextmanager
def named_as_flags(names: Iterable[str]) -> Iterator[None]:
    """Within it, a ValueError that names one of the library arguments ``names`` (``top_p``)
    names it as the flag that sets it (``--top-p``): the user typed the flag."""
    try:
        yield
    except ValueError as error:
        message = str(error)
        for name in names:
            message = re.sub(rf"(?<![\w-]){name}\b", "--" + name.replace("_", "-"), message)
        if message == str(error):
            raise
        raise ValueError(message) from error


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help ending each flag's text with ``(default: VALUE)``; a flag whose default is None says
    in its own text what leaving it out means, and a switch (off by default) says nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


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


@contextlib.contextmanager
def deferred_interrupts(what: str) -> Iterator[Callable[[], bool]]:
    """Within it, the first Ctrl-C or SIGTERM only sets a flag, read by the callable it yields,
    so a loop can finish its step and save (``what`` it will do, for the message); a second one
    raises KeyboardInterrupt at once. Off the main thread (where Python cannot take signals)
    nothing changes and the flag stays False."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    requested = threading.Event()

    def handler(signum, frame):
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        print(f"\ninterrupt: {what}; interrupt again to stop at once", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested.is_set
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


COMPILE_CACHE_HELP = ("keep compiled programs in this folder, so a later run of the same shapes "
                      "loads them instead of compiling (default: $JAX_COMPILATION_CACHE_DIR if set, "
                      "else $XDG_CACHE_HOME/dflash_jax/xla or ~/.cache/dflash_jax/xla; 'none': keep nothing)")


def compile_cache_folder(choice: str | None) -> Path | None:
    """The folder ``--compile-cache`` means: None for "none"; without the flag (``choice`` None),
    jax's own setting (``JAX_COMPILATION_CACHE_DIR``), else ``$XDG_CACHE_HOME/dflash_jax/xla``
    (``~/.cache`` when that is unset). OSError where it needs a home folder and there is none."""
    import jax

    try:
        if choice is None:
            choice = jax.config.jax_compilation_cache_dir or str(
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_jax" / "xla")
        return None if choice == "none" else Path(choice).expanduser()
    except RuntimeError as error:  # no $HOME and no password entry to find it in
        raise OSError(f"no home folder to keep them in ({error})") from None


def keep_compiled_programs(choice: str | None) -> Path | None:
    """Point jax's persistent compilation cache at ``compile_cache_folder(choice)``, before the
    first compile: a later run of the same shapes loads its programs instead of compiling them
    (a Qwen3-8B DFlash run with its baseline: 27 s of compiles become 4.4 s on an H100). Programs
    that compile in under ``jax_persistent_cache_min_compile_time_secs`` (1 s unless set) are not
    kept. A folder the user named that cannot be written is an OSError; the default one is a
    warning, and the run compiles as it would without. Returns the folder in use (None: none)."""
    import jax

    try:
        folder = compile_cache_folder(choice)
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryFile(dir=folder).close()
            except OSError as error:
                raise OSError(f"cannot write {folder} ({error})") from None
    except OSError as error:
        if choice is not None:
            raise OSError(f"--compile-cache {choice}: {error}") from None
        warnings.warn(f"compiled programs are not kept between runs: {error}; --compile-cache names "
                      "a folder for them")
        folder = None
    jax.config.update("jax_compilation_cache_dir", None if folder is None else str(folder))
    return folder


INTERRUPTED, PIPE_CLOSED = 130, 141  # the shell's statuses for SIGINT and SIGPIPE


@contextlib.contextmanager
def interrupt_exits() -> Iterator[None]:
    """Around a CLI's ``main`` (also a decorator): Ctrl-C (KeyboardInterrupt) ends it with exit
    status 130 and one line, not a traceback; what was saved is said where it was saved."""
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """A command line's ``if __name__ == "__main__"``: exit with ``main()``'s status. Output piped
    into a command that stops reading (``| head``) ends it quietly with status 141, as SIGPIPE
    ends other tools. An interrupted or cut-off run leaves without tearing the interpreter down:
    device work may still be in flight, and XLA can crash under it (a segfault after the
    "interrupted" line)."""
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
    except BrokenPipeError:
        status = PIPE_CLOSED
    if status in (INTERRUPTED, PIPE_CLOSED):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the closed pipe itself
                pass
        os._exit(status)
    sys.exit(status)

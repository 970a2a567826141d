"""Several processes (one per host) joined into one JAX runtime: the flags that say where the
coordinator listens and which process this is, and ``jax.distributed.initialize``.

Every process runs the same command with its own ``--process-id``; ``jax.devices()`` then lists
the devices of all of them, so a mesh over them (``--tp``) spans the hosts. Process 0 hosts the
coordinator at ``--coordinator``, which every process must reach. A process that stops alone
leaves the others waiting in their next collective (until JAX's timeouts abort them, minutes
later): ``stop_together`` makes a failed step stop every process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

# Each flag's environment variable (JAX itself reads JAX_COORDINATOR_ADDRESS when none is given).
ENVIRONMENT = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class Processes:
    """Where the coordinator listens (HOST:PORT), how many processes join, and which one this is."""

    coordinator: str
    num_processes: int
    process_id: int


def is_first(processes: Processes | None) -> bool:
    """Whether this is process 0 (or the only process): the one that reports."""
    return processes is None or processes.process_id == 0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _integer(text: str, source: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{source} must be an integer >= {minimum}, got {text!r}")
    return value


def _check_address(address: str, source: str) -> None:
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{source} must be HOST:PORT with a port in [1, 65535] (10.0.0.1:1234), got {address!r}")


def processes(args: argparse.Namespace) -> Processes | None:
    """The processes the flags (else their environment variables) describe; None when neither
    sets any. ValueError, naming the flag or variable, when only some are set or one is malformed."""
    values, sources = {}, {}
    for name, variable in ENVIRONMENT.items():
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name], sources[name] = flag_value, _flag(name)
        elif os.environ.get(variable):
            values[name], sources[name] = os.environ[variable], f"${variable}"
    if not values:
        return None
    missing = [f"{_flag(name)} (or ${variable})" for name, variable in ENVIRONMENT.items() if name not in values]
    if missing:
        given = ", ".join(sources.values())
        raise ValueError(f"{given} given without {' and '.join(missing)}: several processes need all three")
    _check_address(values["coordinator"], sources["coordinator"])
    count = _integer(values["num_processes"], sources["num_processes"], 1)
    index = _integer(values["process_id"], sources["process_id"], 0)
    if index >= count:
        raise ValueError(f"{sources['process_id']} {index} is out of range for {count} processes "
                         f"(0 .. {count - 1})")
    return Processes(values["coordinator"], count, index)


@contextlib.contextmanager
def _stdout_as_stderr() -> Iterator[None]:
    """Within it, what is written to the process's stdout (file descriptor 1, C++ included) goes
    to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def initialize(args: argparse.Namespace) -> Processes | None:
    """Join the processes the flags describe into one runtime (``jax.distributed.initialize``)
    and wait until every device of every process has answered; nothing when the flags describe
    none. Call it before anything touches a JAX device. ValueError for bad flags (``processes``)."""
    joined = processes(args)
    if joined is not None:
        jax.distributed.initialize(coordinator_address=joined.coordinator, num_processes=joined.num_processes,
                                   process_id=joined.process_id)
        # The first collective connects the devices; on CPU, gloo announces it on stdout, where
        # it would land inside the generated text.
        with _stdout_as_stderr():
            multihost_utils.sync_global_devices("dflash_jax processes joined")
    return joined


class OtherProcessFailed(ValueError):
    """Another process refused its input (it printed why): this one stops with it."""


@contextlib.contextmanager
def stop_together() -> Iterator[None]:
    """Around a step that every process runs (reading input, loading weights): when it raises an
    Exception in any process, it raises in every process, the others ``OtherProcessFailed``
    naming it. Each process waits at the end of the step for the others' outcome (a collective:
    every process must enter it the same number of times)."""
    try:
        yield
    except Exception:
        _failed_processes(failed=True)
        raise
    failed = _failed_processes(failed=False)
    if failed:
        which = f"process {failed[0]}" if len(failed) == 1 else f"processes {', '.join(map(str, failed))}"
        raise OtherProcessFailed(f"{which} of {jax.process_count()} stopped with an error (its output says why)")


def _failed_processes(failed: bool) -> list[int]:
    """The ids of the processes that say they failed (each says whether it did); on one process
    (none joined), nothing is exchanged and no device touched."""
    if not jax.distributed.is_initialized():
        return [0] if failed else []
    return np.flatnonzero(multihost_utils.process_allgather(np.int32(failed))).tolist()

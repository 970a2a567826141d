"""Tensor parallelism (tests/multi_device) on 4 forced CPU devices, in subprocesses: XLA_FLAGS
must be set before jax starts, and this suite runs on one device. The multi-device tests run in
three groups, so that pytest-xdist's workers run them side by side."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builders import subprocess_xla_flags

ROOT = Path(__file__).resolve().parents[1]
MULTI = Path("tests") / "multi_device"


def _node_ids(name: str) -> list[str]:
    """The test functions of tests/multi_device/``name`` as pytest node ids."""
    path = MULTI / name
    return [f"{path}::{test}" for test in re.findall(r"^def (test_\w+)", (ROOT / path).read_text(), re.M)]


_SPLIT = _node_ids("test_tensor_parallel.py")
GROUPS = {"split_even": _SPLIT[0::2], "split_odd": _SPLIT[1::2],
          "training": _node_ids("test_tensor_parallel_training.py")}


def test_the_groups_hold_every_multi_device_test():
    files = sorted(p.name for p in (ROOT / MULTI).glob("test_*.py"))
    assert files == ["test_tensor_parallel.py", "test_tensor_parallel_training.py"]
    assert sorted(sum(GROUPS.values(), [])) == sorted(_node_ids(files[0]) + _node_ids(files[1]))


@pytest.mark.parametrize("group", list(GROUPS))
def test_tensor_parallel_on_four_cpu_devices(group):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags(4)}
    run = subprocess.run([sys.executable, "-m", "pytest", *GROUPS[group], "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert re.search(r"\b\d+ passed\b", run.stdout) and "skipped" not in run.stdout, output  # 4 devices seen

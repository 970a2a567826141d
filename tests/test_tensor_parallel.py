"""Tensor parallelism (tests/multi_device) on 4 forced CPU devices, in a subprocess: XLA_FLAGS
must be set before jax starts, and this suite runs on one device."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tensor_parallel_on_four_cpu_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/multi_device", "-q", "-x", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert re.search(r"\b\d+ passed\b", run.stdout) and "skipped" not in run.stdout, output  # 4 devices seen

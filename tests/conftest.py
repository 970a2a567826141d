"""Shared fixtures: tiny random HF checkpoints written with transformers (and the z-lab package)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

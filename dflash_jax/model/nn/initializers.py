"""Random weights for tests, benchmarks and training from scratch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float = 0.02) -> jax.Array:
    """normal(0, scale) in f32, then cast to ``dtype``."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

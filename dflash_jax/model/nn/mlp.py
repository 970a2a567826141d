"""The dense SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), gate and up column-fused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model import ops
from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn.initializers import normal


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """SwiGLU of width ``intermediate_size``; ``bias``: the three projections carry biases."""

    intermediate_size: int
    bias: bool = False

    def __post_init__(self):
        if self.intermediate_size < 1:
            raise ConfigError(f"intermediate_size must be >= 1, got {self.intermediate_size}")


@struct.dataclass
class MLPParams:
    """H hidden, I intermediate. ``gate_up_proj`` holds gate | up (one weight stream)."""

    gate_up_proj: jax.Array                  # [H, 2*I]
    down_proj: jax.Array                     # [I, H]
    gate_up_bias: jax.Array | None = None    # [2*I]
    down_bias: jax.Array | None = None       # [H]


def init_mlp(spec: MLPSpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> MLPParams:
    """Random weights (normal(0, scale)), zero biases: for tests and benchmarks."""
    width = spec.intermediate_size
    k_gu, k_down = jax.random.split(key)
    return MLPParams(gate_up_proj=normal(k_gu, (hidden, 2 * width), dtype, scale),
                     down_proj=normal(k_down, (width, hidden), dtype, scale),
                     gate_up_bias=jnp.zeros((2 * width,), dtype) if spec.bias else None,
                     down_bias=jnp.zeros((hidden,), dtype) if spec.bias else None)


def forward(x: jax.Array, params: MLPParams, norm_weight: jax.Array, eps: float, impl: str,
            tensor_axis: str | None = None) -> jax.Array:
    """x + down(silu(gate) * up) of rms_norm(x): the post-attention half of a layer, x [B, T, H]
    (with ``tensor_axis``, the shards' partial products summed before the residual)."""
    h = ops.project(x, params.gate_up_proj, bias=params.gate_up_bias, norm_weight=norm_weight, eps=eps,
                    gated=True, impl=impl)
    return ops.project(h, params.down_proj, bias=params.down_bias, residual=x, sum_over=tensor_axis, impl=impl)


def swiglu(h: jax.Array, params: MLPParams, impl: str, sum_over: str | None = None) -> jax.Array:
    """down(silu(gate) * up) of an already normed h [..., H], no residual. Under tensor
    parallelism a partial sum (a MoE's shared expert, which the MoE block sums with the
    experts'), or with ``sum_over`` the whole (the shards' partial products summed)."""
    g = ops.project(h, params.gate_up_proj, bias=params.gate_up_bias, gated=True, impl=impl)
    return ops.project(g, params.down_proj, bias=params.down_bias, sum_over=sum_over, impl=impl)

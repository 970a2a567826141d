"""DFlash2's grouped dynamic causal convolution around a draft layer's attention and MLP: over
the block's positions only (zeros before its first token, nothing carried across blocks), each
group of ``group_size`` channels mixes the last ``kernel_size`` positions with weights = a learned
base kernel + a per-position, per-group term projected from the sublayer's normed input:

    conv(x, d, base)[t, g, c] = sum_o (base[o, g*gs + c] + d[t, o, g]) * x[t - o, g, c]

The input side (``prepare``) convolves the normed input and hands on the output side's dynamic
term, which ``finish`` applies to the sublayer's output (both from the same normed input)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn.initializers import normal


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """``kernel_size`` positions (the current one and kernel_size - 1 before it), channel groups
    of ``group_size`` sharing one dynamic weight per offset."""

    kernel_size: int
    group_size: int

    def __post_init__(self):
        if self.kernel_size < 1 or self.group_size < 1:
            raise ConfigError(f"conv_kernel_size and conv_group_size must be >= 1, got {self.kernel_size} and "
                              f"{self.group_size}")

    def groups(self, hidden: int) -> int:
        if hidden % self.group_size:
            raise ConfigError(f"conv_group_size {self.group_size} does not divide hidden_size {hidden}")
        return hidden // self.group_size


@struct.dataclass
class ConvParams:
    """H hidden, K kernel size, G groups: base kernels of the input (0) and output (1) sides and
    the projection of the normed input onto both sides' dynamic terms, laid out [side, K, G]."""

    base_kernel: jax.Array          # [2, K, H]
    kernel_projection: jax.Array    # [H, 2*K*G]


def init_conv(spec: ConvSpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> ConvParams:
    """Random weights (normal(0, scale)): for tests and benchmarks."""
    k_base, k_proj = jax.random.split(key)
    width = 2 * spec.kernel_size * spec.groups(hidden)
    return ConvParams(base_kernel=normal(k_base, (2, spec.kernel_size, hidden), dtype, scale),
                      kernel_projection=normal(k_proj, (hidden, width), dtype, scale))


def convolve(x: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """x [B, T, H], dynamic [B, T, K, G], base [K, H] -> [B, T, H] in x's dtype (the reference's
    order: per offset, base * x added, then dynamic * x)."""
    batch, length, hidden = x.shape
    groups = hidden // group_size
    blocks = x.reshape(batch, length, groups, group_size)
    out = jnp.zeros_like(blocks)
    for offset in range(base.shape[0]):
        shifted = blocks if offset == 0 else jnp.pad(blocks[:, :-offset], ((0, 0), (offset, 0), (0, 0), (0, 0)))
        out = out + base[offset].reshape(1, 1, groups, group_size).astype(x.dtype) * shifted
        out = out + dynamic[:, :, offset, :, None] * shifted
    return out.reshape(x.shape)


def prepare(h: jax.Array, params: ConvParams, spec: ConvSpec) -> tuple[jax.Array, jax.Array]:
    """(the convolved normed input h [B, T, H], the output side's dynamic term [B, T, K, G])."""
    groups = spec.groups(h.shape[-1])
    dynamic = (h @ params.kernel_projection).reshape(*h.shape[:-1], 2, spec.kernel_size, groups)
    return convolve(h, dynamic[..., 0, :, :], params.base_kernel[0], spec.group_size), dynamic[..., 1, :, :]


def finish(y: jax.Array, dynamic: jax.Array, params: ConvParams, spec: ConvSpec) -> jax.Array:
    """The sublayer's output y [B, T, H] convolved with the output side's kernel."""
    return convolve(y, dynamic, params.base_kernel[1], spec.group_size)

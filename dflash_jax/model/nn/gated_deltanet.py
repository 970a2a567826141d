"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids: its spec,
its params and its forward around the gated delta rule (``ops.gated_delta_rule``).

Per token: the fused projection of the normed input gives the conv inputs (q | k | v), the output
gate z and the β / decay inputs b, a. The conv inputs pass a causal depthwise convolution (the last
``conv_kernel - 1`` inputs of the sequence are its state) and SiLU; q and k are l2-normalised
(inside the rule); β = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) in f32; the rule updates
the recurrent state S [Hv, dk, dv] and reads o = Sᵀq; o passes an RMSNorm gated by SiLU(z) and
the output projection.

A forward never changes the states: it returns the block's inputs (``PendingBlock``) and the
cache's commit folds the first n of them in (``advance``), so a verify of B tokens of which n
are accepted leaves exactly the state after those n (replay of the accepted prefix from the
pre-verify state; see ``dflash_jax.model.cache``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model import ops
from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn.initializers import normal


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSpec:
    """``num_key_heads`` q/k heads of ``key_dim`` serving ``num_value_heads`` value heads of
    ``value_dim`` (value head j reads key head j // (Hv / Hk)); a causal depthwise convolution
    of ``conv_kernel`` taps over the q | k | v inputs."""

    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4

    def __post_init__(self):
        sizes = (self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim)
        if min(sizes) < 1:
            raise ConfigError(f"linear attention needs linear_num_key_heads, linear_num_value_heads, "
                              f"linear_key_head_dim and linear_value_head_dim >= 1, got {sizes}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"linear_num_value_heads {self.num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {self.num_key_heads}")
        if self.conv_kernel < 1:
            raise ConfigError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_kernel}")

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q | k | v."""
        return 2 * self.key_size + self.value_size

    @property
    def projection_width(self) -> int:
        """Columns of the fused input projection: q | k | v | z | b | a."""
        return self.conv_dim + self.value_size + 2 * self.num_value_heads

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's states in this layer: the f32 recurrent state and the conv
        state (counted at 2 bytes per input, bf16)."""
        return 4 * self.num_value_heads * self.key_dim * self.value_dim + 2 * (self.conv_kernel - 1) * self.conv_dim


@struct.dataclass
class GatedDeltaNetParams:
    """H hidden; C = conv_dim; Hv value heads of dv. HF's in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a read the same input, so they are one column-fused weight (Qwen3-Next's interleaved
    in_proj_qkvz / in_proj_ba are placed into the same columns by the tensor table)."""

    in_proj: jax.Array        # [H, C + Hv*dv + 2*Hv]: q | k | v | z | b | a
    conv_weight: jax.Array    # [C, 1, K] (HF's depthwise Conv1d layout)
    A_log: jax.Array          # [Hv]
    dt_bias: jax.Array        # [Hv]
    norm: jax.Array           # [dv]: the gated RMSNorm's weight (plain, not zero-centred)
    out_proj: jax.Array       # [Hv*dv, H]


@struct.dataclass
class PendingBlock:
    """What a forward over T tokens leaves for the commit (B batch): the pre-conv inputs [B, T, C]
    (the conv state is the last K-1 of them; the commit convolves them again, with the layer's
    ``conv_weight`` [C, 1, K], for the keys and values: recomputing costs less than keeping them),
    decay g and beta [B, T, Hv] f32; the layer's ``spec``."""

    inputs: jax.Array
    conv_weight: jax.Array
    decay: jax.Array
    beta: jax.Array
    spec: GatedDeltaNetSpec = struct.field(pytree_node=False)


def init_gated_deltanet(spec: GatedDeltaNetSpec, hidden: int, key: jax.Array, dtype,
                        scale: float = 0.02) -> GatedDeltaNetParams:
    """Random weights (normal(0, scale)), A = exp(A_log) uniform in [1, 16), dt_bias 1, unit
    norm: for tests and benchmarks."""
    keys = jax.random.split(key, 4)
    hv = spec.num_value_heads
    return GatedDeltaNetParams(
        in_proj=normal(keys[0], (hidden, spec.projection_width), dtype, scale),
        conv_weight=normal(keys[1], (spec.conv_dim, 1, spec.conv_kernel), dtype, 0.5),
        A_log=jnp.log(jax.random.uniform(keys[2], (hv,), jnp.float32, 1.0, 16.0)).astype(dtype),
        dt_bias=jnp.ones((hv,), dtype), norm=jnp.ones((spec.value_dim,), dtype),
        out_proj=normal(keys[3], (spec.value_size, hidden), dtype, scale))


def project(x: jax.Array, params: GatedDeltaNetParams, input_norm: jax.Array, eps: float, impl: str) -> jax.Array:
    """rms_norm(x) @ in_proj: x [B, T, H] -> [B, T, C + Hv*dv + 2*Hv]."""
    return ops.project(x, params.in_proj, norm_weight=input_norm, eps=eps, impl=impl)


def causal_conv(inputs: jax.Array, conv_state: jax.Array, weight: jax.Array) -> jax.Array:
    """SiLU of the causal depthwise convolution of inputs [B, T, C] preceded by conv_state
    [B, K-1, C] (the sequence's previous inputs), weight [C, 1, K]; f32 inside, inputs' dtype out."""
    taps = weight.shape[-1]
    seq = jnp.concatenate([conv_state.astype(inputs.dtype), inputs], axis=1).astype(jnp.float32)
    w = weight[:, 0, :].astype(jnp.float32)
    length = inputs.shape[1]
    out = sum(seq[:, j:j + length] * w[:, j] for j in range(taps))
    return jax.nn.silu(out).astype(inputs.dtype)


def _split(projected: jax.Array, spec: GatedDeltaNetSpec):
    c, vs, hv = spec.conv_dim, spec.value_size, spec.num_value_heads
    return (projected[..., :c], projected[..., c:c + vs], projected[..., c + vs:c + vs + hv],
            projected[..., c + vs + hv:c + vs + 2 * hv])


def split_heads(mixed: jax.Array, spec: GatedDeltaNetSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k [B, T, Hk, dk] and v [B, T, Hv, dv] of the convolved q | k | v [B, T, C]."""
    batch, length, _ = mixed.shape
    ks = spec.key_size
    return (mixed[..., :ks].reshape(batch, length, spec.num_key_heads, spec.key_dim),
            mixed[..., ks:2 * ks].reshape(batch, length, spec.num_key_heads, spec.key_dim),
            mixed[..., 2 * ks:].reshape(batch, length, spec.num_value_heads, spec.value_dim))


def mix(projected: jax.Array, params: GatedDeltaNetParams, spec: GatedDeltaNetSpec, conv_state: jax.Array,
        recurrent_state: jax.Array, impl: str) -> tuple[jax.Array, PendingBlock]:
    """The rule's output o [B, T, Hv, dv] of tokens whose projection is ``projected`` [B, T, W],
    continuing from conv_state [B, K-1, C] and recurrent_state [B, Hv, dk, dv] (f32), and the
    block's inputs for the commit. The states are not changed."""
    inputs, _, b, a = _split(projected, spec)
    q, k, v = split_heads(causal_conv(inputs, conv_state, params.conv_weight), spec)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    decay = -jnp.exp(params.A_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + params.dt_bias.astype(jnp.float32))
    out, _ = ops.gated_delta_rule(q, k, v, decay, beta, recurrent_state, with_state=False, impl=impl)
    return out, PendingBlock(inputs=inputs, conv_weight=params.conv_weight, decay=decay, beta=beta, spec=spec)


def output(x: jax.Array, out: jax.Array, projected: jax.Array, params: GatedDeltaNetParams,
           spec: GatedDeltaNetSpec, eps: float, impl: str, tensor_axis: str | None = None) -> jax.Array:
    """x + out_proj(rms_norm(o) * w * silu(z)) for the rule's output o [B, T, Hv, dv], rounded
    as transformers' Qwen3_5RMSNormGated (norm in f32, weight in the input dtype, gate in f32);
    with ``tensor_axis``, the shards' partial products summed before the residual."""
    _, z, _, _ = _split(projected, spec)
    o = out.astype(jnp.float32)
    normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)).astype(out.dtype) * params.norm
    gate = jax.nn.silu(z.reshape(out.shape).astype(jnp.float32))
    gated = (normed.astype(jnp.float32) * gate).astype(out.dtype)
    return ops.project(gated.reshape(*gated.shape[:2], -1), params.out_proj, residual=x, sum_over=tensor_axis,
                       impl=impl)


def advance(pending: PendingBlock, conv_state: jax.Array, recurrent_state: jax.Array, counts: jax.Array,
            impl: str) -> tuple[jax.Array, jax.Array]:
    """The states after the first counts[b] (0..T) tokens of ``pending`` of each sequence: the
    rest are masked out of the rule (β = 0, g = 0 leave the state as it is) and the conv state is
    the K-1 inputs that end at the last counted token."""
    length = pending.inputs.shape[1]
    counted = jnp.arange(length)[None, :] < counts[:, None]
    decay = jnp.where(counted[..., None], pending.decay, 0.0)
    beta = jnp.where(counted[..., None], pending.beta, 0.0)
    _, k, v = split_heads(causal_conv(pending.inputs, conv_state, pending.conv_weight), pending.spec)
    # (zeroed too: a non-finite uncommitted token must not reach the state through 0 * inf)
    k = jnp.where(counted[..., None, None], k, 0)
    v = jnp.where(counted[..., None, None], v, 0)
    _, recurrent_state = ops.gated_delta_rule(k, k, v, decay, beta, recurrent_state, with_output=False, impl=impl)
    history = jnp.concatenate([conv_state, pending.inputs.astype(conv_state.dtype)], axis=1)
    width = conv_state.shape[1]
    conv_state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width, axis=0))(history, counts)
    return conv_state, recurrent_state

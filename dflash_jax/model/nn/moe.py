"""The mixture-of-experts feed-forward block (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, gpt-oss): a
softmax router picks ``top_k`` of ``num_experts`` SwiGLU experts per token, whose outputs are
summed with the router's weights; the Qwen3.5 / Qwen3-Next variants add a shared SwiGLU expert
scaled by a sigmoid gate; gpt-oss adds biases to the router and the experts and clamps its SwiGLU,
and keeps its experts in MXFP4 (``MoESpec.mxfp4``: decoded in the experts' kernel as it reads them).
The experts run as a grouped matmul over (token, expert) pairs sorted by expert (``ops``)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model import ops
from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn import mlp
from dflash_jax.model.nn.initializers import normal
from dflash_jax.model.nn.mlp import MLPParams, MLPSpec, init_mlp
from dflash_jax.model.collectives import sum_partials
from pallas_kernels import Mxfp4Weight, rms_norm

# The E8M0 scale that gives random MXFP4 weights about a normal(0, 0.02)'s spread: E2M1 codes drawn
# uniformly have an RMS of about 2.9, and 2.9 * 2^(120 - 127) ~ 0.023.
_RANDOM_MXFP4_SCALE = 120


@dataclasses.dataclass(frozen=True)
class IndependentRouting:
    """Benchmarks only (``MoESpec.routing``): each token's top_k experts drawn independently of
    every other token's instead of the router's choice, without replacement, expert e drawn with
    weight proportional to 1 / (e + 1)^``skew`` (0: uniform). The draw is Gumbel-top-k with noise
    hashed from the bits of the token's router input: equal rows get equal experts, rows that
    differ independent draws; the same on every shard of a split model (each routes every token
    from the same replicated rows). Random router weights route the tokens of a verify block far
    more alike than a trained router, so they read fewer experts than a real model would."""

    skew: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.skew) and self.skew >= 0):
            raise ConfigError(f"independent routing's skew must be a finite number >= 0, got {self.skew}")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """``num_experts`` experts of width ``intermediate_size`` (HF ``moe_intermediate_size``),
    ``top_k`` per token (``num_experts_per_tok``). Routing: softmax over all experts in f32,
    the top k, renormalised to sum 1 when ``norm_topk_prob``. ``shared_intermediate_size``: the
    width of a shared expert every token runs (None: none). ``bias``: the router and both expert
    projections carry biases. ``swiglu_limit``: gpt-oss's clamped SwiGLU, (clip(up, +-limit) + 1)
    * g * sigmoid(swiglu_alpha * g) with g = min(gate, limit) (None: silu(gate) * up).
    ``mxfp4``: the routed experts' weights are kept in MXFP4 (``Mxfp4Weight``: 4-bit codes and a
    scale per 32 inputs, as gpt-oss releases them) instead of the params' dtype. ``routing``:
    None (the router's top k), or ``IndependentRouting``, which benchmarks of random weights set
    (the experts drawn per token; the weights still the router's softmax at them)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    shared_intermediate_size: int | None = None
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mxfp4: bool = False
    routing: IndependentRouting | None = None

    def __post_init__(self):
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ConfigError(f"a MoE layer needs num_experts and moe_intermediate_size >= 1, got "
                              f"{self.num_experts} and {self.intermediate_size}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.shared_intermediate_size is not None and self.shared_intermediate_size < 1:
            raise ConfigError(f"shared_expert_intermediate_size must be >= 1, got {self.shared_intermediate_size}")
        if self.mxfp4 and self.intermediate_size % 32:
            raise ConfigError(f"MXFP4 experts need an expert width that is a multiple of 32 (one scale per 32 "
                              f"inputs of the down projection), got {self.intermediate_size}")


@struct.dataclass
class MoEParams:
    """H hidden, E experts, I expert width; each expert's gate | up fused as in ``MLPParams``,
    the experts stacked on a leading axis (HF stores one tensor per expert), in the params' dtype
    or (``MoESpec.mxfp4``) as ``Mxfp4Weight``s of those logical shapes. The shared expert (S
    wide), when the spec has one, is an ``MLPParams`` with its gate's weight."""

    router: jax.Array                      # [H, E]
    gate_up_proj: jax.Array | Mxfp4Weight  # [E, H, 2*I]
    down_proj: jax.Array | Mxfp4Weight     # [E, I, H]
    shared: MLPParams | None = None        # gate_up [H, 2*S], down [S, H]
    shared_gate: jax.Array | None = None   # [H, 1]
    router_bias: jax.Array | None = None   # [E]
    gate_up_bias: jax.Array | None = None  # [E, 2*I]
    down_bias: jax.Array | None = None     # [E, H]


def _random_mxfp4(key: jax.Array, shape: tuple[int, int, int]) -> Mxfp4Weight:
    """Random MXFP4 weights of logical ``shape`` [E, K, N]: uniform codes, one scale throughout."""
    e, k, n = shape
    blocks = jax.random.bits(key, (e, k // 2, n), jnp.uint8)
    return Mxfp4Weight(blocks, jnp.full((e, k // 32, n), _RANDOM_MXFP4_SCALE, jnp.uint8))


def init_moe(spec: MoESpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> MoEParams:
    """Random weights (normal(0, scale); MXFP4 experts: uniform codes of about a 0.02 spread),
    zero biases: for tests and benchmarks."""
    e, i = spec.num_experts, spec.intermediate_size
    zeros = lambda *shape: jnp.zeros(shape, dtype) if spec.bias else None  # noqa: E731
    experts = _random_mxfp4 if spec.mxfp4 else (lambda k, shape: normal(k, shape, dtype, scale))
    keys = jax.random.split(key, 5)
    shared = shared_gate = None
    if spec.shared_intermediate_size is not None:
        shared = init_mlp(MLPSpec(spec.shared_intermediate_size), hidden, keys[3], dtype, scale)
        shared_gate = normal(keys[4], (hidden, 1), dtype, scale)
    return MoEParams(router=normal(keys[0], (hidden, e), dtype, scale),
                     gate_up_proj=experts(keys[1], (e, hidden, 2 * i)), down_proj=experts(keys[2], (e, i, hidden)),
                     shared=shared, shared_gate=shared_gate,
                     router_bias=zeros(e), gate_up_bias=zeros(e, 2 * i), down_bias=zeros(e, hidden))


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 in which every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _row_hashes(h: jax.Array) -> jax.Array:
    """A uint32 hash [N] of each row's bits of h [N, H]: equal rows hash equal; rows that differ in
    one element always differ, in several collide with probability about 2^-32."""
    n = h.shape[0]
    if h.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(h, jnp.uint32).reshape(n, -1)
    else:
        bits = jax.lax.bitcast_convert_type(h, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[h.dtype.itemsize])
        bits = bits.astype(jnp.uint32)
    position = jnp.arange(bits.shape[1], dtype=jnp.uint32)
    # per element a bijection of its bits (odd multiplier), salted by its position; summed mod 2^32
    terms = _mix32(bits * jnp.uint32(0x9E3779B1) + _mix32(position + jnp.uint32(0x632BE5AB)))
    return _mix32(jnp.sum(terms, axis=1, dtype=jnp.uint32))


def independent_experts(h: jax.Array, num_experts: int, top_k: int, skew: float) -> jax.Array:
    """``IndependentRouting``'s experts [N, k] int32 of rows h [N, H]: the top k of log p_e + g,
    p_e = 1 / (e + 1)^skew, g standard Gumbel noise hashed from the row's bits and e (Gumbel-top-k:
    k draws without replacement, each in proportion to p among the experts not yet drawn)."""
    expert = jnp.arange(num_experts, dtype=jnp.uint32)
    keys = _mix32(_mix32(_row_hashes(h)[:, None] + expert * jnp.uint32(0x85EBCA77)) ^ jnp.uint32(0x27D4EB2F))
    uniform = ((keys >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    scores = -jnp.log(-jnp.log(uniform)) - skew * jnp.log1p(expert.astype(jnp.float32))
    return jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)


def route(h: jax.Array, router: jax.Array, spec: MoESpec,
          router_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(experts [N, k] int32, weights [N, k] in h's dtype) of tokens h [N, H], as transformers'
    router: logits (+ bias) in h's dtype, softmax in f32, top k, renormalised when
    ``norm_topk_prob`` (gpt-oss's softmax over the top k logits is the same numbers). With
    ``spec.routing``, the experts are ``independent_experts`` and the weights the softmax at them,
    renormalised the same way."""
    logits = h @ router
    if router_bias is not None:
        logits = logits + router_bias
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if spec.routing is None:
        weights, experts = jax.lax.top_k(probs, spec.top_k)
    else:
        experts = independent_experts(h, spec.num_experts, spec.top_k, spec.routing.skew)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights.astype(h.dtype)


def _held_pairs(experts: jax.Array, held: int, first: jax.Array) -> jax.Array:
    """The expert ids [N, k] of (token, expert) pairs as the shard holding experts first .. first +
    held - 1 runs them: local ids, and -1 for a pair routed to another shard (which the experts'
    kernel and reference skip: no rows, no weights read)."""
    local = experts - first
    return jnp.where((local >= 0) & (local < held), local, -1).astype(jnp.int32)


def forward(x: jax.Array, params: MoEParams, spec: MoESpec, norm_weight: jax.Array, eps: float,
            impl: str, tensor_axis: str | None = None) -> jax.Array:
    """x + the routed experts' weighted sum of rms_norm(x): x [B, T, H]. With ``tensor_axis``
    every shard routes every token, and runs its share of the experts: a slice of every expert's
    width, or (expert parallelism: its weights hold fewer than ``num_experts``) a whole block of
    experts, skipping the pairs routed elsewhere. The routed and shared partial sums are summed
    over the axis once, before the residual."""
    h = rms_norm(x, norm_weight, eps).reshape(-1, x.shape[-1])
    experts, weights = route(h, params.router, spec, params.router_bias)
    held = params.gate_up_proj.shape[0]
    down_bias = params.down_bias
    if tensor_axis is not None and held < spec.num_experts:
        experts = _held_pairs(experts, held, jax.lax.axis_index(tensor_axis) * held)
    elif tensor_axis is not None and down_bias is not None:
        # each shard sums a slice of every expert's width: the output bias is added by one shard
        down_bias = jnp.where(jax.lax.axis_index(tensor_axis) == 0, down_bias, jnp.zeros((), down_bias.dtype))
    y = ops.routed_experts(h, experts, weights, params.gate_up_proj, params.down_proj, params.gate_up_bias,
                           down_bias, swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha, impl=impl)
    if params.shared is not None:
        # transformers: sigmoid(h @ shared_gate) * shared_mlp(h), added to the routed sum, all in h's dtype
        shared = mlp.swiglu(h, params.shared, impl)
        y = y.astype(h.dtype) + jax.nn.sigmoid(h @ params.shared_gate) * shared
    if tensor_axis is not None:
        y = sum_partials(y.astype(jnp.float32), tensor_axis)
    return x + y.reshape(x.shape).astype(x.dtype)

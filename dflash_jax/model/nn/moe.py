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
from pallas_kernels import Mxfp4Weight

# The E8M0 scale that gives random MXFP4 weights about a normal(0, 0.02)'s spread: E2M1 codes drawn
# uniformly have an RMS of about 2.9, and 2.9 * 2^(120 - 127) ~ 0.023.
_RANDOM_MXFP4_SCALE = 120


@dataclasses.dataclass(frozen=True)
class IndependentRouting:
    """Benchmarks only (``MoESpec.routing``): each token's top_k experts drawn independently of
    every other token's instead of the router's choice, without replacement, expert e drawn with
    weight proportional to 1 / (e + 1)^``skew`` (0: uniform). The draw is Gumbel-top-k with noise
    hashed from the bits of the token's router input (``pallas_kernels.routing``): equal rows
    get equal experts, rows that differ independent draws; the same on every shard of a split model (each routes every token
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


def route(x: jax.Array, norm_weight: jax.Array, eps: float, router: jax.Array, spec: MoESpec,
          router_bias: jax.Array | None = None, impl: str = "reference") -> tuple[jax.Array, jax.Array, jax.Array]:
    """(h [N, H], experts [N, k] int32, weights [N, k] in x's dtype) of rows x [N, H]: h =
    rms_norm(x), then transformers' router (``pallas_kernels.routing.route_reference``): logits
    (+ bias) in x's dtype, softmax in f32, top k, renormalised when ``norm_topk_prob``. With
    ``spec.routing`` the experts are drawn per row (``independent_experts``), the weights still
    the softmax at them."""
    skew = None if spec.routing is None else spec.routing.skew
    return ops.route_experts(x, norm_weight, router, router_bias, top_k=spec.top_k,
                             norm_topk_prob=spec.norm_topk_prob, eps=eps, skew=skew, impl=impl)


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
    h, experts, weights = route(x.reshape(-1, x.shape[-1]), norm_weight, eps, params.router, spec,
                                params.router_bias, impl)
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

"""The attention mixer shared by every family's target layers and the draft's layers: its spec,
its params, and the pieces around the attention itself (fused q|k|v projection with the input
norm, per-head q/k norm + RoPE, output projection + residual). Which keys a query sees (the
paged causal cache of a target, the draft's context plus block, training's anchored blocks) is
the caller's ``attend``: see ``nn.decoder``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.model import ops
from dflash_jax.model.hf_json import ConfigError
from dflash_jax.model.nn import rope
from dflash_jax.model.nn.initializers import normal
from dflash_jax.model.nn.rope import RopeSpec


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Softmax attention: ``num_heads`` query heads over ``num_kv_heads`` key/value heads (GQA) of
    ``head_dim`` dims. ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3; LLaMA has
    none). ``bias``: the q/k/v and o projections carry biases. ``sliding_window``: keys at most
    this many positions back (None: full attention). ``output_gate``: the q projection also
    yields a per-head gate, and the attention output is multiplied by its sigmoid before o_proj
    (Qwen3.5's gated attention). ``sinks``: a learned logit per query head joins the softmax's
    normaliser as a key without a value (gpt-oss)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    qk_norm: bool = True
    bias: bool = False
    sliding_window: int | None = None
    output_gate: bool = False
    sinks: bool = False

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim) < 1:
            raise ConfigError(f"attention needs num_attention_heads, num_key_value_heads and head_dim >= 1, got "
                              f"{self.num_heads}, {self.num_kv_heads}, {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"the rotary dimension {self.rope.rotary_dim} exceeds head_dim {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """Columns of q | k | v in the fused projection (the gate's, if any, follow them)."""
        return self.q_size + 2 * self.kv_size

    @property
    def projection_width(self) -> int:
        return self.qkv_size + (self.q_size if self.output_gate else 0)


@struct.dataclass
class AttentionParams:
    """H hidden, Hq/Hkv heads, D head_dim. q, k and v read the same input, so they are one
    column-fused weight (one weight stream, one kernel per step): ``qkv_proj`` holds q | k | v
    (| gate, with an output gate); HF keeps three tensors and the checkpoint table maps each to
    its columns. Norms and biases are None where the spec has none."""

    qkv_proj: jax.Array                   # [H, (Hq + 2*Hkv)*D (+ Hq*D)]
    o_proj: jax.Array                     # [Hq*D, H]
    q_norm: jax.Array | None = None       # [D]
    k_norm: jax.Array | None = None       # [D]
    qkv_bias: jax.Array | None = None     # [(Hq + 2*Hkv)*D]
    o_bias: jax.Array | None = None       # [H]
    sinks: jax.Array | None = None        # [Hq]

    @property
    def q_size(self) -> int:
        """Hq*D: where k's columns start in ``qkv_proj`` (v's start at q_size + Hkv*D)."""
        return self.o_proj.shape[0]


def init_attention(spec: AttentionSpec, hidden: int, key: jax.Array, dtype, scale: float = 0.02) -> AttentionParams:
    """Random weights (normal(0, scale)), unit norms, zero biases and sinks: for tests and
    benchmarks."""
    qkv_width = spec.projection_width
    k_qkv, k_o = jax.random.split(key)
    norm = lambda: jnp.ones((spec.head_dim,), dtype) if spec.qk_norm else None  # noqa: E731
    bias = lambda n: jnp.zeros((n,), dtype) if spec.bias else None  # noqa: E731
    return AttentionParams(qkv_proj=normal(k_qkv, (hidden, qkv_width), dtype, scale),
                           o_proj=normal(k_o, (spec.q_size, hidden), dtype, scale),
                           q_norm=norm(), k_norm=norm(), qkv_bias=bias(qkv_width), o_bias=bias(hidden),
                           sinks=jnp.zeros((spec.num_heads,), dtype) if spec.sinks else None)


def project_qkv(x: jax.Array, params: AttentionParams, input_norm: jax.Array, eps: float, impl: str) -> jax.Array:
    """rms_norm(x) @ qkv_proj [+ qkv_bias]: x [B, T, H] -> [B, T, (Hq + 2*Hkv)*D (+ Hq*D gate)]."""
    return ops.project(x, params.qkv_proj, bias=params.qkv_bias, norm_weight=input_norm, eps=eps, impl=impl)


def qkv_part(projected: jax.Array, spec: AttentionSpec) -> jax.Array:
    """The q | k | v columns of a layer's projection (without the output gate's)."""
    return projected[..., :spec.qkv_size] if spec.output_gate else projected


def rotary_tables(positions: jax.Array, spec: AttentionSpec, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim / 2] of tokens at ``positions`` [B, T] (equal specs and
    positions make equal tables, which XLA computes once per step for every layer)."""
    return rope.tables(positions, spec.rope, dtype)


def output(x: jax.Array, out: jax.Array, projected: jax.Array, params: AttentionParams, spec: AttentionSpec,
           impl: str, tensor_axis: str | None = None) -> jax.Array:
    """x + o_proj(out [* sigmoid(gate)]) [+ o_bias] for the attention output out [B, T, Hq, D] of
    the layer's projection ``projected`` (the residual is added once, after the projection and
    its bias; with ``tensor_axis``, after the sum of the shards' partial products)."""
    out = out.reshape(*out.shape[:2], -1)
    if spec.output_gate:
        out = out * jax.nn.sigmoid(projected[..., spec.qkv_size:])
    return ops.project(out, params.o_proj, bias=params.o_bias, residual=x, sum_over=tensor_axis, impl=impl)


def paged_causal(qkv: jax.Array, params: AttentionParams, spec: AttentionSpec, positions: jax.Array,
                 k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, eps: float,
                 impl: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A target layer's attention over its paged cache: the tokens' normed and rotated K and V
    are written at ``positions`` [B, T] (contiguous per sequence), then each query attends
    causally (within the window) to everything up to itself. Returns (out [B, T, Hq, D],
    k_pages, v_pages)."""
    cos, sin = rotary_tables(positions, spec, qkv.dtype)
    q, k_pages, v_pages = ops.qkv_norm_rope_write(
        qkv_part(qkv, spec), params.q_norm, params.k_norm, cos, sin, positions, k_pages, v_pages, page_table,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, eps=eps, impl=impl)
    out = ops.verify_attention(q, k_pages, v_pages, page_table, positions[:, 0],
                               sliding_window=spec.sliding_window, sinks=params.sinks, impl=impl)
    return out, k_pages, v_pages


def block_qkv(qkv: jax.Array, params: AttentionParams, spec: AttentionSpec, positions: jax.Array, eps: float,
              impl: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v [B, T, heads, D] of tokens that never enter the cache (the draft's block):
    q and k normed and rotated."""
    cos, sin = rotary_tables(positions, spec, qkv.dtype)
    return ops.qkv_norm_rope(qkv_part(qkv, spec), params.q_norm, params.k_norm, cos, sin, num_heads=spec.num_heads,
                             num_kv_heads=spec.num_kv_heads, eps=eps, impl=impl)

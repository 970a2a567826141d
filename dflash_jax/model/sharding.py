"""Tensor parallelism: how params, cache and logits split over the devices of a 1-D mesh (the
collectives the forward uses are in ``nn.tensor_parallel``).

A prefill or decode chunk runs as one ``jax.shard_map`` program over the mesh axis ``"tp"``: each
device runs the single-device forward on its slices with a *local* config (its share of heads,
widths and vocabulary), and the forward says itself where partial results meet: one ``psum``
after each row-parallel projection (attention's o_proj, Gated DeltaNet's out_proj, the MLP's or
experts' down projection; the residual and bias added once, after it), the vocab-parallel
embedding (each token found on one shard, summed), and the vocab-parallel head (greedy argmax
from each shard's best; sampling on gathered logits). Every Pallas kernel thus runs per shard
with the same reference-vs-kernel dispatch (``ops``) as on one device.

Layout (Megatron): column-parallel weights split by whole head groups (a KV head with its query
heads, a linear key head with its value heads) or whole widths (a gate column with its up
column). Where one weight fuses several parts (q | k | v [| gate], gate | up, Gated DeltaNet's
q | k | v | z | b | a and its conv channels) its columns are stored *shard-major*: shard i's
contiguous block is q_i | k_i | v_i ..., the fused layout of the local config. ``place`` reorders
a checkpoint's single-device layout as it streams (so one checkpoint loads into any degree) and
``unsharded`` restores it (export, comparisons).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.model.config import DraftConfig, LayerSpec, ModelConfig
from dflash_jax.model.nn.attention import AttentionParams, AttentionSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetParams, GatedDeltaNetSpec
from dflash_jax.model.nn.mlp import MLPParams, MLPSpec
from dflash_jax.model.nn.moe import MoEParams, MoESpec
from pallas_kernels import Mxfp4Weight

TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Where a model runs split: a mesh with one axis ``"tp"``. The draft is split the same way,
    or copied whole to every device when ``replicate_draft``. A MoE layer's routed experts are
    split by their width (tensor-parallel, every device a slice of every expert), or dealt out
    whole, E / N experts a device, when ``expert_parallel``."""

    mesh: Mesh
    replicate_draft: bool = False
    expert_parallel: bool = False

    def __post_init__(self):
        if tuple(self.mesh.axis_names) != (TP_AXIS,):
            raise ValueError(f"a tensor-parallel mesh has the one axis {TP_AXIS!r}, got {self.mesh.axis_names}")

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]


def make_mesh(tp: int) -> Mesh:
    """A 1-D mesh over the first ``tp`` devices (of every process: several hosts join one mesh).
    NCCL's NVLink multicast (NVLS) stays off unless the environment turns it on: on shared hosts
    it can take the GPUs out of service (NCCL reads this when its first collective starts)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    devices = jax.devices()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tp {tp} needs {tp} devices; {len(devices)} {devices[0].platform} device(s) are visible "
                         "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


# ----------------------------------------------------------------------------- configs


def _split_fields(spec: LayerSpec, expert_parallel: bool) -> dict[str, int]:
    """The config fields a layer splits by (each must be divisible by the degree)."""
    mixer, ffn = spec.mixer, spec.ffn
    fields = ({"num_key_value_heads": mixer.num_kv_heads} if isinstance(mixer, AttentionSpec)
              else {"linear_num_key_heads": mixer.num_key_heads})
    if isinstance(ffn, MLPSpec):
        fields["intermediate_size"] = ffn.intermediate_size
    else:
        if expert_parallel:
            fields["num_experts"] = ffn.num_experts
        else:
            fields["moe_intermediate_size"] = ffn.intermediate_size
        if ffn.shared_intermediate_size is not None:
            fields["shared_expert_intermediate_size"] = ffn.shared_intermediate_size
    return fields


def _local_layer(spec: LayerSpec, tp: int, expert_parallel: bool) -> LayerSpec:
    mixer, ffn = spec.mixer, spec.ffn
    if isinstance(mixer, AttentionSpec):
        mixer = dataclasses.replace(mixer, num_heads=mixer.num_heads // tp, num_kv_heads=mixer.num_kv_heads // tp)
    else:
        mixer = dataclasses.replace(mixer, num_key_heads=mixer.num_key_heads // tp,
                                    num_value_heads=mixer.num_value_heads // tp)
    if isinstance(ffn, MLPSpec):
        ffn = dataclasses.replace(ffn, intermediate_size=ffn.intermediate_size // tp)
    else:
        shared = ffn.shared_intermediate_size
        # (expert-parallel: every expert whole; the spec keeps num_experts for the routing, and a
        # device's share of the experts is the leading axis of its weights: ``nn.moe``)
        ffn = dataclasses.replace(ffn, intermediate_size=ffn.intermediate_size // (1 if expert_parallel else tp),
                                  shared_intermediate_size=None if shared is None else shared // tp)
    return dataclasses.replace(spec, mixer=mixer, ffn=ffn)


def local_config(config: ModelConfig, tp: int, what: str = "the target", *,
                 expert_parallel: bool = False) -> ModelConfig:
    """What one of ``tp`` shards runs: every layer's heads and widths divided by ``tp`` (routed
    experts whole when ``expert_parallel``), the partial sums meeting over ``"tp"``
    (``tensor_axis``). ValueError naming each config field that ``tp`` does not divide (checked
    before any weight is read)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    fields = {"vocab_size": config.vocab_size}
    for spec in config.layers:
        fields.update({name: value for name, value in _split_fields(spec, expert_parallel).items() if value % tp})
    problems = [f"{name} {value} is not divisible by {tp}" for name, value in fields.items() if value % tp]
    mxfp4_widths = {layer.ffn.intermediate_size for layer in config.layers if getattr(layer.ffn, "mxfp4", False)}
    problems += [f"MXFP4 experts split by width need intermediate_size / tp to be a multiple of 32 (whole scale "
                 f"groups), got {width} / {tp}: take --expert-parallel or --mxfp4-experts dequantize"
                 for width in sorted(mxfp4_widths) if not expert_parallel and (width // tp) % 32]
    if problems:
        raise ValueError(f"{what} cannot be split over tp {tp}: {'; '.join(problems)}")
    return dataclasses.replace(config, layers=tuple(_local_layer(spec, tp, expert_parallel) for spec in config.layers),
                               tensor_axis=TP_AXIS)


def local_draft_config(config: DraftConfig, tensor_parallel: TensorParallel) -> DraftConfig:
    """The draft each shard runs: split like the target, or whole when replicated."""
    if tensor_parallel.replicate_draft:
        return config
    return dataclasses.replace(config, model=local_config(config.model, tensor_parallel.size, "the draft"))


# ----------------------------------------------------------------------------- params layout


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one param splits: its ``spec`` (PartitionSpec over ``"tp"`` or replicated) and, for a
    fused weight, the widths of its ``parts`` along the split axis (stored shard-major)."""

    spec: P
    parts: tuple[int, ...] | None = None

    @property
    def axis(self) -> int | None:
        return next((i for i, name in enumerate(self.spec) if name == TP_AXIS), None)


REPLICATED = LeafLayout(P())
COLUMNS = LeafLayout(P(None, TP_AXIS))
ROWS = LeafLayout(P(TP_AXIS, None))
SPLIT = LeafLayout(P(TP_AXIS))


def _present(leaf, layout: LeafLayout) -> LeafLayout | None:
    return None if leaf is None else layout


def _mlp_layout(params: MLPParams, width: int) -> MLPParams:
    parts = (width, width)
    return MLPParams(gate_up_proj=LeafLayout(P(None, TP_AXIS), parts), down_proj=ROWS,
                     gate_up_bias=_present(params.gate_up_bias, LeafLayout(P(TP_AXIS), parts)),
                     down_bias=_present(params.down_bias, REPLICATED))


def _mixer_layout(params, spec) -> Any:
    if isinstance(spec, AttentionSpec):
        parts = (spec.q_size, spec.kv_size, spec.kv_size) + ((spec.q_size,) if spec.output_gate else ())
        return AttentionParams(qkv_proj=LeafLayout(P(None, TP_AXIS), parts), o_proj=ROWS,
                               q_norm=_present(params.q_norm, REPLICATED), k_norm=_present(params.k_norm, REPLICATED),
                               qkv_bias=_present(params.qkv_bias, LeafLayout(P(TP_AXIS), parts)),
                               o_bias=_present(params.o_bias, REPLICATED), sinks=_present(params.sinks, SPLIT))
    assert isinstance(spec, GatedDeltaNetSpec)
    ks, vs, hv = spec.key_size, spec.value_size, spec.num_value_heads
    return GatedDeltaNetParams(in_proj=LeafLayout(P(None, TP_AXIS), (ks, ks, vs, vs, hv, hv)),
                               conv_weight=LeafLayout(P(TP_AXIS, None, None), (ks, ks, vs)),
                               A_log=SPLIT, dt_bias=SPLIT, norm=REPLICATED, out_proj=ROWS)


def _ffn_layout(params, spec, expert_parallel: bool) -> Any:
    if isinstance(spec, MLPSpec):
        return _mlp_layout(params, spec.intermediate_size)
    assert isinstance(spec, MoESpec)
    width = spec.intermediate_size
    shared = None if params.shared is None else _mlp_layout(params.shared, spec.shared_intermediate_size)
    if expert_parallel:
        gate_up, down = LeafLayout(P(TP_AXIS, None, None)), LeafLayout(P(TP_AXIS, None, None))
        gate_up_bias, down_bias = LeafLayout(P(TP_AXIS, None)), LeafLayout(P(TP_AXIS, None))
    else:  # the output bias whole on every shard: one shard adds it (``moe.forward``)
        gate_up, down = LeafLayout(P(None, None, TP_AXIS), (width, width)), LeafLayout(P(None, TP_AXIS, None))
        gate_up_bias, down_bias = LeafLayout(P(None, TP_AXIS), (width, width)), REPLICATED
    if spec.mxfp4:  # codes and scales split as the weight: [E, K/2 | K/32, N] beside its [E, K, N]
        gate_up, down = Mxfp4Weight(gate_up, gate_up), Mxfp4Weight(down, down)
    return MoEParams(router=REPLICATED, gate_up_proj=gate_up, down_proj=down, shared=shared,
                     shared_gate=_present(params.shared_gate, REPLICATED),
                     router_bias=_present(params.router_bias, REPLICATED),
                     gate_up_bias=_present(params.gate_up_bias, gate_up_bias),
                     down_bias=_present(params.down_bias, down_bias))


def _replicated(params):
    """A whole copy on every device of each leaf of ``params`` (None: absent)."""
    return None if params is None else jax.tree.map(lambda _: REPLICATED, params)


def _layers_layout(layers, config: ModelConfig, expert_parallel: bool = False) -> tuple:
    # (DFlash2's convolutions act on whole hidden vectors: every device has them)
    return tuple(layer.replace(input_norm=REPLICATED, post_attention_norm=REPLICATED,
                               attention=_mixer_layout(layer.attention, spec.mixer),
                               ffn=_ffn_layout(layer.ffn, spec.ffn, expert_parallel),
                               attention_conv=_replicated(layer.attention_conv), mlp_conv=_replicated(layer.mlp_conv))
                 for layer, spec in zip(layers, config.layers, strict=True))


def target_layout(params, config: ModelConfig, expert_parallel: bool = False):
    """A TargetParams-shaped tree of LeafLayouts (``params`` may be ShapeDtypeStructs): the
    embedding split by vocabulary rows, an untied LM head by vocabulary columns, routed experts
    by width or (``expert_parallel``) whole."""
    return params.replace(embed=ROWS, norm=REPLICATED, lm_head=_present(params.lm_head, COLUMNS),
                          layers=_layers_layout(params.layers, config, expert_parallel))


def draft_layout(params, config: DraftConfig, tensor_parallel: TensorParallel):
    """A DraftParams-shaped tree of LeafLayouts: the layers split like the target's (or all
    replicated); fc, norms, a reduced-vocabulary head and DFlash2's selector replicated."""
    if tensor_parallel.replicate_draft:
        return _replicated(params)
    return params.replace(fc=REPLICATED, hidden_norm=REPLICATED, norm=REPLICATED,
                          lm_head=_present(params.lm_head, REPLICATED), d2t=_present(params.d2t, REPLICATED),
                          selector=_replicated(params.selector), layers=_layers_layout(params.layers, config.model))


def is_layout(x) -> bool:
    return isinstance(x, LeafLayout)


def specs(layout) -> Any:
    """The PartitionSpec tree of a LeafLayout tree."""
    return jax.tree.map(lambda leaf: leaf.spec, layout, is_leaf=is_layout)


def shard_major_order(parts: tuple[int, ...], tp: int) -> np.ndarray:
    """Indices that reorder an axis made of ``parts`` so that shard i's contiguous block holds
    the i-th slice of every part, in order."""
    starts = np.cumsum((0,) + parts[:-1])
    return np.concatenate([np.arange(start + i * (size // tp), start + (i + 1) * (size // tp))
                           for i in range(tp) for start, size in zip(starts, parts)])


def _reordered(array, layout: LeafLayout, tp: int, inverse: bool = False):
    if layout.parts is None or tp == 1:
        return array
    order = shard_major_order(layout.parts, tp)
    if inverse:
        order = np.argsort(order)
    take = np.take if isinstance(array, np.ndarray) else jnp.take
    return take(array, order, axis=layout.axis)


def place(array, layout: LeafLayout, tensor_parallel: TensorParallel) -> jax.Array:
    """One param (a host or device array in the single-device layout) on the mesh: reordered
    shard-major where fused, and each device given only its slice."""
    array = _reordered(array, layout, tensor_parallel.size)
    sharding = NamedSharding(tensor_parallel.mesh, layout.spec)
    if isinstance(array, np.ndarray):
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
    return jax.device_put(array, sharding)


def placed(params, layout, tensor_parallel: TensorParallel):
    """Every param of ``params`` placed (``place``) by its layout tree."""
    return jax.tree.map(lambda x, leaf: None if x is None else place(x, leaf, tensor_parallel), params, layout,
                        is_leaf=lambda x: x is None)


def unsharded(params, layout, tensor_parallel: TensorParallel):
    """Params placed by ``placed``, back in the single-device layout (host numpy arrays): to
    compare them with, or save them as, a model of one device."""
    gather = multihost_utils.process_allgather if jax.process_count() > 1 else np.asarray
    return jax.tree.map(lambda x, leaf: None if x is None else _reordered(np.asarray(gather(x)), leaf,
                                                                           tensor_parallel.size, inverse=True),
                        params, layout, is_leaf=lambda x: x is None)


# ----------------------------------------------------------------------------- cache layout


def cache_specs(cache, tensor_parallel: TensorParallel):
    """A PagedKVCache-shaped tree of PartitionSpecs: pages split by KV heads, Gated DeltaNet
    states by value heads (recurrent) and shard-major channels (conv); a replicated draft's pages
    whole on every device; page table and lengths replicated."""
    split_draft = not tensor_parallel.replicate_draft

    def pool(arrays, spec):
        return tuple(None if x is None else (spec if i < cache.num_target_layers or split_draft else P())
                     for i, x in enumerate(arrays))

    return cache.replace(k=pool(cache.k, P(None, None, TP_AXIS, None)), v=pool(cache.v, P(None, None, TP_AXIS, None)),
                         conv=pool(cache.conv, P(None, None, TP_AXIS)),
                         recurrent=pool(cache.recurrent, P(None, TP_AXIS, None, None)),
                         page_table=P(), lengths=P(),
                         pending=None if cache.pending is None else jax.tree.map(lambda _: P(), cache.pending))


def named(tree, mesh: Mesh):
    """NamedShardings of a PartitionSpec tree."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree, is_leaf=lambda x: isinstance(x, P))


def replicated(tree, tensor_parallel: TensorParallel | None):
    """Inputs of a split program: a copy on every device of the mesh (as they are on one device).
    Each process fills its own devices from its host copy (a mesh may span several processes,
    whose devices no other process can write); an array already replicated is passed as is."""
    if tensor_parallel is None:
        return tree
    sharding = NamedSharding(tensor_parallel.mesh, P())

    def put(x):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda _: host)

    return jax.tree.map(put, tree)

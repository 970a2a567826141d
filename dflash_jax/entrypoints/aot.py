"""Size a TPU slice before renting one: the engine's programs compiled ahead of time for a TPU
topology, on any machine with libtpu (``pip install -e ".[tpu]"``), without a TPU.

    python -m dflash_jax.aot --topology v6e:2x2 --shape qwen3-8b --tp 4 --max-model-len 8192

The model setup is generate's and serve's (``--target DIR [--draft DIR]``, or a named shape of
``dflash_jax.model.shapes``; ``--tp``, ``--max-num-seqs``, ``--max-model-len``, ``--impl``).
Only config.json is read: weights, KV pool and decode state are shapes placed on the topology's
devices. The two programs a server runs are compiled by the real TPU compiler: the largest
prefill call and a decode chunk (DFlash steps with a draft, plain decoding without). Printed per
device: weight bytes, KV pool bytes, each program's temporaries, and per step its bytes accessed,
FLOPs and the roofline time at the device's HBM bandwidth and bf16 peak. XLA's cost analysis
counts a loop's body once, so the decode chunk's figures are one step's.

Exit status: 0 when every program compiles and fits the device's HBM; 2 with the reason when
not (a kernel block too large for VMEM included)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dflash_jax.entrypoints.arguments import IMPLS
from dflash_jax.entrypoints.cli import at_least, exit_with, interrupt_exits

DTYPES = ("bfloat16", "float32")


def aot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.aot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--topology", required=True,
                   help="TPU topology to compile for: v5e:2x2, v6e:2x2, v5p:2x2x1, tpu7x:2x2x1, v4:2x2x1, ...")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--target", help="HF target folder (only its config.json is read)")
    model.add_argument("--shape", help="a named shape of dflash_jax.model.shapes: qwen3-8b, qwen3.5-27b, "
                                       "qwen3-30b-a3b, gpt-oss-20b, ... (target and draft)")
    p.add_argument("--draft", help="DFlash draft folder, with --target (only its config.json is read)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding: the target alone")
    p.add_argument("--tp", type=at_least(1), default=1, help="split the models over this many of the topology's "
                                                             "devices (1: one device)")
    p.add_argument("--replicate-draft", action="store_true", help="with --tp: a whole draft on every device")
    p.add_argument("--expert-parallel", action="store_true", help="with --tp: routed experts dealt out whole")
    p.add_argument("--max-num-seqs", type=at_least(1), default=16, help="slots decoded together")
    p.add_argument("--max-model-len", type=at_least(2), help="context per slot (default: the target's maximum)")
    p.add_argument("--num-pages", type=at_least(1), help="KV pages in the pool (default: every slot at "
                                                         "--max-model-len)")
    p.add_argument("--page-size", type=at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--block-size", type=at_least(2), help="speculation block (default: the draft's)")
    p.add_argument("--chunk-steps", type=at_least(1), default=16, help="decode steps per chunk")
    p.add_argument("--prefill-chunk", type=at_least(1), default=512, help="prompt tokens a row runs per call")
    p.add_argument("--prefill-rows", type=at_least(1), default=8, help="rows of the largest prefill call")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights and KV cache")
    p.add_argument("--impl", choices=IMPLS, default="auto", help="kernels as on a TPU (auto: the TPU kernels)")
    p.add_argument("--json", metavar="FILE", help="also write the figures here as JSON")
    return p


@dataclasses.dataclass
class ProgramReport:
    """One compiled program's per-device figures (bytes, FLOPs; seconds at the device's peaks)."""

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    bytes_accessed: float
    flops: float
    roofline_s: float

    @property
    def peak_bytes(self) -> int:
        """HBM the program needs while it runs: its arguments, its outputs not written over
        donated arguments, its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass
class Sizing:
    """What a setup needs per device of a TPU topology, and whether it fits (``problem`` None)."""

    topology: str
    device_kind: str
    devices: int
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    weight_bytes: int
    kv_pool_bytes: int
    programs: list[ProgramReport]
    problem: str | None


def size_for_topology(target_config, draft_config, *, topology: str, tp: int = 1, max_num_seqs: int = 16,
                      max_model_len: int | None = None, num_pages: int | None = None, page_size: int = 16,
                      block_size: int | None = None, chunk_steps: int = 16, prefill_chunk: int = 512,
                      prefill_rows: int = 8, dtype: str = "bfloat16", impl: str = "auto",
                      replicate_draft: bool = False, expert_parallel: bool = False) -> Sizing:
    """Compile the largest prefill call and a decode chunk of the engine for ``target_config``
    (and ``draft_config``, or None) on ``tp`` devices of a TPU ``topology``; ValueError for a
    setup that cannot be built (bad topology, split, shapes the kernels refuse)."""
    import functools
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    from dflash_jax.model.kernel_shapes import check_kernel_shapes
    from dflash_jax.model.params import init_draft_params, init_target_params
    from dflash_jax.model.sharding import (TP_AXIS, TensorParallel, draft_layout, local_config, local_draft_config,
                                           specs, target_layout)
    from dflash_jax.runtime.decode import (LoopConfig, bucket, default_steps_per_check, engine_chunk, prefill_slots,
                                           state_specs)
    from dflash_jax.runtime.engine.device import empty_state
    from dflash_jax.runtime.engine.request import MAX_STOP_TOKEN_IDS
    from pallas_kernels.tpu.compile import chip_figures, topology_devices

    try:
        devices = topology_devices(topology)
    except ImportError as error:
        raise ValueError(f'compiling for TPUs needs libtpu: pip install -e ".[tpu]" ({error})') from error
    except Exception as error:  # libtpu's own message names what it accepts
        raise ValueError(f"topology {topology!r}: {error}") from error
    if tp > len(devices):
        raise ValueError(f"tp {tp} needs {tp} devices; {topology} has {len(devices)}")
    device = devices[0]
    chip = chip_figures(device)
    hbm, bandwidth, peak_flops = chip["hbm_bytes"], chip["bandwidth_bytes_per_s"], chip["matmul_flops_per_s"]

    mesh_tp = None
    if tp > 1:
        mesh_tp = TensorParallel(Mesh(np.array(devices[:tp]), (TP_AXIS,)), replicate_draft=replicate_draft,
                                 expert_parallel=expert_parallel)
        local_config(target_config, tp, expert_parallel=expert_parallel)
        if draft_config is not None:
            local_draft_config(draft_config, mesh_tp)
    block_size = 1 if draft_config is None else (block_size or draft_config.block_size)
    config = LoopConfig(target=target_config, draft=draft_config, block_size=block_size, impl=impl,
                        tensor_parallel=mesh_tp)
    local = config if mesh_tp is None else config.local()
    dtype = jnp.dtype(dtype)
    with jax.default_device(device):
        check_kernel_shapes(impl, [local.target] + ([local.draft.model] if draft_config else []), page_size,
                            block_size, dtype.itemsize)

    def place(shapes, tree_specs):
        """ShapeDtypeStructs on the topology: split by ``tree_specs`` over the mesh, or on one device."""
        if mesh_tp is None:
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SingleDeviceSharding(device)),
                                shapes)
        return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                 sharding=NamedSharding(mesh_tp.mesh, spec)),
                            shapes, tree_specs)

    def per_device(tree) -> int:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    target_shapes = jax.eval_shape(functools.partial(init_target_params, target_config, jax.random.key(0), dtype))
    target = place(target_shapes, None if mesh_tp is None else specs(target_layout(target_shapes, target_config,
                                                                                    expert_parallel)))
    draft = None
    if draft_config is not None:
        draft_shapes = jax.eval_shape(functools.partial(init_draft_params, draft_config, jax.random.key(1), dtype))
        draft = place(draft_shapes, None if mesh_tp is None else specs(draft_layout(draft_shapes, draft_config,
                                                                                     mesh_tp)))

    max_model_len = max_model_len or target_config.max_position_embeddings
    if max_model_len > target_config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the target's {target_config.max_position_embeddings}")
    pages_per_seq = math.ceil((max_model_len + block_size) / page_size)
    num_pages = num_pages or max_num_seqs * pages_per_seq
    state_shapes = jax.eval_shape(lambda: empty_state(
        target_config, None if draft_config is None else draft_config.model, dtype, jax.random.key(0),
        slots=max_num_seqs, num_pages=num_pages, page_size=page_size, pages_per_seq=pages_per_seq,
        max_model_len=max_model_len, chunk_steps=chunk_steps, block_size=block_size,
        stop_width=MAX_STOP_TOKEN_IDS + 1, tensor_parallel=None))
    state = place(state_shapes, None if mesh_tp is None else state_specs(state_shapes, mesh_tp))
    rows = min(bucket(prefill_rows, per_doubling=1), bucket(max_num_seqs, per_doubling=1))
    chunk = min(bucket(prefill_chunk, per_doubling=1), bucket(max_model_len, per_doubling=1))
    ints = lambda *shape: place(jax.ShapeDtypeStruct(shape, jnp.int32), None if mesh_tp is None else PartitionSpec())  # noqa: E731
    weights = per_device(target) + (0 if draft is None else per_device(draft))
    kv_pool = per_device((state.cache.k, state.cache.v, state.cache.conv, state.cache.recurrent))

    programs = {
        f"prefill ({rows} rows x {chunk} tokens)": lambda: prefill_slots.lower(
            target, draft, state, ints(rows), ints(rows, chunk), ints(rows), config=config),
        ("DFlash step" if draft is not None else "decode step") + f" (bs {max_num_seqs})": lambda: engine_chunk.lower(
            target, draft, state, ints(max_num_seqs), ints(max_num_seqs), ints(max_num_seqs), None, None, ints(),
            config=config,
            num_steps=chunk_steps, steps_per_check=default_steps_per_check(chunk_steps)),
    }
    reports, problem = [], None
    for name, lower in programs.items():
        print(f"compiling {name} for {topology} ...", file=sys.stderr, flush=True)
        try:
            with jax.default_device(device):
                compiled = lower().compile()
        except Exception as error:  # a compiler's refusal is this tool's answer, not a crash
            problem = f"{name} does not compile for {topology}: {str(error).splitlines()[0][:2000]}"
            if "RESOURCE_EXHAUSTED" in problem and "HBM" in problem:
                problem += " (use more devices: --tp, fewer slots or a shorter --max-model-len)"
            break
        memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
        accessed, flops = float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0))
        reports.append(ProgramReport(name, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                                     memory.alias_size_in_bytes, memory.temp_size_in_bytes, accessed, flops,
                                     max(accessed / bandwidth, flops / peak_flops)))
    if problem is None:
        worst = max(reports, key=lambda r: r.peak_bytes)
        if worst.peak_bytes > hbm:
            problem = (f"{worst.name} needs {_gib(worst.peak_bytes)} of HBM per device (weights {_gib(weights)}, KV "
                       f"pool {_gib(kv_pool)}, temporaries {_gib(worst.temp_bytes)}); a device of {topology} has "
                       f"{_gib(hbm)}: use more devices (--tp), fewer slots or a shorter --max-model-len")
    return Sizing(topology, device.device_kind, 1 if mesh_tp is None else tp, hbm, bandwidth, peak_flops, weights,
                  kv_pool, reports, problem)


def run(args: argparse.Namespace) -> int:
    from dflash_jax.model.hf_config import load_draft_config, load_target_config
    from dflash_jax.model.shapes import SHAPES

    if args.shape is not None:
        if args.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {', '.join(SHAPES)}; got {args.shape!r}")
        target_config, draft_config = SHAPES[args.shape]
    else:
        target_config = load_target_config(args.target)
        draft_config = load_draft_config(args.draft) if args.draft else None
    if args.no_draft:
        draft_config = None
    sizing = size_for_topology(
        target_config, draft_config, topology=args.topology, tp=args.tp, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, num_pages=args.num_pages, page_size=args.page_size,
        block_size=args.block_size, chunk_steps=args.chunk_steps, prefill_chunk=args.prefill_chunk,
        prefill_rows=args.prefill_rows, dtype=args.dtype, impl=args.impl, replicate_draft=args.replicate_draft,
        expert_parallel=args.expert_parallel)
    print(f"{sizing.topology}: {sizing.device_kind}, {sizing.devices} device(s); per device {_gib(sizing.hbm_bytes)} "
          f"HBM at {sizing.hbm_bytes_per_s / 1e9:.0f} GB/s, {sizing.bf16_flops / 1e12:.0f} bf16 TFLOP/s")
    print(f"target {args.shape or args.target}" + ("" if draft_config is None else ", with its draft")
          + f", {args.dtype}, {args.max_num_seqs} slots, impl {args.impl}")
    print(f"per device: weights {_gib(sizing.weight_bytes)}, KV pool {_gib(sizing.kv_pool_bytes)}")
    floor = sizing.weight_bytes + sizing.kv_pool_bytes
    print(f"{'program':44} {'temp':>10} {'peak HBM':>10} {'bytes/step':>11} {'GFLOP/step':>11} {'roofline':>9} "
          f"{'vs weights+KV':>13}")
    for r in sizing.programs:
        print(f"{r.name:44} {_gib(r.temp_bytes):>10} {_gib(r.peak_bytes):>10} {r.bytes_accessed / 2**30:>7.2f} GiB "
              f"{r.flops / 1e9:>11.1f} {r.roofline_s * 1e3:>6.2f} ms {r.bytes_accessed / floor:>12.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(sizing) | {"fits": sizing.problem is None}, f, indent=1)
    if sizing.problem is not None:
        print(f"does not fit: {sizing.problem}")
        return 2
    print("fits")
    return 0


@interrupt_exits()
def main(argv: list[str] | None = None) -> int:
    args = aot_parser().parse_args(argv)
    if args.draft and not args.target:
        aot_parser().error("--draft goes with --target")
    try:
        return run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_with(main)

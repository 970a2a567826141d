"""Where the milliseconds of a decode chunk go: per-kernel GPU time from a JAX profiler trace.

Builds the benchmark's model (random weights), runs one chunk of plain decode and one of DFlash
(acceptance replayed), each from a fresh prefill of the ``--context``-token prompts after an
untimed warm-up chunk, under ``jax.profiler``, and summarizes the Perfetto trace: GPU busy time
vs wall time (launch gaps) and the top kernels by total time. Each run traces into a new folder
under ``--out`` and reads only that one; profile.json is rewritten after every mode. XLA's
command buffers (CUDA graphs) are off in this process (``without_command_buffers``).

    PYTHONPATH=. python3 benchmarks/profile_step.py --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import time_chunk  # noqa: E402
from common import (SHAPES, acceptance_rate, add_auto_kernels_option, add_routing_option, check_block_sizes,  # noqa: E402
                    check_positions, check_routing, names_from, output_dir, override_auto_kernels, positive_int,
                    random_models, random_prompts, require_accelerator, run_record, write_json)

from dflash_jax.model.ops import IMPLS  # noqa: E402
from dflash_jax.entrypoints.cli import at_least  # noqa: E402
from dflash_jax.runtime.generation import batch_engine  # noqa: E402
from dflash_jax.model.sharding import TensorParallel, make_mesh  # noqa: E402


MODES = ("decode", "dflash")


def without_command_buffers() -> None:
    """Turn XLA's command buffers (CUDA graphs) off for this process. With them on, jax 0.11.2's
    GPU profiler leaves the CUDA context broken once a trace stops: the next read from the device
    fails with CUDA_ERROR_LAUNCH_FAILED (jax-ml/jax#40260; every shape, tiny included, on an H200
    on 2026-11-30). Kernels run the same code, but each is launched on its own, so the trace's
    launch gaps are those of an engine without CUDA graphs."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() == "gpu":
            raise RuntimeError("on a GPU, profile_step.main runs before anything else in the process starts jax's "
                               "backends: the command-buffer flag is read when they start")
        return
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip()


def kernel_events(trace_dir: Path, first_gpu_only: bool = False) -> list[dict]:
    """Complete events on GPU stream tracks of the one Perfetto trace JAX wrote into ``trace_dir``
    (``first_gpu_only``: of GPU 0's tracks alone, when a split model runs on several)."""
    paths = list(trace_dir.rglob("perfetto_trace.json.gz"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one Perfetto trace in {trace_dir}, found {len(paths)}")
    path = paths[0]
    trace = json.loads(gzip.decompress(path.read_bytes()))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e.get("pid"), e.get("tid")): e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    pids = {e.get("pid"): e["args"].get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in events if e.get("ph") == "X" and "dur" in e and (
        "stream" in names.get((e.get("pid"), e.get("tid")), "").lower()
        or "/device:gpu" in pids.get(e.get("pid"), "").lower())]
    if first_gpu_only:
        gpu = [e for e in gpu if "/device:gpu:0" in pids.get(e.get("pid"), "").lower()]
    return gpu


def summarize(events: list[dict], top: int, sequence_len: int) -> dict:
    """Totals, the top kernels by time, and the first kernels in order (name, µs, gap before µs)."""
    if not events:
        return {"kernels": 0}
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    by_name = collections.Counter()
    counts = collections.Counter()
    for e in events:
        by_name[e["name"][:90]] += e["dur"]
        counts[e["name"][:90]] += 1
    ordered = sorted(events, key=lambda e: e["ts"])
    sequence = [(e["name"][:70], e["dur"], e["ts"] - (p["ts"] + p["dur"]))
                for p, e in zip(ordered, ordered[1:])][:sequence_len]
    # Idle stretches: time no kernel runs (kernels overlap under programmatic dependent launch,
    # so gaps are measured against the latest end so far, not the previous kernel's end).
    gaps, end, last = [], ordered[0]["ts"] + ordered[0]["dur"], ordered[0]
    for e in ordered[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, last["name"][:50], e["name"][:50]))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    gaps.sort(reverse=True)
    idle = sum(g for g, _, _ in gaps)
    # Busy: the time some kernel runs (overlapping kernels counted once).
    return {"kernels": len(events), "busy_ms": (span - idle) / 1e3, "span_ms": span / 1e3,
            "idle_ms": idle / 1e3,
            "idle_over_20us_ms": sum(g for g, _, _ in gaps if g > 20) / 1e3,
            "longest_gaps": [(round(g, 1), before, after) for g, before, after in gaps[:max(1, top // 2)]],
            "top": [(name, round(us / 1e3, 3), counts[name]) for name, us in by_name.most_common(top)],
            "sequence": sequence}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings, every value checked before any device work."""
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="out")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    parser.add_argument("--impl", default="auto", choices=IMPLS)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--context", type=positive_int, default=512)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--top", type=positive_int, default=25)
    parser.add_argument("--modes", type=names_from(MODES), default=",".join(MODES))
    parser.add_argument("--block", type=positive_int, default=None,
                        help="DFlash block size (default: the draft's trained block size)")
    parser.add_argument("--alpha", type=acceptance_rate, default=0.86, help="DFlash replayed acceptance, in [0, 1)")
    parser.add_argument("--sequence", type=at_least(0), default=0, help="print this many kernels in time order")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="split the models over this many devices; GPU 0's kernels are profiled (its "
                             "all-reduces among them)")
    add_auto_kernels_option(parser)
    add_routing_option(parser)
    args = parser.parse_args(argv)
    check_routing(parser, args)
    if args.block is None:
        args.block = SHAPES[args.shape][1].block_size
    elif "dflash" in args.modes:
        check_block_sizes(parser, "--block", [args.block], args.shape)
    else:
        parser.error("--block: only the dflash mode runs blocks; --modes has no dflash")
    block = args.block if "dflash" in args.modes else 1
    check_positions(parser, "--context", [args.context], args.steps * block + 1, args.shape)
    if args.tp > jax.device_count():
        parser.error(f"--tp {args.tp} needs {args.tp} devices; {jax.device_count()} visible")
    return args


def main(argv: list[str] | None = None):
    without_command_buffers()
    args = parse_args(argv)
    require_accelerator(args.shape)
    override_auto_kernels(args.auto_kernels)
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = random_models(args.shape, None if args.tp == 1 else TensorParallel(make_mesh(args.tp)),
                                  args.routing)
    prompts = random_prompts(np.random.default_rng(0), args.batch, args.context, target.config.vocab_size)
    report = run_record(args)
    report["command_buffers"] = False
    save = functools.partial(write_json, args.out / "profile.json", report)
    for name in args.modes:
        use_draft = draft if name == "dflash" else None
        # Every chunk starts from a fresh prefill, so it generates at most steps x block tokens.
        block = args.block if use_draft else 1
        max_new = args.steps * block + 1
        engine = batch_engine(target, use_draft, [len(p) for p in prompts], [max_new],
                              block_size=block if use_draft else None, chunk_steps=args.steps,
                              accept_replay=args.alpha if use_draft else None, impl=args.impl)
        time_chunk(engine, prompts, max_new, 0)  # warm-up
        trace_dir = Path(tempfile.mkdtemp(prefix=f"trace_{name}_", dir=args.out))
        chunk = time_chunk(engine, prompts, max_new, 1, trace_dir)
        engine.close()
        events = kernel_events(trace_dir, first_gpu_only=args.tp > 1)
        if not events and jax.default_backend() == "gpu":
            raise RuntimeError(f"the trace in {trace_dir} holds no GPU kernel events: has the "
                               "profiler's trace format changed?")
        summary = summarize(events, args.top, args.sequence)
        summary["trace_dir"] = str(trace_dir)
        # Wall time of the traced chunk: the profiler's own cost included, so not a timing to quote.
        summary["traced_wall_ms_per_step"] = chunk.seconds / chunk.steps * 1e3
        for key in ("busy_ms", "span_ms", "idle_ms", "idle_over_20us_ms"):
            if key in summary:
                summary[key.replace("_ms", "_ms_per_step")] = summary.pop(key) / chunk.steps
        report[name] = summary
        save()
    for name in args.modes:
        s = report[name]
        print(f"\n== {name}: traced wall {s['traced_wall_ms_per_step']:.2f} ms/step, GPU busy {s.get('busy_ms_per_step', 0):.2f}, "
              f"span {s.get('span_ms_per_step', 0):.2f}, idle {s.get('idle_ms_per_step', 0):.2f} "
              f"({s.get('idle_over_20us_ms_per_step', 0):.2f} in gaps > 20 us), "
              f"kernels/step {s['kernels'] / args.steps:.0f}")
        for gap, before, after in s.get("longest_gaps", []):
            print(f"  gap {gap:8.1f} us  after {before}  before {after}")
        for kname, ms, count in s.get("top", []):
            print(f"  {ms / args.steps:7.3f} ms/step  x{count // args.steps:<4} {kname}")
        for kname, us, gap in s.get("sequence", []):
            print(f"    {us:7.1f} us  gap {gap:6.1f}  {kname}")


if __name__ == "__main__":
    main()

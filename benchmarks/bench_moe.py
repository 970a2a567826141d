"""A MoE layer's routed experts at Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2048, width
768, bf16) or gpt-oss-20b's (32 experts, top 4, hidden and width 2880; bf16, or MXFP4 as released,
where the kernel decodes the codes as it reads them): XLA's grouped matmul (``jax.lax.ragged_dot``, the reference), the Pallas kernel that
reads only the routed experts (``pallas_kernels.gpu.routed_experts``), a gather of the routed
experts' weights then one batched product, and a dense loop over every expert, each against the
bytes the tokens' routing must read (its distinct experts' weights) at the measured copy
bandwidth, in one run (MXFP4: the reference and the kernel; the others index dense weights).

Each timed call runs ``--layers`` layers' experts in turn inside one jitted loop (1.2 GB a layer:
no call finds the last call's weights in L2), each layer's weights their own arrays as in the
model. Each token's experts are drawn uniformly, independently of the other tokens' (what
``--routing independent`` gives the engine benchmarks; a random router routes a block's tokens far
more alike). ``--tunings`` times kernel variants beside the default.

    PYTHONPATH=. python3 benchmarks/bench_moe.py --out $OUT [--tokens 1,8,16,32,128,512]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, copy_bandwidth, copy_ceiling_bytes_per_s, median_seconds, names_from,  # noqa: E402
                    output_dir, positive_int, positive_ints, require_accelerator, run_record, tuning_sets, write_json)

from profile_step import kernel_events, summarize  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from dflash_jax.model.nn.moe import MoESpec, init_moe  # noqa: E402
from pallas_kernels import gpu as pk_gpu  # noqa: E402
from pallas_kernels.gpu.routed_experts import TUNING_ARGS  # noqa: E402

METHODS = ("ragged_dot", "pallas", "gather", "dense_loop")


def gather_experts(x, experts, weights, gate_up, down):
    """Each (token, expert) pair's weights gathered, then one batched product per projection:
    reads the routed experts only, but writes them out again first."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)
    gate, up = jnp.split(jnp.einsum("ph,phi->pi", rows, gate_up[flat]), 2, axis=-1)
    out = jnp.einsum("pi,pih->ph", (jax.nn.silu(gate) * up).astype(x.dtype), down[flat])
    return (out.reshape(n, k, -1) * weights[..., None]).sum(axis=1).astype(x.dtype)


def dense_loop(x, experts, weights, gate_up, down):
    """Every expert over every token, weighted by the routing (zero where not routed): what a
    MoE costs without a grouped matmul."""
    dense_weights = jnp.zeros((x.shape[0], gate_up.shape[0]), x.dtype).at[
        jnp.arange(x.shape[0])[:, None], experts].set(weights)

    def one(e, acc):
        gate, up = jnp.split(x @ gate_up[e], 2, axis=-1)
        return acc + (jax.nn.silu(gate) * up).astype(x.dtype) @ down[e] * dense_weights[:, e][:, None]
    return jax.lax.fori_loop(0, gate_up.shape[0], one, jnp.zeros(x.shape, jnp.float32)).astype(x.dtype)


def methods(tunings: list[dict]) -> dict:
    table = {"ragged_dot": pk.routed_experts_reference, "gather": gather_experts, "dense_loop": dense_loop}
    for tuning in tunings:
        name = "pallas" + ("" if not tuning else " " + json.dumps(tuning, sort_keys=True))
        table[name] = functools.partial(pk_gpu.routed_experts, interpret=jax.default_backend() != "gpu", **tuning)
    return table


def time_method(fn, layers, tokens: int, spec: MoESpec, iterations: int, repeats: int, key,
                trace_dir: Path | None = None) -> tuple[float, int]:
    """(seconds per call, distinct experts routed per layer, mean) for ``tokens`` tokens; with
    ``trace_dir``, one more run under the JAX profiler writes its trace there."""
    hidden = layers[0][0].shape[1]
    keys = jax.random.split(key, 3)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    experts = jnp.argsort(jax.random.uniform(keys[1], (len(layers), tokens, spec.num_experts)), axis=-1)[
        ..., :spec.top_k].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[2], experts.shape), axis=-1).astype(jnp.bfloat16)
    rounds = max(1, iterations // len(layers))

    @jax.jit
    def loop(x, experts, weights, layers):
        # the layers one after another, each its own arrays (as in the model): a weight picked by
        # a traced index would be copied out before a kernel call could read it
        def body(i, x):
            for layer, (gate_up, down) in enumerate(layers):
                x = fn(x, experts[layer], weights[layer], gate_up, down)
            return x
        return jax.lax.fori_loop(0, rounds, body, x)

    seconds = median_seconds(lambda: loop(x, experts, weights, layers).block_until_ready(), repeats)
    if trace_dir is not None:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            loop(x, experts, weights, layers).block_until_ready()
    distinct = np.mean([len(np.unique(np.asarray(e))) for e in experts])
    return seconds / (rounds * len(layers)), float(distinct)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="out")
    parser.add_argument("--shape", default="qwen3-30b-a3b",
                        choices=["qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-20b-mxfp4", "tiny-moe", "tiny-gpt-oss-mxfp4"],
                        help="tiny-*: CPU smoke tests")
    parser.add_argument("--tokens", type=positive_ints, default="1,8,16,32,128,512")
    parser.add_argument("--methods", type=names_from(METHODS), default=",".join(METHODS))
    parser.add_argument("--tunings", type=tuning_sets(TUNING_ARGS), default="{}", help="kernel variants, e.g. '{};{\"block_n\": 32}'")
    parser.add_argument("--layers", type=positive_int, default=4, help="layers' weights cycled through")
    parser.add_argument("--iterations", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--dense-loop-max-tokens", type=positive_int, default=32,
                        help="the dense loop reads every expert: time it up to this many tokens")
    parser.add_argument("--profile-tokens", type=positive_ints, default=[],
                        help="token counts whose ragged_dot and default kernel runs are traced too: the time per "
                        "kernel, launch gaps included, goes into the report")
    args = parser.parse_args(argv)
    require_accelerator(args.shape, ("gpu",))
    args.out.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape][0]
    spec = next(layer.ffn for layer in config.layers if isinstance(layer.ffn, MoESpec))
    hidden, width = config.hidden_size, spec.intermediate_size
    copies = copy_bandwidth(8 if args.shape.startswith("tiny") else 1024)
    bandwidth = copy_ceiling_bytes_per_s(copies)
    keys = jax.random.split(jax.random.key(0), args.layers)
    layers = []
    for key in keys:
        params = init_moe(spec, hidden, key, jnp.bfloat16)
        layers.append((params.gate_up_proj, params.down_proj))
    expert_bytes = sum(x.nbytes for x in jax.tree.leaves(layers[0])) / spec.num_experts
    report = run_record(args)
    report.update(copies_GBps=copies, expert_bytes=expert_bytes, cells=[])
    save = functools.partial(write_json, args.out / "bench_moe.json", report)
    usable = ("ragged_dot", "pallas") if spec.mxfp4 else METHODS
    table = {name: fn for name, fn in methods(args.tunings).items()
             if name.split(" ")[0] in args.methods and name.split(" ")[0] in usable}
    for tokens in args.tokens:
        for name, fn in table.items():
            if name == "dense_loop" and tokens > args.dense_loop_max_tokens:
                continue
            traced = tokens in args.profile_tokens and name in ("ragged_dot", "pallas")
            trace_dir = Path(tempfile.mkdtemp(prefix="bench_moe_trace_")) if traced else None
            seconds, distinct = time_method(fn, layers, tokens, spec, args.iterations, args.repeats,
                                            jax.random.key(tokens), trace_dir)
            floor = distinct * expert_bytes / bandwidth
            cell = {"tokens": tokens, "method": name, "us": seconds * 1e6, "experts": distinct,
                    "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds}
            if traced:
                cell["profile"] = summarize(kernel_events(trace_dir), top=12, sequence_len=40)
                print(json.dumps(cell["profile"].get("top", [])), file=sys.stderr, flush=True)
            report["cells"].append(cell)
            save()
            print(f"tokens {tokens:4d} {name:40s} {seconds * 1e6:9.1f} us  ({distinct:5.1f} experts, floor "
                  f"{floor * 1e6:7.1f} us, {floor / seconds:5.2f})", file=sys.stderr, flush=True)
    print(f"\n{report['device']} | jax {report['jax']} | {report['date']} | copy {bandwidth / 1e12:.2f} TB/s | "
          f"{args.shape} experts ({spec.num_experts} x top {spec.top_k}, hidden {hidden}, width {width}, "
          f"{'mxfp4' if spec.mxfp4 else 'bf16'})")
    print("tokens  method                                        us/layer  experts  floor us  fraction")
    for cell in report["cells"]:
        print(f"{cell['tokens']:6d}  {cell['method']:44s} {cell['us']:8.1f} {cell['experts']:8.1f} "
              f"{cell['floor_us']:9.1f} {cell['fraction_of_floor']:9.2f}")


if __name__ == "__main__":
    main()

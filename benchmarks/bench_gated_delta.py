"""The gated delta rule of one Gated DeltaNet layer at Qwen3.5-27B's shape (16 key / 48 value heads
x 128, f32 state, bf16 q/k/v): the Pallas kernels against the jnp references and against the
bytes each use must move at the measured copy bandwidth, in one run.

Uses, per sequence: ``verify`` (T = 16 tokens, outputs only: the state read once), ``commit``
(T = 16, the accepted tokens folded in: state read and written), ``decode`` (T = 1, output and
state), ``prefill`` (T = 512, output and state). Each timed call runs ``--layers`` layers' states
in turn inside one jitted loop (a layer's state at batch 32 is 100 MB: no call finds the last
call's state in L2).

    PYTHONPATH=. python3 benchmarks/bench_gated_delta.py --out $OUT [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, copy_bandwidth, copy_ceiling_bytes_per_s, median_seconds, names_from,  # noqa: E402
                    output_dir, positive_int, positive_ints, require_accelerator, run_record, write_json)

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import gpu as pk_gpu  # noqa: E402

# use -> (tokens, with_output, with_state)
USES = {"verify": (16, True, False), "commit": (16, False, True), "decode": (1, True, True),
        "prefill": (512, True, True)}
METHODS = ("pallas", "reference")


def floor_bytes(spec, batch: int, tokens: int, with_output: bool, with_state: bool) -> int:
    """State read (and written), q/k/v/g/beta read, output written."""
    state = 4 * batch * spec.num_value_heads * spec.key_dim * spec.value_dim
    inputs = 2 * batch * tokens * (2 * spec.key_size + spec.value_size) + 8 * batch * tokens * spec.num_value_heads
    output = 2 * batch * tokens * spec.value_size if with_output else 0
    return state * (2 if with_state else 1) + inputs + output


def time_use(method: str, spec, batch: int, use: str, layers: int, iterations: int, repeats: int) -> float:
    tokens, with_output, with_state = USES[use]
    if method == "pallas":
        fn = functools.partial(pk_gpu.gated_delta_rule, interpret=jax.default_backend() != "gpu")
    else:
        fn = pk.gated_delta_rule_reference if tokens <= 16 else pk.chunked_gated_delta_rule_reference
    keys = jax.random.split(jax.random.key(0), 6)
    hk, hv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_dim, spec.value_dim
    q = jax.random.normal(keys[0], (batch, tokens, hk, dk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, tokens, hk, dk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, tokens, hv, dv), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (batch, tokens, hv), jnp.float32)
    beta = jax.random.uniform(keys[4], (batch, tokens, hv), jnp.float32)
    states = tuple(jax.random.normal(key, (batch, hv, dk, dv), jnp.float32) * 0.1
                   for key in jax.random.split(keys[5], layers))
    rounds = max(1, iterations // layers)

    @functools.partial(jax.jit, donate_argnums=1)
    def loop(v, states):
        def body(_, carry):
            v, states = carry
            new = []
            for state in states:
                out, updated = fn(q, k, v, g, beta, state, with_output=with_output, with_state=with_state)
                v = v if out is None else out      # a dependent chain
                new.append(state if updated is None else updated)
            return v, tuple(new)
        return jax.lax.fori_loop(0, rounds, body, (v, states))

    holder = {"states": states}

    def run():
        out, holder["states"] = loop(v, holder["states"])
        jax.block_until_ready(out)

    return median_seconds(run, repeats) / (rounds * layers)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="out")
    parser.add_argument("--shape", default="qwen3.5-27b", choices=["qwen3.5-27b", "qwen3.5-35b-a3b", "tiny-hybrid"],
                        help="tiny-hybrid: CPU smoke test")
    parser.add_argument("--batches", type=positive_ints, default="1,8,32")
    parser.add_argument("--uses", type=names_from(tuple(USES)), default=",".join(USES))
    parser.add_argument("--methods", type=names_from(METHODS), default=",".join(METHODS))
    parser.add_argument("--layers", type=positive_int, default=8, help="layers' states cycled through")
    parser.add_argument("--iterations", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args(argv)
    require_accelerator(args.shape, ("gpu",))
    args.out.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape][0]
    spec = config.layers[config.recurrent_layers[0]].mixer
    copies = copy_bandwidth(1024 if jax.default_backend() == "gpu" else 8)
    bandwidth = copy_ceiling_bytes_per_s(copies)
    report = {**run_record(args), "shape": args.shape, "copies_GBps": copies, "bandwidth_bytes_per_s": bandwidth,
              "rows": []}
    for use in args.uses:
        for batch in args.batches:
            nbytes = floor_bytes(spec, batch, *USES[use])
            row = {"use": use, "batch": batch, "tokens": USES[use][0], "floor_us": nbytes / bandwidth * 1e6}
            for method in args.methods:
                seconds = time_use(method, spec, batch, use, args.layers, args.iterations, args.repeats)
                row[f"{method}_us"] = seconds * 1e6
                row[f"{method}_fraction_of_floor"] = row["floor_us"] / row[f"{method}_us"]
            report["rows"].append(row)
            print(row, file=sys.stderr, flush=True)
            write_json(args.out / "bench_gated_delta.json", report)
    print(f"\n{args.shape} gated delta rule, one layer | {report['device']} | copy {bandwidth / 1e12:.2f} TB/s")
    print("  use      batch  tokens  floor us" + "".join(f"  {m:>9} us  fraction" for m in args.methods))
    for row in report["rows"]:
        print(f"  {row['use']:<8} {row['batch']:5d} {row['tokens']:7d} {row['floor_us']:9.1f}" + "".join(
            f"  {row[f'{m}_us']:12.1f} {row[f'{m}_fraction_of_floor']:9.2f}" for m in args.methods))


if __name__ == "__main__":
    main()

"""A/B of one ``impl="auto"`` kernel choice: ms per step with the op on and off, in one process.

The same lent GPU model varies by host: the same code measured a bs-32 block-8 DFlash step at
10.3 ms on one H200 and 11.2 ms on another the same day. A change worth a few percent is only
visible against itself on one machine, so this alternates the op on and off
(``ops.AUTO_KERNELS``) for ``--rounds`` rounds, clearing the jit caches between settings,
and prints both columns side by side. Cases are ``batch:block[:context]``; block 0 is plain
decode, otherwise DFlash under acceptance replay at ``--alpha``. Random weights at the Qwen3-8B
shape, as in bench_e2e.py. The JSON is rewritten after every case.

    PYTHONPATH=. python3 benchmarks/ab_kernels.py --op write_kv --cases 1:0,1:16,8:16,32:8 --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import run_loop  # noqa: E402
from common import (SHAPES, acceptance_rate, add_routing_option, check_block_sizes, check_positions,  # noqa: E402
                    check_routing, output_dir, positive_int, random_models, require_accelerator, routing_name,
                    run_record, write_json)

from dflash_jax.model import ops  # noqa: E402


def parse_cases(spec: str) -> list[tuple[int, int, int]]:
    """argparse type: ``batch:block[:context]`` items (context 512 when left out) -> (batch,
    block, context); batch and context >= 1 (blocks are checked against the shape later)."""
    cases = []
    for item in spec.split(","):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
            raise argparse.ArgumentTypeError(f"{item!r}: expected batch:block[:context], e.g. 32:8:4096")
        batch, block, context = (int(f) for f in (*fields, "512")[:3])
        if batch < 1 or context < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: batch and context must be >= 1")
        cases.append((batch, block, context))
    return cases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings, every value checked before any device work."""
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--op", required=True, choices=sorted(ops.AUTO_KERNELS))
    parser.add_argument("--cases", type=parse_cases, default="1:0,1:16,8:16,32:8",
                        help="batch:block[:context],...; block 0: plain decode")
    parser.add_argument("--alpha", type=acceptance_rate, default=0.86, help="in [0, 1)")
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=16, help="decode steps per timed chunk")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    parser.add_argument("--out", type=output_dir, default="out")
    add_routing_option(parser)
    args = parser.parse_args(argv)
    check_routing(parser, args)
    check_block_sizes(parser, "--cases", [block for _, block, _ in args.cases if block], args.shape)
    check_positions(parser, "--cases", [context for _, _, context in args.cases],
                    args.steps * SHAPES[args.shape][1].block_size + 1, args.shape)
    return args


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    require_accelerator(args.shape)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_record(args)
    report.update(op=args.op, alpha=args.alpha, routing=routing_name(args.routing), rows=[])
    save = functools.partial(write_json, args.out / "ab_kernels.json", report)
    rows = report["rows"]
    target, draft = random_models(args.shape, routing=args.routing)
    default = ops.AUTO_KERNELS[args.op]
    try:
        for round_ in range(args.rounds):
            for on in ((True, False) if round_ % 2 == 0 else (False, True)):  # a drift hits both alike
                ops.AUTO_KERNELS[args.op] = on
                jax.clear_caches()
                for batch, block, context in args.cases:
                    result = run_loop(target, draft if block else None, batch, context, block or 1, args.steps,
                                      [args.alpha if block else None], args.repeats, np.random.default_rng(0),
                                      "auto", None)
                    ms = next(iter(result.values()))["ms_per_step"]
                    rows.append({"round": round_, "on": on, "batch": batch, "block": block,
                                 "context": context, "ms_per_step": ms})
                    save()
                    print(f"round {round_} {args.op}={'on' if on else 'off'} bs {batch} block {block} "
                          f"ctx {context}: {ms:.3f} ms/step", file=sys.stderr, flush=True)
    finally:
        ops.AUTO_KERNELS[args.op] = default
    print(f"\n{report['device']} | jax {report['jax']} | {report['date']} | {args.shape}, routing {report['routing']} | "
          f"{args.op}, ms per step by round")
    print(f"| case | {args.op} on | off |\n|---|---|---|")
    for batch, block, context in args.cases:
        def column(on):
            return ", ".join(f"{r['ms_per_step']:.3f}" for r in rows if r["on"] == on and
                             (r["batch"], r["block"], r["context"]) == (batch, block, context))
        name = "plain decode" if not block else f"DFlash block {block}"
        print(f"| bs {batch}, ctx {context}, {name} | {column(True)} | {column(False)} |")


if __name__ == "__main__":
    main()

"""A/B of one ``impl="auto"`` kernel choice: ms per step with the op on and off, in one process.

The same lent GPU model varies by host: the same code measured a bs-32 block-8 DFlash step at
10.3 ms on one H200 and 11.2 ms on another the same day. A change worth a few percent is only
visible against itself on one machine, so this alternates the op on and off
(``attention.AUTO_KERNELS``) for ``--rounds`` rounds, clearing the jit caches between settings,
and prints both columns side by side. Cases are ``batch:block[:context]``; block 0 is plain
decode, otherwise DFlash under acceptance replay at ``--alpha``. Random weights at the Qwen3-8B
shape, as in bench_e2e.py.

    PYTHONPATH=. python3 benchmarks/ab_kernels.py --op write_kv --cases 1:0,1:16,8:16,32:8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import run_loop  # noqa: E402
from common import SHAPES, random_models  # noqa: E402

from dflash_jax import attention  # noqa: E402


def parse_cases(spec: str) -> list[tuple[int, int, int]]:
    """``batch:block[:context]`` items (context 512 when left out) -> (batch, block, context)."""
    cases = []
    for item in filter(None, spec.split(",")):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
            raise SystemExit(f"--cases {item!r}: expected batch:block[:context], e.g. 32:8:4096")
        batch, block, context = (int(f) for f in (*fields, "512")[:3])
        cases.append((batch, block, context))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--op", required=True, choices=sorted(attention.AUTO_KERNELS))
    parser.add_argument("--cases", default="1:0,1:16,8:16,32:8", help="batch:block[:context],...")
    parser.add_argument("--alpha", type=float, default=0.86)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    cases = parse_cases(args.cases)
    target, draft = random_models(args.shape)
    default = attention.AUTO_KERNELS[args.op]
    rows = []
    try:
        for round_ in range(args.rounds):
            for on in (True, False):
                attention.AUTO_KERNELS[args.op] = on
                jax.clear_caches()
                for batch, block, context in cases:
                    result = run_loop(target, draft if block else None, batch, context, block or 1, args.steps,
                                      [args.alpha if block else None], args.repeats, np.random.default_rng(0),
                                      "auto", None)
                    ms = next(iter(result.values()))["ms_per_step"]
                    rows.append({"round": round_, "on": on, "batch": batch, "block": block,
                                 "context": context, "ms_per_step": ms})
                    print(f"round {round_} {args.op}={'on' if on else 'off'} bs {batch} block {block} "
                          f"ctx {context}: {ms:.3f} ms/step", file=sys.stderr, flush=True)
    finally:
        attention.AUTO_KERNELS[args.op] = default
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "op": args.op, "alpha": args.alpha, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_kernels.json").write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']} | jax {report['jax']} | {report['date']} | {args.op}, ms per step by round")
    print(f"| case | {args.op} on | off |\n|---|---|---|")
    for batch, block, context in cases:
        def column(on):
            return ", ".join(f"{r['ms_per_step']:.3f}" for r in rows if r["on"] == on and
                             (r["batch"], r["block"], r["context"]) == (batch, block, context))
        name = "plain decode" if not block else f"DFlash block {block}"
        print(f"| bs {batch}, ctx {context}, {name} | {column(True)} | {column(False)} |")


if __name__ == "__main__":
    main()

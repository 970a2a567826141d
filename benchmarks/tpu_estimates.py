"""Estimates for TPUs, without a TPU: the decode step and the DFlash step at each batch, from the
byte and FLOP counts bench_e2e's roofline uses (weights read once a step, the context's KV, matmul
and attention FLOPs; a MoE's expected routed experts), at each chip's HBM bandwidth and bf16 peak
as libtpu reports them. The split over ``--tp`` chips is one chip's share; all-reduces over ICI
are not counted. These are floors: a real step runs at a fraction of them (bench_e2e on a TPU VM
measures it). The counts are checked against compiled programs' cost analysis by
``python -m dflash_jax.aot`` (benchmarks/RESULTS.md).

    python benchmarks/tpu_estimates.py --shapes qwen3-8b --chips v5e:2x2=4,v6e:2x2=1,v5p:2x2x1=1
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_e2e import Roofline, expected_tau, nbytes  # noqa: E402
from common import SHAPES, positive_ints, write_json  # noqa: E402
from dflash_jax.loading.models import Draft, Target  # noqa: E402
from dflash_jax.model.params import init_draft_params, init_target_params  # noqa: E402
from pallas_kernels.tpu.compile import chip_figures, topology_devices  # noqa: E402


def shaped_models(shape: str) -> tuple[Target, Draft]:
    """The shape's bf16 target and draft as shapes only (no weights are made)."""
    target_config, draft_config = SHAPES[shape]
    target = jax.eval_shape(functools.partial(init_target_params, target_config, jax.random.key(0), jnp.bfloat16))
    draft = jax.eval_shape(functools.partial(init_draft_params, draft_config, jax.random.key(1), jnp.bfloat16))
    return Target(target_config, target), Draft(draft_config, draft)


def estimate(shape: str, topology: str, tp: int, batches: list[int], context: int, block: int | None,
             alpha: float) -> list[dict]:
    chip = chip_figures(topology_devices(topology)[0])
    target, draft = shaped_models(shape)
    block = block or draft.config.block_size
    roof = Roofline(target, draft, chip, shards=tp, draft_shards=tp)
    weights = (nbytes(target.params) + nbytes(draft.params)) / tp
    tau = expected_tau(alpha, block)
    rows = []
    for batch in batches:
        kv = batch * context * (roof.target_kv_token + roof.draft_kv_token)
        decode, step = roof.verify(batch, context, 1), roof.dflash_step(batch, context, block)
        decode_s, step_s = roof.seconds(decode), roof.seconds(step)
        rows.append({"shape": shape, "topology": topology, "chip": chip["kind"], "tp": tp, "batch": batch,
                     "context": context, "block": block, "alpha": alpha, "tau": tau,
                     "fits": weights + kv < chip["hbm_bytes"], "weights_bytes": weights, "kv_bytes": kv,
                     "decode_bytes": decode.bytes, "decode_flops": decode.flops, "decode_ms": decode_s * 1e3,
                     "decode_tokens_per_s": batch / decode_s,
                     "step_bytes": step.bytes, "step_flops": step.flops, "step_ms": step_s * 1e3,
                     "step_tokens_per_s": batch * tau / step_s, "speedup": tau * decode_s / step_s})
    return rows


def chips(text: str) -> list[tuple[str, int]]:
    """``v5e:2x2=4,v6e:2x2=1``: topologies, each with the chips the models are split over."""
    out = []
    for item in text.split(","):
        topology, _, tp = item.partition("=")
        out.append((topology, int(tp or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-8b", help="comma-separated names of dflash_jax.model.shapes")
    p.add_argument("--chips", type=chips, default=chips("v5e:2x2=4,v6e:2x2=1,v5p:2x2x1=1"),
                   help="topology=chips to split over, comma-separated")
    p.add_argument("--batches", type=positive_ints, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=2048, help="tokens of context per sequence")
    p.add_argument("--block", type=int, help="speculation block (default: the draft's)")
    p.add_argument("--alpha", type=float, default=0.86, help="per-token acceptance for the expected tokens a step")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    rows = [row for shape in args.shapes.split(",") for topology, tp in args.chips
            for row in estimate(shape, topology, tp, args.batches, args.context, args.block, args.alpha)]
    print(f"floors at ctx {args.context}, alpha {args.alpha} (all-reduces not counted)")
    print(f"{'shape':14} {'chip':16} {'tp':>2} {'bs':>3} {'fits':>4} {'decode GiB':>10} {'ms':>6} {'tok/s':>7} "
          f"{'DFlash GiB':>10} {'ms':>6} {'tok/s':>7} {'x':>5}")
    for r in rows:
        print(f"{r['shape']:14} {r['chip']:16} {r['tp']:>2} {r['batch']:>3} {'yes' if r['fits'] else 'no':>4} "
              f"{r['decode_bytes'] / 2**30:>10.2f} {r['decode_ms']:>6.2f} {r['decode_tokens_per_s']:>7.0f} "
              f"{r['step_bytes'] / 2**30:>10.2f} {r['step_ms']:>6.2f} {r['step_tokens_per_s']:>7.0f} "
              f"{r['speedup']:>5.2f}")
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

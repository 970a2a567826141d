"""The decoder layers' projections at Qwen3-8B shape: weight layout and the fused Pallas kernel.

Times the projections of all layers with their real glue (RMSNorm, residual adds, SiLU gate;
attention left out; for a MoE shape, its attention's q|k|v and o alone, without gpt-oss's biases:
``bench_moe.py`` times the experts) at M = 1 / 8 / 16 rows, as ms per pass against the weights' byte floor at
the copy bandwidth measured in the same run, three ways: q/k/v and gate/up as separate weights
(HF's layout) through XLA; fused column-wise (``LayerParams.qkv_proj`` / ``gate_up_proj``)
through XLA; and fused, through ``pallas_kernels.gpu.fused_matmul`` (norm, gate and residual inside
the projection).
``--passes kernel:o+down`` runs only the named projections through the kernel. (Timing single
projections in isolation misleads: XLA merges products that share a weight.) ``--shape tiny``
is a CPU smoke test (the kernel interpreted). matmul.json is rewritten after every pass.

    PYTHONPATH=. python3 benchmarks/bench_matmul.py --out $OUT [--passes fused,kernel,kernel:o]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import (CEILING_SIZES, SHAPES, copy_bandwidth, copy_ceiling_bytes_per_s, median_seconds,  # noqa: E402
                    output_dir, positive_ints, require_accelerator, run_record, tuning_sets, write_json)

from dflash_jax.model.config import ModelConfig  # noqa: E402
from dflash_jax.model.nn.mlp import MLPSpec  # noqa: E402
from dflash_jax.model.nn.moe import MoESpec  # noqa: E402
from pallas_kernels.fused_matmul import fused_matmul_reference  # noqa: E402
from pallas_kernels.gpu.fused_matmul import TUNING_ARGS, fused_matmul, matmul_blocks  # noqa: E402
from pallas_kernels.norm_rope import rms_norm  # noqa: E402

DTYPE = jnp.bfloat16
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def is_dense(config: ModelConfig) -> bool:
    """Every layer a dense SwiGLU (else every layer routed experts, whose projections are not timed here)."""
    return all(isinstance(layer.ffn, MLPSpec) for layer in config.layers)


def is_modelled(config: ModelConfig) -> bool:
    """A shape this benchmark models: every layer softmax attention, and every FFN dense or every
    one routed experts."""
    return not config.recurrent_layers and (is_dense(config) or all(isinstance(layer.ffn, MoESpec)
                                                                    for layer in config.layers))


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """(K, output columns N, gated) of each fused projection: q|k|v and o, and a dense shape's
    gate|up and down."""
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"qkv": (h, q + 2 * kv, False), "o": (q, h, False)}
    if is_dense(config):
        i = config.intermediate_size
        shapes.update(gate_up=(h, i, True), down=(i, h, False))
    return shapes


def layer_weights(key, fused: bool, config: ModelConfig) -> dict:
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    k = jax.random.split(key, 7)
    normal = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(DTYPE)  # noqa: E731
    if fused:  # [K, N], or [K, 2N] for gate|up
        return {name: normal(k[j], (depth, (2 if gated else 1) * n))
                for j, (name, (depth, n, gated)) in enumerate(projection_shapes(config).items())}
    weights = {"q": normal(k[0], (h, q)), "k": normal(k[4], (h, kv)), "v": normal(k[5], (h, kv)), "o": normal(k[1], (q, h))}
    if is_dense(config):
        i = config.intermediate_size
        weights.update(gate=normal(k[2], (h, i)), up=normal(k[6], (h, i)), down=normal(k[3], (i, h)))
    return weights


def kernel_projections(mode: str) -> set[str]:
    """The projections ``mode`` runs through the kernel: all for ``kernel``, the named ones for
    ``kernel:NAME+NAME``, none for ``separate`` and ``fused``; raises ValueError on any other mode."""
    if mode in ("separate", "fused"):
        return set()
    if mode == "kernel":
        return set(PROJECTIONS)
    names = set(mode.partition(":")[2].split("+")) - {""}
    if not mode.startswith("kernel:") or not names or not names <= set(PROJECTIONS):
        raise ValueError(f"unknown pass {mode!r}: separate, fused, kernel or kernel:NAME+NAME of "
                         f"{', '.join(PROJECTIONS)}")
    return names


def pass_modes(text: str) -> list[str]:
    """argparse type: a comma list of ``layers_pass`` modes."""
    modes = text.split(",")
    for mode in modes:
        try:
            kernel_projections(mode)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return modes


def check_tunings(parser: argparse.ArgumentParser, args: argparse.Namespace, config: ModelConfig) -> None:
    """Run the kernel's tiling rule on every (pass, tuning, rows, projection) the run will time,
    so a tuning it refuses stops the run before anything is timed, not after the passes before it."""
    for mode in args.passes:
        missing = kernel_projections(mode) - set(projection_shapes(config)) if mode.startswith("kernel:") else set()
        if missing:
            parser.error(f"--passes {mode}: --shape {args.shape} has no {', '.join(sorted(missing))} projection "
                         "(a MoE shape's experts are timed by bench_moe.py)")
        for name in [p for p in projection_shapes(config) if p in kernel_projections(mode)]:
            k, n, gated = projection_shapes(config)[name]
            for tuning in args.tunings:
                for m in args.rows:
                    try:
                        matmul_blocks(m, k, n, jnp.dtype(DTYPE).itemsize, gated=gated, **tuning)
                    except ValueError as error:
                        parser.error(f"--tunings {json.dumps(tuning)} at {name}, M={m}: {error}")


def layers_pass(mode: str, tuning: dict, config: ModelConfig):
    """All layers' projections with their glue; attention's output is replaced by q (k and v are
    reduced into it with weight 0 so that they are computed). ``mode``: separate | fused | kernel
    (every projection through ``fused_matmul``) | kernel:NAME+NAME (those of qkv, o, gate_up,
    down through the kernel, the rest as in ``fused``). Off a GPU the kernel runs interpreted."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    ones = jnp.ones((config.hidden_size,), DTYPE)
    kernel_for = kernel_projections(mode)
    interpret = jax.default_backend() != "gpu"
    dense = is_dense(config)

    def project(name, x, w, **kw):
        if name in kernel_for:
            return fused_matmul(x, w, **kw, **tuning, interpret=interpret)
        return fused_matmul_reference(x, w, **kw)

    def run(x, layers):
        for w in layers:
            if mode == "separate":
                h = rms_norm(x, ones, 1e-6)
                q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
                x = x + (q + (k.sum() + v.sum()).astype(DTYPE) * 0) @ w["o"]
                if not dense:
                    continue
                h = rms_norm(x, ones, 1e-6)
                x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
                continue
            q, k, v = jnp.split(project("qkv", x, w["qkv"], norm_weight=ones), [q_width, q_width + kv_width], axis=-1)
            x = project("o", q + (k.sum() + v.sum()).astype(DTYPE) * 0, w["o"], residual=x)
            if not dense:
                continue
            h = project("gate_up", x, w["gate_up"], norm_weight=ones, gated=True)
            x = project("down", h, w["down"], residual=x)
        return x
    return jax.jit(run)


def time_layers(mode: str, rows: list[int], bandwidth: float, tuning: dict, config: ModelConfig) -> list[dict]:
    run = layers_pass(mode, tuning, config)
    layers = [layer_weights(jax.random.key(i), mode != "separate", config) for i in range(config.num_layers)]
    jax.block_until_ready(layers)
    weight_bytes = sum(x.size * x.dtype.itemsize for layer in layers for x in layer.values())
    entries = []
    for m in rows:
        x = jax.random.normal(jax.random.key(3), (m, config.hidden_size), DTYPE)
        seconds = median_seconds(lambda: run(x, layers).block_until_ready(), 7)
        entry = {"weights": mode, "tuning": tuning, "m": m, "ms": seconds * 1e3, "weight_bytes": weight_bytes,
                 "floor_ms": weight_bytes / bandwidth * 1e3}
        entries.append(entry)
        print(f"{mode:9s} {json.dumps(tuning) if tuning else ''} M={m:<3d} {entry['ms']:6.2f} ms, floor {entry['floor_ms']:.2f} "
              f"({entry['floor_ms'] / entry['ms']:.0%})", flush=True)
    return entries


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="out")
    parser.add_argument("--shape", default="qwen3-8b", help="tiny: CPU smoke test",
                        choices=sorted(name for name, (config, _) in SHAPES.items() if is_modelled(config)))
    parser.add_argument("--rows", type=positive_ints, default="1,8,16")
    parser.add_argument("--passes", type=pass_modes, default="separate,fused,kernel", help="whole-pass modes to time")
    parser.add_argument("--tunings", type=tuning_sets(TUNING_ARGS), default="{}", help="';'-separated JSON keyword sets for the kernel "
                        "passes (e.g. '{};{\"block_k\": 64}'), each timed")
    args = parser.parse_args(argv)
    config = SHAPES[args.shape][0]
    check_tunings(parser, args, config)
    require_accelerator(args.shape, ("gpu",))
    args.out.mkdir(parents=True, exist_ok=True)
    copies = copy_bandwidth(CEILING_SIZES[args.shape][0])
    bw = copy_ceiling_bytes_per_s(copies)
    report = run_record(args)
    report.update(copies_GBps=copies, runs=[])
    save = functools.partial(write_json, args.out / "matmul.json", report)
    save()
    print(f"{report['device']}, jax {jax.__version__}, copy {bw / 1e9:.0f} GB/s", flush=True)
    for mode in args.passes:
        for tuning in args.tunings if mode.startswith("kernel") else [{}]:
            report["runs"] += time_layers(mode, args.rows, bw, tuning, config)
            save()


if __name__ == "__main__":
    main()

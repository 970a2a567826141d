"""The decoder layers' projections at Qwen3-8B shape: weight layout and the fused Pallas kernel.

Times the projections of all 36 layers with their real glue (RMSNorm, residual adds, SiLU gate;
attention left out) at M = 1 / 8 / 16 rows, as ms per pass against the weights' byte floor at
the copy bandwidth measured in the same run, three ways: q/k/v and gate/up as separate weights
(HF's layout) through XLA; fused column-wise (``LayerParams.qkv_proj`` / ``gate_up_proj``)
through XLA; and fused, through ``pallas_kernels.fused_matmul`` (norm, gate and residual inside
the projection).
``--passes kernel:o+down`` runs only the named projections through the kernel. (Timing single
projections in isolation misleads: XLA merges products that share a weight.)

    PYTHONPATH=. python3 benchmarks/bench_matmul.py --out $OUT [--passes fused,kernel,kernel:o]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, median_seconds  # noqa: E402

from pallas_kernels.fused_matmul import fused_matmul, fused_matmul_reference  # noqa: E402
from pallas_kernels.norm_rope import rms_norm  # noqa: E402

H, I, Q, KV, LAYERS = 4096, 12288, 4096, 1024, 36
DTYPE = jnp.bfloat16


def layer_weights(key, fused: bool) -> dict:
    k = jax.random.split(key, 7)
    normal = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(DTYPE)  # noqa: E731
    if fused:
        return {"qkv": normal(k[0], (H, Q + 2 * KV)), "o": normal(k[1], (Q, H)),
                "gate_up": normal(k[2], (H, 2 * I)), "down": normal(k[3], (I, H))}
    return {"q": normal(k[0], (H, Q)), "k": normal(k[4], (H, KV)), "v": normal(k[5], (H, KV)),
            "o": normal(k[1], (Q, H)), "gate": normal(k[2], (H, I)), "up": normal(k[6], (H, I)),
            "down": normal(k[3], (I, H))}


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def layers_pass(mode: str, tuning: dict):
    """All layers' projections with their glue; attention's output is replaced by q (k and v are
    reduced into it with weight 0 so that they are computed). ``mode``: separate | fused | kernel
    (every projection through ``fused_matmul``) | kernel:NAME+NAME (those of qkv, o, gate_up,
    down through the kernel, the rest as in ``fused``)."""
    ones = jnp.ones((H,), DTYPE)
    kernel_for = set(PROJECTIONS) if mode == "kernel" else set(mode.partition(":")[2].split("+")) - {""}
    if mode not in ("separate", "fused", "kernel") and (not mode.startswith("kernel:") or
                                                       not kernel_for <= set(PROJECTIONS)):
        raise ValueError(f"unknown pass {mode!r}: separate, fused, kernel or kernel:NAME+NAME of {PROJECTIONS}")

    def project(name, x, w, **kw):
        if name in kernel_for:
            return fused_matmul(x, w, **kw, **tuning)
        return fused_matmul_reference(x, w, **kw)

    def run(x, layers):
        for w in layers:
            if mode == "separate":
                h = rms_norm(x, ones, 1e-6)
                q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
                x = x + (q + (k.sum() + v.sum()).astype(DTYPE) * 0) @ w["o"]
                h = rms_norm(x, ones, 1e-6)
                x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
                continue
            q, k, v = jnp.split(project("qkv", x, w["qkv"], norm_weight=ones), [Q, Q + KV], axis=-1)
            x = project("o", q + (k.sum() + v.sum()).astype(DTYPE) * 0, w["o"], residual=x)
            h = project("gate_up", x, w["gate_up"], norm_weight=ones, gated=True)
            x = project("down", h, w["down"], residual=x)
        return x
    return jax.jit(run)


def time_layers(mode: str, rows: list[int], bandwidth: float, tuning: dict) -> list[dict]:
    layers = [layer_weights(jax.random.key(i), mode != "separate") for i in range(LAYERS)]
    jax.block_until_ready(layers)
    weight_bytes = sum(x.size * x.dtype.itemsize for layer in layers for x in layer.values())
    run = layers_pass(mode, tuning)
    entries = []
    for m in rows:
        x = jax.random.normal(jax.random.key(3), (m, H), DTYPE)
        seconds = median_seconds(lambda: run(x, layers).block_until_ready(), 7)
        entry = {"weights": mode, "tuning": tuning, "m": m, "ms": seconds * 1e3, "floor_ms": weight_bytes / bandwidth * 1e3}
        entries.append(entry)
        print(f"{mode:9s} {json.dumps(tuning) if tuning else ''} M={m:<3d} {entry['ms']:6.2f} ms, floor {entry['floor_ms']:.2f} "
              f"({entry['floor_ms'] / entry['ms']:.0%})", flush=True)
    return entries


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--passes", default="separate,fused,kernel", help="whole-pass modes to time")
    parser.add_argument("--tunings", default="{}", help="';'-separated JSON keyword sets for the kernel "
                        "passes (e.g. '{};{\"block_k\": 64}'), each timed")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copies = copy_bandwidth()
    bw = copies.get("torch_copy_GBps", copies["xla_elementwise_GBps"]) * 1e9
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copies_GBps": copies, "runs": []}
    print(f"{report['device']}, jax {jax.__version__}, copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    for mode in filter(None, args.passes.split(",")):
        for tuning in ([json.loads(t) for t in args.tunings.split(";")] if mode.startswith("kernel") else [{}]):
            report["runs"] += time_layers(mode, rows, bw, tuning)
    (out / "matmul.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Why projections are fused: the decoder layers' projections at Qwen3-8B shape, through XLA.

Times the projections of all 36 layers with their real glue (RMSNorm, residual adds, SiLU gate;
attention left out) at M = 1 / 8 / 16 rows, with q/k/v and gate/up as separate weights (HF's
layout) and fused column-wise (``LayerParams.qkv_proj`` / ``gate_up_proj``), as ms per pass
against the weights' byte floor at the copy bandwidth measured in the same run.

    PYTHONPATH=. python3 benchmarks/bench_matmul.py --out $OUT
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


def layers_pass(fused: bool):
    """All layers' projections with their glue; attention's output is replaced by q (k and v are
    reduced into it with weight 0 so that they are computed)."""
    ones = jnp.ones((H,), DTYPE)

    def run(x, layers):
        for w in layers:
            h = rms_norm(x, ones, 1e-6)
            if fused:
                q, k, v = jnp.split(h @ w["qkv"], [Q, Q + KV], axis=-1)
            else:
                q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
            x = x + (q + (k.sum() + v.sum()).astype(DTYPE) * 0) @ w["o"]
            h = rms_norm(x, ones, 1e-6)
            gate, up = jnp.split(h @ w["gate_up"], 2, axis=-1) if fused else (h @ w["gate"], h @ w["up"])
            x = x + (jax.nn.silu(gate) * up) @ w["down"]
        return x
    return jax.jit(run)


def time_layers(label: str, fused: bool, rows: list[int], bandwidth: float) -> list[dict]:
    layers = [layer_weights(jax.random.key(i), fused) for i in range(LAYERS)]
    weight_bytes = sum(x.size * x.dtype.itemsize for layer in layers for x in layer.values())
    run = layers_pass(fused)
    entries = []
    for m in rows:
        x = jax.random.normal(jax.random.key(3), (m, H), DTYPE)
        seconds = median_seconds(lambda: run(x, layers).block_until_ready(), 7)
        entry = {"weights": label, "m": m, "ms": seconds * 1e3, "floor_ms": weight_bytes / bandwidth * 1e3}
        entries.append(entry)
        print(f"{label:9s} M={m:<3d} {entry['ms']:6.2f} ms, floor {entry['floor_ms']:.2f} "
              f"({entry['floor_ms'] / entry['ms']:.0%})", flush=True)
    return entries


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rows", default="1,8,16")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copies = copy_bandwidth()
    bw = copies.get("torch_copy_GBps", copies["xla_elementwise_GBps"]) * 1e9
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copies_GBps": copies, "runs": []}
    print(f"{report['device']}, jax {jax.__version__}, copy {bw / 1e9:.0f} GB/s", flush=True)
    for label, fused in (("separate", False), ("fused", True)):
        report["runs"] += time_layers(label, fused, [int(r) for r in args.rows.split(",")], bw)
    (out / "matmul.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Skinny projections at Qwen3-8B shapes: XLA's dot against the Pallas skinny matmul.

Two views, both against the copy bandwidth measured in the same run:

- per weight shape (q/k/v separately and fused, o, gate and gate+up, down, LM head, draft fc) at
  M = 1 / 8 / 16 rows: time per call of ``CALLS`` dependent calls in one jit (each call's output,
  cut or tiled to K columns, is the next call's input; that glue is a fused elementwise kernel
  for both), the default Pallas tiling and a few alternatives;
- the projections of all 36 decoder layers with their real glue (RMSNorm, residual adds, SiLU
  gate; attention left out) for separate weights through XLA, fused QKV / gate+up weights through
  XLA, and fused weights through the Pallas kernel: ms per pass against the weights' byte floor.

    PYTHONPATH=. python3 benchmarks/bench_matmul.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import median_time  # noqa: E402
from common import copy_bandwidth  # noqa: E402

from pallas_kernels.matmul import matmul, matmul_reference  # noqa: E402
from pallas_kernels.norm_rope import rms_norm  # noqa: E402

H, I, Q, KV, V, LAYERS = 4096, 12288, 4096, 1024, 151936, 36
SHAPES = {"qkv": (H, Q + 2 * KV), "o": (Q, H), "gate_up": (H, 2 * I), "down": (I, H),
          "lm_head": (H, V), "draft_fc": (5 * H, H)}
CALLS = 64
DTYPE = jnp.bfloat16


def glue(y: jax.Array, k: int) -> jax.Array:
    """Next input [M, K] from an output [M, N]: its first K columns (tiled when N < K)."""
    reps = -(-k // y.shape[1])
    return jnp.tile(y, (1, reps))[:, :k] if reps > 1 else y[:, :k]


def time_shape(mm, x, w) -> float:
    def run(x, w):
        def body(_, x):
            for _ in range(8):
                x = glue(mm(x, w), x.shape[1])
            return x
        return jax.lax.fori_loop(0, CALLS // 8, body, x)
    return median_time(jax.jit(run), (x, w)) / CALLS


def layer_weights(key, fused: bool):
    k = jax.random.split(key, 7)
    normal = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(DTYPE)  # noqa: E731
    if fused:
        return {"qkv": normal(k[0], (H, Q + 2 * KV)), "o": normal(k[1], (Q, H)),
                "gate_up": normal(k[2], (H, 2 * I)), "down": normal(k[3], (I, H))}
    return {"q": normal(k[0], (H, Q)), "k": normal(k[4], (H, KV)), "v": normal(k[5], (H, KV)),
            "o": normal(k[1], (Q, H)), "gate": normal(k[2], (H, I)), "up": normal(k[6], (H, I)),
            "down": normal(k[3], (I, H))}


def layers_pass(mm, fused: bool):
    """All layers' projections with their glue; attention is replaced by the q projection."""
    ones = jnp.ones((H,), DTYPE)

    def run(x, layers):
        for w in layers:
            h = rms_norm(x, ones, 1e-6)
            if fused:
                qkv = mm(h, w["qkv"])
                attn = qkv[:, :Q] + (qkv[:, Q:Q + KV].sum() + qkv[:, Q + KV:].sum()).astype(DTYPE) * 0
            else:
                attn = mm(h, w["q"]) + (mm(h, w["k"]).sum() + mm(h, w["v"]).sum()).astype(DTYPE) * 0
            x = x + mm(attn, w["o"])
            h = rms_norm(x, ones, 1e-6)
            if fused:
                gu = mm(h, w["gate_up"])
                act = jax.nn.silu(gu[:, :I]) * gu[:, I:]
            else:
                act = jax.nn.silu(mm(h, w["gate"])) * mm(h, w["up"])
            x = x + mm(act, w["down"])
        return x
    return jax.jit(run)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--skip", default="", help="comma list of: shapes, layers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    ceiling = copy_bandwidth()
    bw = ceiling.get("torch_copy_GBps", ceiling["xla_elementwise_GBps"]) * 1e9
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "ceilings": ceiling,
              "shapes": [], "layers": []}
    print(f"{report['device']}, jax {jax.__version__}, copy {bw / 1e9:.0f} GB/s", flush=True)

    variants = {"xla": matmul_reference, "pallas": matmul}
    alternatives = [dict(block_n=64, block_k=256, num_stages=3), dict(block_n=128, block_k=128, num_stages=4),
                    dict(block_n=128, block_k=256, num_stages=3), dict(block_n=64, block_k=128, num_stages=6),
                    dict(block_n=32, block_k=256, num_stages=4), dict(block_n=64, block_k=256, num_stages=4, num_splits=1)]
    if "shapes" not in args.skip:
        for (name, (k, n)), m in itertools.product(SHAPES.items(), rows):
            w = jax.random.normal(jax.random.key(1), (k, n), DTYPE)
            x = jax.random.normal(jax.random.key(2), (m, k), DTYPE)
            floor = k * n * 2 / bw
            row = {"shape": name, "m": m, "k": k, "n": n, "floor_us": floor * 1e6}
            for label, mm in variants.items():
                row[label] = time_shape(mm, x, w) * 1e6
            best = min(((time_shape(lambda a, b, c=cfg: matmul(a, b, **c), x, w) * 1e6, cfg)
                        for cfg in alternatives if k % cfg["block_k"] == 0), key=lambda t: t[0])
            row["pallas_best"], row["pallas_best_config"] = best
            report["shapes"].append(row)
            print(f"{name:8s} M={m:<3d} floor {row['floor_us']:6.1f} us | xla {row['xla']:6.1f} "
                  f"({floor * 1e6 / row['xla']:4.0%}) | pallas {row['pallas']:6.1f} "
                  f"({floor * 1e6 / row['pallas']:4.0%}) | best {best[0]:6.1f} "
                  f"({floor * 1e6 / best[0]:4.0%}) {best[1]}", flush=True)
            del w, x

    if "layers" not in args.skip:
        for label, fused, mm in (("xla separate", False, matmul_reference), ("xla fused", True, matmul_reference),
                                 ("pallas fused", True, matmul)):
            layers = [layer_weights(jax.random.key(i), fused) for i in range(LAYERS)]
            weight_bytes = sum(x.size * 2 for layer in layers for x in layer.values())
            for m in rows:
                x = jax.random.normal(jax.random.key(3), (m, H), DTYPE)
                seconds = median_time(layers_pass(mm, fused), (x, layers))
                entry = {"variant": label, "m": m, "ms": seconds * 1e3, "floor_ms": weight_bytes / bw * 1e3}
                report["layers"].append(entry)
                print(f"layers {label:13s} M={m:<3d} {entry['ms']:6.2f} ms, floor {entry['floor_ms']:.2f} "
                      f"({entry['floor_ms'] / entry['ms']:.0%})", flush=True)
            del layers
    (out / "matmul.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

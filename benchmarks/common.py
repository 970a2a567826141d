"""Shared pieces of the GPU benchmarks: Qwen3-8B-shaped configs, ceilings, timing."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from dflash_jax.config import DraftConfig, ModelConfig
from dflash_jax.models import Draft, Target
from dflash_jax.params import init_draft_params, init_target_params

QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                       max_position_embeddings=40960)
DFLASH_DRAFT_8B = DraftConfig(model=dataclasses.replace(QWEN3_8B, num_layers=5, layer_types=()),
                              block_size=16, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33),
                              num_target_layers=36)


def override_auto_kernels(spec: str) -> dict:
    """Apply ``op=on,op=off,...`` to ``attention.AUTO_KERNELS`` (what impl="auto" runs as a
    kernel) for this process, for A/B runs; returns the table in force."""
    from dflash_jax import attention
    for item in filter(None, spec.split(",")):
        op, _, value = item.partition("=")
        if op not in attention.AUTO_KERNELS or value not in ("on", "off"):
            raise SystemExit(f"--auto-kernels {item!r}: expected OP=on|off, OP one of {sorted(attention.AUTO_KERNELS)}")
        attention.AUTO_KERNELS[op] = value == "on"
    return dict(attention.AUTO_KERNELS)


def median_seconds(run, repeats: int) -> float:
    """Median wall time of ``run()`` (which must block until its device work is done)."""
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _xla_pass_seconds(n: int, iters: int, repeats: int) -> float:
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    step = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda i, y: -y, x))
    return median_seconds(lambda: step(x).block_until_ready(), repeats) / iters


def _torch_copy_seconds(n: int, iters: int, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)

    def copies():
        for _ in range(iters):
            b.copy_(a)
        torch.cuda.synchronize()

    return median_seconds(copies, repeats) / iters


def copy_bandwidth(buffer_mib: int = 1024, repeats: int = 5) -> dict:
    """Device copy ceilings in GB/s (bytes read + written) over a bf16 buffer: an XLA elementwise
    pass and, where torch sees a GPU, torch's device-to-device copy (the higher and steadier of
    the two on Hopper; it is the ceiling the benchmarks divide by)."""
    n, iters = buffer_mib << 19, 20
    result = {"xla_elementwise_GBps": 2 * 2 * n / _xla_pass_seconds(n, iters, repeats) / 1e9}
    torch_seconds = _torch_copy_seconds(n, iters, repeats)
    if torch_seconds is not None:
        result["torch_copy_GBps"] = 2 * 2 * n / torch_seconds / 1e9
    return result


def measure_ceilings(buffer_mib: int = 1024, repeats: int = 5) -> dict:
    """Copy bandwidth (``copy_bandwidth``; torch's copy where present) and the bf16 matmul rate
    of a chain of square products timed inside one jit."""
    copies = copy_bandwidth(buffer_mib, repeats)
    bandwidth = copies.get("torch_copy_GBps", copies["xla_elementwise_GBps"]) * 1e9
    size, chain = (8192, 10) if buffer_mib >= 1024 else (512, 10)
    a = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(2), (size, size)) / size ** 0.5).astype(jnp.bfloat16)
    matmuls = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda i, y: y @ b, a))
    seconds = median_seconds(lambda: matmuls(a, b).block_until_ready(), repeats)
    return {"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": chain * 2 * size ** 3 / seconds,
            "copies_GBps": copies}


# CPU smoke-test shape: same structure, minutes -> seconds.
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=40960)
TINY_DRAFT = DraftConfig(model=dataclasses.replace(TINY, num_layers=2, layer_types=()), block_size=16,
                         mask_token_id=511, target_layer_ids=(1, 2), num_target_layers=4)
SHAPES = {"qwen3-8b": (QWEN3_8B, DFLASH_DRAFT_8B), "tiny": (TINY, TINY_DRAFT)}


def random_models(shape: str) -> tuple[Target, Draft]:
    """A bf16 target and draft of ``SHAPES[shape]`` with random weights (speed does not depend
    on their values)."""
    target_config, draft_config = SHAPES[shape]
    target = Target(target_config, jax.jit(init_target_params, static_argnums=(0, 2))(
        target_config, jax.random.key(0), jnp.bfloat16))
    draft = Draft(draft_config, jax.jit(init_draft_params, static_argnums=(0, 2))(
        draft_config, jax.random.key(1), jnp.bfloat16))
    return target, draft

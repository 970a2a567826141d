"""Shared pieces of the GPU benchmarks: Qwen3-8B-shaped configs, argument checks, ceilings,
timing and the run record every JSON output starts with."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.entrypoints.cli import at_least
from dflash_jax.model.hf_config import target_config_from_hf
from dflash_jax.model.config import DraftConfig, ModelConfig, uniform_config
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.dynamic_conv import ConvSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.nn.rope import RopeSpec
from dflash_jax.model.selector import SelectorSpec
from dflash_jax.loading.models import Draft, Target
from dflash_jax.model.params import init_draft_params, init_target_params
from dflash_jax.model.sharding import (TensorParallel, draft_layout, local_config, local_draft_config, named, specs,
                                 target_layout)

QWEN3_8B = uniform_config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                          num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                          max_position_embeddings=40960)
DFLASH_DRAFT_8B = DraftConfig(model=QWEN3_8B.with_layers(QWEN3_8B.layers[:5]), block_size=16,
                              mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36)
# A DFlash2 draft of the same size (z-lab's published DFlash2 settings: kernel 2, groups of 16,
# selector rank 256, top 16): its step against the DFlash draft's is the selector's cost.
DFLASH2_DRAFT_8B = dataclasses.replace(
    DFLASH_DRAFT_8B, model=DFLASH_DRAFT_8B.model.with_layers(tuple(
        dataclasses.replace(layer, conv=ConvSpec(2, 16)) for layer in DFLASH_DRAFT_8B.model.layers)),
    selector=SelectorSpec(rank=256, top_k=16))
# Qwen3-32B (the tensor-parallel benchmark's target): a 5-layer draft of its width, as the 8B's.
QWEN3_32B = uniform_config(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
                           num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                           max_position_embeddings=40960)
DFLASH_DRAFT_32B = DraftConfig(model=QWEN3_32B.with_layers(QWEN3_32B.layers[:5]), block_size=16,
                               mask_token_id=151669, target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64)
# LLaMA-3.1-8B-Instruct: no q/k norms, llama3 RoPE; z-lab's draft: 5 Qwen3 layers, block 10.
LLAMA31_8B = uniform_config(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=False,
                            rope=RopeSpec(theta=500000.0, rotary_dim=128, kind="llama3", factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                            rms_norm_eps=1e-5, max_position_embeddings=131072)
DFLASH_DRAFT_LLAMA31_8B = DraftConfig(
    model=uniform_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=5, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope=LLAMA31_8B.rope, rms_norm_eps=1e-5),
    block_size=10, mask_token_id=128002, target_layer_ids=(1, 8, 15, 22, 29), num_target_layers=32)
# Qwen3-30B-A3B: 48 layers of 128 experts (top 8, width 768); a dense 5-layer Qwen3 draft.
QWEN3_30B_A3B = uniform_config(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                               num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                               ffn=MoESpec(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True))
DFLASH_DRAFT_30B_A3B = DraftConfig(
    model=uniform_config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=5, num_heads=32,
                         num_kv_heads=4, head_dim=128, rope_theta=1e6),
    block_size=16, mask_token_id=151669, target_layer_ids=(1, 12, 23, 34, 45), num_target_layers=48)
# Qwen3.5-27B: 64 layers, every fourth gated attention (24/4 heads x 256, RoPE on 64 dims), the rest
# Gated DeltaNet (16 key / 48 value heads x 128); z-lab's Qwen3.6-27B draft: 5 Qwen3 layers, block 16.
HYBRID_TYPES = lambda n: tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))  # noqa: E731
QWEN35_27B = uniform_config(family="qwen3_5_release", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                            num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256, output_gate=True,
                            rope=RopeSpec(theta=1e7, rotary_dim=64), layer_types=HYBRID_TYPES(64),
                            linear_attention=GatedDeltaNetSpec(16, 48, 128, 128), max_position_embeddings=262144,
                            zero_centred_norms=True)
DFLASH_DRAFT_35_27B = DraftConfig(
    model=uniform_config(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=5, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=1e7),
    block_size=16, mask_token_id=248070, target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64)
# Qwen3.5-35B-A3B-like: 40 layers, 256 experts (top 8, width 512) + a shared expert (512) on each;
# its z-lab draft: 8 Qwen3 layers.
QWEN35_35B_A3B = uniform_config(family="qwen3_5_moe_release", vocab_size=248320, hidden_size=2048, num_layers=40,
                                num_heads=16, num_kv_heads=2, head_dim=256, output_gate=True,
                                rope=RopeSpec(theta=1e7, rotary_dim=64), layer_types=HYBRID_TYPES(40),
                                linear_attention=GatedDeltaNetSpec(16, 32, 128, 128), max_position_embeddings=262144,
                                zero_centred_norms=True,
                                ffn=MoESpec(num_experts=256, top_k=8, intermediate_size=512, norm_topk_prob=True,
                                            shared_intermediate_size=512))
DFLASH_DRAFT_35_35B_A3B = DraftConfig(
    model=uniform_config(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=32,
                         num_kv_heads=4, head_dim=128, rope_theta=1e7),
    block_size=16, mask_token_id=248070, target_layer_ids=(1, 10, 19, 28, 37), num_target_layers=40)
# gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 64/8 heads x 64 with
# sinks and biases, 32 experts (top 4, width 2880, biased, clamped SwiGLU) in MXFP4 as released, or
# dequantised (random bf16 experts); z-lab's draft: 8 Qwen3 layers with attention biases, block 8.


def gpt_oss_shape(**fields) -> ModelConfig:
    return target_config_from_hf({"architectures": ["GptOssForCausalLM"], "max_position_embeddings": 131072,
                                **fields}, "a gpt-oss benchmark shape")


def biased_attention(config: ModelConfig) -> ModelConfig:
    return config.with_layers(tuple(dataclasses.replace(layer, mixer=dataclasses.replace(layer.mixer, bias=True))
                                    for layer in config.layers))


GPT_OSS_20B_MXFP4 = gpt_oss_shape(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                                  vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
                                  num_attention_heads=64, num_key_value_heads=8,
                                  quantization_config={"quant_method": "mxfp4"})
GPT_OSS_20B = GPT_OSS_20B_MXFP4.with_dequantized_experts()
DFLASH_DRAFT_GPT_OSS_20B = DraftConfig(
    model=biased_attention(uniform_config(vocab_size=201088, hidden_size=2880, intermediate_size=7680, num_layers=8,
                                          num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0,
                                          rms_norm_eps=1e-5)),
    block_size=8, mask_token_id=200000, target_layer_ids=(1, 6, 11, 16, 21), num_target_layers=24)
# CPU smoke-test shapes: same structure, minutes -> seconds.
TINY = uniform_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=40960)
TINY_DRAFT = DraftConfig(model=TINY.with_layers(TINY.layers[:2]), block_size=16, mask_token_id=511,
                         target_layer_ids=(1, 2), num_target_layers=4)
TINY_DFLASH2_DRAFT = dataclasses.replace(
    TINY_DRAFT, model=TINY_DRAFT.model.with_layers(tuple(
        dataclasses.replace(layer, conv=ConvSpec(2, 16)) for layer in TINY_DRAFT.model.layers)),
    selector=SelectorSpec(rank=8, top_k=4))
TINY_MOE = uniform_config(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=40960,
                          ffn=MoESpec(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True))
TINY_GPT_OSS_MXFP4 = gpt_oss_shape(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=512,
                                   hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
                                   num_key_value_heads=2, sliding_window=8, quantization_config={"quant_method": "mxfp4"})
TINY_GPT_OSS = TINY_GPT_OSS_MXFP4.with_dequantized_experts()
TINY_HYBRID = uniform_config(family="qwen3_5_release", vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, output_gate=True,
                             rope=RopeSpec(theta=1e7, rotary_dim=8), layer_types=HYBRID_TYPES(4),
                             linear_attention=GatedDeltaNetSpec(2, 4, 16, 16), max_position_embeddings=40960,
                             zero_centred_norms=True)
SHAPES = {"qwen3-8b": (QWEN3_8B, DFLASH_DRAFT_8B), "qwen3-8b-dflash2": (QWEN3_8B, DFLASH2_DRAFT_8B), "qwen3-32b": (QWEN3_32B, DFLASH_DRAFT_32B),
          "llama3.1-8b": (LLAMA31_8B, DFLASH_DRAFT_LLAMA31_8B),
          "qwen3-30b-a3b": (QWEN3_30B_A3B, DFLASH_DRAFT_30B_A3B), "qwen3.5-27b": (QWEN35_27B, DFLASH_DRAFT_35_27B),
          "qwen3.5-35b-a3b": (QWEN35_35B_A3B, DFLASH_DRAFT_35_35B_A3B), "tiny": (TINY, TINY_DRAFT),
          "gpt-oss-20b": (GPT_OSS_20B, DFLASH_DRAFT_GPT_OSS_20B),
          "gpt-oss-20b-mxfp4": (GPT_OSS_20B_MXFP4, DFLASH_DRAFT_GPT_OSS_20B),
          "tiny-moe": (TINY_MOE, TINY_DRAFT), "tiny-hybrid": (TINY_HYBRID, TINY_DRAFT),
          "tiny-gpt-oss": (TINY_GPT_OSS, TINY_DRAFT), "tiny-gpt-oss-mxfp4": (TINY_GPT_OSS_MXFP4, TINY_DRAFT),
          "tiny-dflash2": (TINY, TINY_DFLASH2_DRAFT)}
# Per shape: the copy-bandwidth buffer (MiB) and the side of the square bf16 matmul ceiling, large
# enough to reach the GPU's peak at the real shape and quick on a CPU at the tiny one.
CEILING_SIZES = {"qwen3-8b": (1024, 8192), "qwen3-8b-dflash2": (1024, 8192), "qwen3-32b": (1024, 8192), "llama3.1-8b": (1024, 8192),
                 "qwen3-30b-a3b": (1024, 8192),
                 "qwen3.5-27b": (1024, 8192), "qwen3.5-35b-a3b": (1024, 8192),
                 "gpt-oss-20b": (1024, 8192), "gpt-oss-20b-mxfp4": (1024, 8192), "tiny-gpt-oss-mxfp4": (8, 512),
                 "tiny": (8, 512), "tiny-moe": (8, 512), "tiny-hybrid": (8, 512), "tiny-gpt-oss": (8, 512),
                 "tiny-dflash2": (8, 512)}


# ----------------------------------------------------------------------------- argument checks
# argparse types: a bad value is one ``error:`` line from argparse, before any device work.

positive_int = at_least(1)


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list with no empty items")
    return items


def _distinct(values: list, text: str) -> list:
    """``values`` parsed from ``text``, refused when one repeats (its cells would run twice and
    overwrite each other in the report)."""
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(repeated)} given more than once")
    return values


def positive_ints(text: str) -> list[int]:
    """A comma list of distinct integers >= 1, e.g. ``1,8,32``."""
    return _distinct([positive_int(item) for item in _items(text)], text)


def acceptance_rate(text: str) -> float:
    """A replayed acceptance probability alpha in [0, 1) (expected tau is finite only below 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"alpha must be in [0, 1), got {value}")
    return value


def acceptance_rates(text: str) -> list[float]:
    """A comma list of distinct ``acceptance_rate`` values."""
    return _distinct([acceptance_rate(item) for item in _items(text)], text)


def names_from(choices: Sequence[str], *, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """A type for a comma list of names out of ``choices`` (empty only with ``allow_empty``)."""
    def names(text: str) -> list[str]:
        if not text and allow_empty:
            return []
        items = _distinct(_items(text), text)
        unknown = [name for name in items if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; expected names of {', '.join(choices)}")
        return items
    return names


def tuning_sets(names: Sequence[str]) -> Callable[[str], list[dict]]:
    """An argparse type: ';'-separated JSON objects of a kernel's integer tuning keywords
    ``names`` (e.g. ``{};{"block_k": 64}``), each a variant to time."""
    def parse(text: str) -> list[dict]:
        result = []
        for item in text.split(";"):
            try:
                tuning = json.loads(item)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(f"{item!r} is not valid JSON ({error})") from None
            if not isinstance(tuning, dict) or not set(tuning) <= set(names):
                raise argparse.ArgumentTypeError(f"{item!r}: expected an object of {', '.join(names)}")
            bad = {k: v for k, v in tuning.items() if isinstance(v, bool) or not isinstance(v, int)}
            if bad:
                raise argparse.ArgumentTypeError(f"{item!r}: tuning values must be integers, got {bad}")
            result.append(tuning)
        return result
    return parse


def output_dir(text: str) -> Path:
    """A folder to write results into: it may not exist yet (it is made after every check), but
    it may not be a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return path


def auto_kernel_overrides(text: str) -> dict[str, bool]:
    """``OP=on|off,...`` for ``ops.AUTO_KERNELS`` (what impl="auto" runs as a kernel)."""
    from dflash_jax.model import ops
    overrides = {}
    for item in filter(None, text.split(",")):
        op, _, value = item.partition("=")
        if op not in ops.AUTO_KERNELS or value not in ("on", "off"):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected OP=on|off, OP one of {', '.join(sorted(ops.AUTO_KERNELS))}")
        overrides[op] = value == "on"
    return overrides


def check_block_sizes(parser: argparse.ArgumentParser, flag: str, blocks: Sequence[int], shape: str) -> None:
    """DFlash blocks must be in [2, the draft's trained block size]."""
    limit = SHAPES[shape][1].block_size
    for block in blocks:
        if not 2 <= block <= limit:
            parser.error(f"{flag}: block {block} must be in [2, {limit}] (the draft's trained block size)")


def check_positions(parser: argparse.ArgumentParser, flag: str, contexts: Sequence[int], new_tokens: int,
                    shape: str) -> None:
    """Every prompt plus the tokens a run generates must fit the model's positions."""
    limit = SHAPES[shape][0].max_position_embeddings
    if max(contexts) + new_tokens > limit:
        parser.error(f"{flag}: context {max(contexts)} + {new_tokens} generated tokens exceeds the "
                     f"model's {limit} positions")


# ----------------------------------------------------------------------------- records and output

def run_record(args: argparse.Namespace) -> dict:
    """What every JSON output starts with: device, jax version, date, command line and settings."""
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(sys.argv),
            "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}}


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` whole or not at all (scripts rewrite their JSON after every measurement, so
    a late failure keeps what was measured)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2))
    os.replace(partial, path)


def add_auto_kernels_option(parser: argparse.ArgumentParser) -> None:
    """``--auto-kernels OP=on|off,...``: what impl="auto" runs as a kernel, for A/B runs."""
    parser.add_argument("--auto-kernels", type=auto_kernel_overrides, default="", metavar="OP=on|off,...",
                        help="override what impl=auto runs as a kernel (ops.AUTO_KERNELS), for A/B runs")


def override_auto_kernels(overrides: dict[str, bool]) -> dict:
    """Apply ``auto_kernel_overrides`` to ``ops.AUTO_KERNELS`` for this process (A/B runs);
    returns the table in force."""
    from dflash_jax.model import ops
    ops.AUTO_KERNELS.update(overrides)
    return dict(ops.AUTO_KERNELS)


# ----------------------------------------------------------------------------- measurement

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


def copy_ceiling_bytes_per_s(copies: dict) -> float:
    """The ceiling ``copy_bandwidth`` measured: torch's copy where present, else XLA's pass."""
    return copies.get("torch_copy_GBps", copies["xla_elementwise_GBps"]) * 1e9


def measure_ceilings(buffer_mib: int, matmul_size: int, repeats: int = 5) -> dict:
    """Copy bandwidth (``copy_bandwidth``) and the bf16 matmul rate of a chain of
    ``matmul_size``-square products timed inside one jit."""
    copies = copy_bandwidth(buffer_mib, repeats)
    chain = 10
    a = jax.random.normal(jax.random.key(1), (matmul_size, matmul_size), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(2), (matmul_size, matmul_size)) / matmul_size ** 0.5).astype(jnp.bfloat16)
    matmuls = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda i, y: y @ b, a))
    seconds = median_seconds(lambda: matmuls(a, b).block_until_ready(), repeats)
    return {"bandwidth_bytes_per_s": copy_ceiling_bytes_per_s(copies),
            "matmul_flops_per_s": chain * 2 * matmul_size ** 3 / seconds, "matmul_size": matmul_size,
            "copy_buffer_mib": buffer_mib, "copies_GBps": copies}


# ----------------------------------------------------------------------------- models and inputs

def require_gpu(shape: str) -> None:
    """Exit with one ``error:`` line when a real-shape run would time a CPU (``--shape tiny`` is
    the CPU smoke test): without a GPU it would build 16 GB of weights and time nothing useful."""
    if not shape.startswith("tiny") and jax.default_backend() != "gpu":
        print(f"error: --shape {shape} is timed on a GPU, and jax sees only {jax.default_backend()} "
              "(--shape tiny is the CPU smoke test)", file=sys.stderr)
        raise SystemExit(2)


def engine_run_models(args: argparse.Namespace) -> tuple[Target, Draft]:
    """The setup of an engine benchmark (``--shape``, ``--compile-cache``, ``--out``): a GPU unless
    the shape is tiny, compiled programs kept, the output folder made; its random models."""
    from dflash_jax.entrypoints.cli import keep_compiled_programs

    require_gpu(args.shape)
    keep_compiled_programs(args.compile_cache)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    return random_models(args.shape)


def random_models(shape: str, tensor_parallel: TensorParallel | None = None) -> tuple[Target, Draft]:
    """A bf16 target and draft of ``SHAPES[shape]`` with random weights (speed does not depend
    on their values), made on one device or straight into their slices on the mesh of
    ``tensor_parallel`` (random values need no reordering into the split layout)."""
    target_config, draft_config = SHAPES[shape]
    make_target = functools.partial(init_target_params, target_config, jax.random.key(0), jnp.bfloat16)
    make_draft = functools.partial(init_draft_params, draft_config, jax.random.key(1), jnp.bfloat16)
    if tensor_parallel is None:
        return Target(target_config, jax.jit(make_target)()), Draft(draft_config, jax.jit(make_draft)())
    mesh = tensor_parallel.mesh
    local_config(target_config, tensor_parallel.size, expert_parallel=tensor_parallel.expert_parallel)
    local_draft_config(draft_config, tensor_parallel)
    target_specs = specs(target_layout(jax.eval_shape(make_target), target_config, tensor_parallel.expert_parallel))
    draft_specs = specs(draft_layout(jax.eval_shape(make_draft), draft_config, tensor_parallel))
    target = Target(target_config, jax.jit(make_target, out_shardings=named(target_specs, mesh))(),
                    tensor_parallel=tensor_parallel)
    draft = Draft(draft_config, jax.jit(make_draft, out_shardings=named(draft_specs, mesh))(),
                  tensor_parallel=tensor_parallel)
    return target, draft


def random_prompts(rng: np.random.Generator, batch: int, context: int, vocab_size: int) -> list[list[int]]:
    """``batch`` prompts of ``context`` token ids from the lower half of the vocabulary (clear of
    special ids such as the draft's mask token at the top)."""
    return rng.integers(0, vocab_size // 2, (batch, context)).tolist()

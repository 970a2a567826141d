"""Shared pieces of the GPU benchmarks: the model shapes (``dflash_jax.model.shapes``), argument checks, ceilings,
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
from dflash_jax.loading.models import Draft, Target
from dflash_jax.model.config import ModelConfig
from dflash_jax.model.nn.moe import IndependentRouting, MoESpec
from dflash_jax.model.params import init_draft_params, init_target_params
from dflash_jax.model.shapes import SHAPES
from dflash_jax.model.sharding import (TensorParallel, draft_layout, local_config, local_draft_config, named, specs,
                                 target_layout)

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
    """An argparse type: ';'-separated JSON objects of a kernel's integer (or true/false) tuning
    keywords ``names`` (e.g. ``{};{"block_k": 64}``), each a variant to time."""
    def parse(text: str) -> list[dict]:
        result = []
        for item in text.split(";"):
            try:
                tuning = json.loads(item)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(f"{item!r} is not valid JSON ({error})") from None
            if not isinstance(tuning, dict) or not set(tuning) <= set(names):
                raise argparse.ArgumentTypeError(f"{item!r}: expected an object of {', '.join(names)}")
            bad = {k: v for k, v in tuning.items() if not isinstance(v, int)}
            if bad:
                raise argparse.ArgumentTypeError(f"{item!r}: tuning values must be integers or true/false, got {bad}")
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


def routing(text: str) -> IndependentRouting | None:
    """``--routing``: ``model`` (None: the random router's own choice), ``independent`` (each
    token's experts drawn uniformly, independently of the others') or ``independent:SKEW`` (expert
    e drawn in proportion to 1 / (e + 1)^SKEW)."""
    kind, colon, skew = text.partition(":")
    if kind == "model" and not colon:
        return None
    if kind == "independent":
        try:
            return IndependentRouting(float(skew) if colon else 0.0)
        except ValueError as error:  # a bad number, or ConfigError (a ValueError) for a negative one
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    raise argparse.ArgumentTypeError(f"{text!r}: expected model, independent or independent:SKEW (SKEW >= 0)")


def add_routing_option(parser: argparse.ArgumentParser) -> None:
    """``--routing``: how a MoE target's tokens pick their experts (``routing``)."""
    parser.add_argument("--routing", type=routing, default="model", metavar="model|independent[:SKEW]",
                        help="a MoE target's expert choice: its random router's (model; the tokens of a block route "
                             "far more alike than a trained router's), or drawn per token, independently, expert e "
                             "in proportion to 1/(e+1)^SKEW (independent: SKEW 0, uniform)")


def with_routing(config: ModelConfig, routing: IndependentRouting | None) -> ModelConfig:
    """``config`` with ``routing`` on each of its MoE layers (None: unchanged); ValueError for a
    config without MoE layers."""
    if routing is None:
        return config
    if not any(isinstance(layer.ffn, MoESpec) for layer in config.layers):
        raise ValueError("--routing independent: the target has no MoE layers")
    return config.with_layers(tuple(
        dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, routing=routing))
        if isinstance(layer.ffn, MoESpec) else layer for layer in config.layers))


def check_routing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--routing independent`` needs a MoE shape: an ``error:`` line otherwise."""
    try:
        with_routing(SHAPES[args.shape][0], args.routing)
    except ValueError as error:
        parser.error(f"{error} (--shape {args.shape})")


def routing_name(routing: IndependentRouting | None) -> str:
    return "model" if routing is None else f"independent:{routing.skew:g}"


@functools.lru_cache(maxsize=None)
def inclusion_probabilities(num_experts: int, top_k: int, skew: float, samples: int = 20_000,
                            seed: int = 0) -> np.ndarray:
    """Per expert, the probability [E] that a token's top_k draws without replacement (expert e in
    proportion to 1 / (e + 1)^skew) include it: k/E each at skew 0, else by Monte Carlo
    (Gumbel-top-k over ``samples`` tokens, fixed seed)."""
    if skew == 0:
        return np.full(num_experts, top_k / num_experts)
    scores = np.random.default_rng(seed).gumbel(size=(samples, num_experts)) - skew * np.log1p(np.arange(num_experts))
    chosen = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    q = np.bincount(chosen.ravel(), minlength=num_experts) / samples
    q.flags.writeable = False  # cached
    return q


def expected_experts(num_experts: int, top_k: int, tokens: int, skew: float = 0.0) -> float:
    """Expected distinct experts routed by ``tokens`` tokens of ``top_k`` distinct experts each,
    tokens independent (``--routing independent:SKEW``): sum over e of 1 - (1 - q_e)^tokens, q_e
    the chance a token picks e (``inclusion_probabilities``); at skew 0, E (1 - (1 - k/E)^tokens),
    exact. At Qwen3-30B-A3B's 128 x top 8: 8 at 1 token, 82 at 16, 128 at 512."""
    if skew == 0:
        return num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    q = inclusion_probabilities(num_experts, top_k, skew)
    return float(np.sum(1 - (1 - q) ** tokens))


def expert_report(num_experts: int, top_k: int, batches: Sequence[int], block: int,
                  skew: float | None = None) -> dict:
    """Expected distinct experts a MoE layer reads per pass, per batch: a decode step's (batch
    tokens) and a verify block's (batch x block), routing uniform and independent between tokens,
    and under ``skew`` when given (a nonzero one)."""
    passes = {}
    for batch in batches:
        for name, tokens in ((f"decode_bs{batch}", batch), (f"verify_bs{batch}_block{block}", batch * block)):
            row = {"tokens": tokens, "uniform": expected_experts(num_experts, top_k, tokens)}
            if skew:
                row["skewed"] = expected_experts(num_experts, top_k, tokens, skew)
            passes[name] = row
    return {"num_experts": num_experts, "top_k": top_k, "skew": skew or None, "passes": passes}


def measured_experts(target: Target, batch: int, context: int, blocks: Sequence[int], seed: int = 0) -> dict:
    """Per block in ``blocks``: the distinct experts per MoE layer (the mean over layers) that the
    target's own routing (its random router, or ``MoESpec.routing``) picks for the last ``block``
    tokens of ``batch`` random prompts of ``context + max(blocks)`` tokens (block 1: a decode
    step's tokens; more: a verify block's, its tokens random ones instead of drafts). One forward
    from an empty cache on one device (impl auto: on a GPU XLA's grouped matmul would hold every
    expert's products of every token, 66 GB at Qwen3-30B-A3B's shape), the experts read back by a
    host callback."""
    from dflash_jax.model import target as target_model
    from dflash_jax.model.cache import allocate_pages, init_cache
    from dflash_jax.model.nn import moe

    length, page = context + max(blocks), 16
    tokens = np.asarray(random_prompts(np.random.default_rng(seed), batch, length, target.config.vocab_size), np.int32)
    table, num_pages = allocate_pages([length] * batch, page)
    counts = {block: [] for block in blocks}

    def record(experts):
        experts = np.asarray(experts).reshape(batch, length, -1)
        for block in blocks:
            counts[block].append(len(np.unique(experts[:, -block:])))

    def recording_route(*args, **kwargs):
        h, experts, weights = plain_route(*args, **kwargs)
        jax.debug.callback(record, experts)
        return h, experts, weights

    @jax.jit
    def run(params, tokens):
        cache = init_cache(target.config, None, table, num_pages, page, jnp.bfloat16)
        return target_model.forward(params, target.config, tokens, jnp.zeros(batch, jnp.int32), cache,
                                    impl="auto")[0]

    plain_route, moe.route = moe.route, recording_route
    try:
        jax.block_until_ready(run(target.params, jnp.asarray(tokens)))
        jax.effects_barrier()
    finally:
        moe.route = plain_route
    return {block: float(np.mean(counts[block])) for block in blocks}


def print_expert_report(report: dict, routing: str) -> None:
    """``expert_report``'s table, beside the routing the run used (and, where measured, the
    experts the run's target picked: ``measured_experts``)."""
    skew = report["skew"]
    measured = any("measured" in row for row in report["passes"].values())
    print(f"MoE routing {routing}: expected distinct experts of {report['num_experts']} (top {report['top_k']}) "
          "per layer and pass, tokens routed independently" +
          (f"; measured: the target's routing over random tokens at context {report['measured_context']}"
           if measured else ""))
    print("  pass                        tokens  uniform" + (f"  skew {skew:g}" if skew else "") +
          ("  measured" if measured else ""))
    for name, row in report["passes"].items():
        print(f"  {name:<26} {row['tokens']:7d} {row['uniform']:8.1f}" +
              (f" {row['skewed']:8.1f}" if skew else "") +
              (f" {row['measured']:9.1f}" if "measured" in row else ""))


# ----------------------------------------------------------------------------- records and output

def run_record(args: argparse.Namespace) -> dict:
    """What every JSON output starts with: device, jax version, date, command line and settings."""
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(sys.argv),
            "settings": {key: str(value) if isinstance(value, Path) else routing_name(value) if key == "routing"
                         else value for key, value in vars(args).items()}}


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` whole or not at all (scripts rewrite their JSON after every measurement, so
    a late failure keeps what was measured)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2))
    os.replace(partial, path)


def add_engine_options(parser: argparse.ArgumentParser, context_default: str) -> None:
    """The serving engine's settings a benchmark passes on: the speculative policy (the server's
    default), the step token budget, the context, batch-invariant mode (``context_default`` says what it is
    without the flag)."""
    parser.add_argument("--speculative-policy", choices=("fixed", "adaptive"), default="adaptive",
                        help="the DFlash runs' policy (the server's default: adaptive)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int,
                        help="the engines' step token budget while prompts wait (default: the engine's)")
    parser.add_argument("--max-model-len", type=positive_int,
                        help=f"the engines' context (default: {context_default}; one value across runs lets "
                             "--compile-cache serve them all)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engines in batch-invariant mode (the server's --batch-invariant; needs "
                             "--speculative-policy fixed)")


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

def require_accelerator(shape: str, platforms: tuple[str, ...] = ("gpu", "tpu")) -> None:
    """Exit with one ``error:`` line when a real-shape run would time a CPU (``--shape tiny`` is
    the CPU smoke test): without an accelerator it would build 16 GB of weights and time nothing
    useful. The engine's runs take a GPU or a TPU; a GPU kernel's benchmark passes ("gpu",)."""
    if not shape.startswith("tiny") and jax.default_backend() not in platforms:
        print(f"error: --shape {shape} is timed on a {' or '.join(p.upper() for p in platforms)}, and jax sees "
              f"only {jax.default_backend()} (--shape tiny is the CPU smoke test)", file=sys.stderr)
        raise SystemExit(2)


def engine_run_models(args: argparse.Namespace) -> tuple[Target, Draft]:
    """The setup of an engine benchmark (``--shape``, ``--compile-cache``, ``--out``): a GPU unless
    the shape is tiny, compiled programs kept, the output folder made; its random models."""
    from dflash_jax.entrypoints.cli import keep_compiled_programs

    require_accelerator(args.shape)
    keep_compiled_programs(args.compile_cache)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    return random_models(args.shape, routing=getattr(args, "routing", None))


def random_models(shape: str, tensor_parallel: TensorParallel | None = None,
                  routing: IndependentRouting | None = None) -> tuple[Target, Draft]:
    """A bf16 target and draft of ``SHAPES[shape]`` with random weights (speed does not depend
    on their values, but a MoE's does on its routing: ``routing``, ``with_routing``), made on one
    device or straight into their slices on the mesh of ``tensor_parallel`` (random values need
    no reordering into the split layout)."""
    target_config, draft_config = SHAPES[shape]
    target_config = with_routing(target_config, routing)
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

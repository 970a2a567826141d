"""End-to-end DFlash benchmark at a real model's shape on one GPU (random weights, acceptance replayed).

Speed does not depend on weight values, so the target (``--shape``: Qwen3-8B by default, 36
layers, hidden 4096, vocab 151936; LLaMA-3.1-8B; Qwen3-30B-A3B, whose floor counts the routed
experts only) and a 5-layer draft are random, bf16; acceptance is replayed: each draft position is accepted
with probability alpha up to the first rejection (expected tau(B) = (1 - alpha^B) / (1 - alpha)).
The whole machinery runs (draft, verify, commit, variable-length advance); only the accept
decision is replaced. Every timed chunk starts from a fresh, untimed prefill of the prompts, so
"ctx N" means each chunk starts at context N. Reports, against ceilings measured in the same run:

- baseline decode ms/token at bs 1/8/32, context 512 and 4k, as a fraction of its byte roofline;
- the DFlash step's parts (draft, verify, commit; context 512, block 16) against their rooflines;
- per alpha 0.86 / 0.68, bs 1/8/32, every context, blocks 4/8/16: the median step time, tok/s and
  speedup over the own baseline at the same batch and context, both at the expected tau (so they
  are unbiased for alpha), and the tau the replay realized over all repeats (each with its own
  seed) as a check;
- a MoE target's distinct experts per layer of a decode step and of a verify block: expected
  under independent routing (``--routing``), and (``experts`` section, one device) those its own
  routing picks over random tokens;
- the z-lab reference's decode and DFlash step (from bench_reference.py's JSON, same machine), and
  ours over it at equal (expected) acceptance: bs 1, block 16, the reference's context.

The JSON is rewritten after every measurement, so a late failure keeps the earlier ones.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py --out $OUT [--reference-json $OUT/reference.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from common import (CEILING_SIZES, SHAPES, acceptance_rates, add_auto_kernels_option, add_routing_option,  # noqa: E402
                    check_block_sizes, check_positions, check_routing, expected_experts, expert_report,
                    measure_ceilings, measured_experts, median_seconds, names_from, output_dir, override_auto_kernels,
                    positive_int, positive_ints, print_expert_report, random_models, random_prompts,
                    require_accelerator, routing_name, run_record, write_json)

from dflash_jax.model import draft as draft_model  # noqa: E402
from dflash_jax.model import target as target_model  # noqa: E402
from dflash_jax.model.cache import state_bytes_per_sequence  # noqa: E402
from dflash_jax.entrypoints.cli import COMPILE_CACHE_HELP, at_least, keep_compiled_programs, reported_as_errors  # noqa: E402
from dflash_jax.runtime.decode import default_steps_per_check  # noqa: E402
from dflash_jax.runtime.engine import Engine, RequestParams, compile_seconds  # noqa: E402
from dflash_jax.runtime.generation import batch_engine  # noqa: E402
from dflash_jax.loading.models import Draft, Target  # noqa: E402
from dflash_jax.model.nn.moe import MoESpec  # noqa: E402
from dflash_jax.model.sharding import TensorParallel, make_mesh  # noqa: E402
import pallas_kernels as pk  # noqa: E402

SECTIONS = ("decode", "parts", "e2e", "experts")
# Batches and contexts per shape when not given: the grid at Qwen3-8B, a CPU smoke test at
# tiny (whose reference attention holds every score: bs 32 at 4096 tokens took ~20 GB).
_GPU_GRID = {"batches": [1, 8, 32], "contexts": [512, 4096], "parts_batches": [1, 32], "blocks": [4, 8, 16]}
_CPU_GRID = {"batches": [1, 8], "contexts": [16, 64], "parts_batches": [1], "blocks": [4, 8, 16]}
SHAPE_DEFAULTS = {"qwen3-8b": _GPU_GRID, "qwen3-8b-dflash2": _GPU_GRID, "qwen3-32b": _GPU_GRID, "qwen3-30b-a3b": _GPU_GRID, "qwen3.5-27b": _GPU_GRID,
                  "qwen3.5-35b-a3b": _GPU_GRID, "tiny": _CPU_GRID, "tiny-moe": _CPU_GRID, "tiny-hybrid": _CPU_GRID,
                  "llama3.1-8b": {**_GPU_GRID, "blocks": [4, 8, 10]},  # z-lab's LLaMA draft: block 10
                  "gpt-oss-20b": {**_GPU_GRID, "blocks": [4, 8]}, "gpt-oss-20b-mxfp4": {**_GPU_GRID, "blocks": [4, 8]},
                  "tiny-gpt-oss": _CPU_GRID, "tiny-gpt-oss-mxfp4": _CPU_GRID,
                  "tiny-dflash2": _CPU_GRID}  # its draft: block 8
PARTS_CONTEXT, PARTS_BLOCK = 512, 16  # the parts' block: 16, or the draft's trained block when smaller
REFERENCE_BLOCK = 16  # bench_reference.py times the reference's DFlash step at this block
REFERENCE_KEYS = ("decode_step_s", "dflash_step_s")


def expected_tau(alpha: float, block: int) -> float:
    """Mean tokens per step when each of the block-1 drafts is accepted with probability alpha up
    to the first rejection, bonus token included (alpha in [0, 1))."""
    return (1 - alpha ** block) / (1 - alpha)


def tokens_per_second(batch: int, tau: float, ms_per_step: float) -> float:
    return batch * tau / (ms_per_step / 1e3)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def nparams(tree) -> int:
    """Weights, an MXFP4 weight counted by its logical shape (not its bytes)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pk.Mxfp4Weight)))


@dataclasses.dataclass(frozen=True)
class Cost:
    """Bytes a part of a step must move, the matmul FLOPs it must do and, split over devices, the
    seconds of its all-reduces (which add to the larger of the other two)."""

    bytes: float
    flops: float
    reduce_seconds: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops, self.reduce_seconds + other.reduce_seconds)


class Roofline:
    """What each part of a step must move and compute (the weights it reads, the context's KV
    cache; matmuls at 2 FLOPs per weight per token, attention at 4 per query head and dimension
    per (query, key) pair), turned into a floor time by the measured
    ceilings: the larger of bytes over the copy bandwidth and FLOPs over the matmul rate. A DFlash
    step is its three parts: draft, verify and commit. A MoE layer reads only its routed experts:
    ``expected_experts`` of them for the tokens of the pass (independent between tokens, under
    ``skew``: ``--routing independent:SKEW``), each token computing top_k. A hybrid's
    Gated DeltaNet states count once read and once written per step (the floor; the rollback
    reads them once more: ``dflash_jax.model.cache``). Split over ``shards`` devices (tensor
    parallelism) the floor is one device's share: split weights, KV, states and FLOPs divided by
    the shards (the draft's by ``draft_shards``: 1 when it is replicated), at one device's
    ceilings, plus each pass's all-reduces at ``allreduce_seconds(rows)`` (measured in the same
    run: one f32 sum of ``rows`` hidden-wide rows): two a layer and the embedding's one."""

    def __init__(self, target: Target, draft: Draft, ceilings: dict, shards: int = 1, draft_shards: int = 1,
                 allreduce_seconds: Callable[[int], float] | None = None, skew: float = 0.0):
        tc, dc = target.config, draft.config.model
        self.skew = skew
        self.allreduce_seconds = allreduce_seconds or (lambda rows: 0.0)
        self.target_reductions = 2 * tc.num_layers + 1
        # the block's embedding (the target's, split) and, when the draft is split, its layers'
        self.draft_reductions = 1 + (2 * dc.num_layers if draft_shards > 1 else 0)
        self.bw, self.rate = ceilings["bandwidth_bytes_per_s"], ceilings["matmul_flops_per_s"]
        t, d = target.params, draft.params
        # The routed experts' stacks apart: (num_experts, top_k, bytes per expert, params per expert).
        self.moe_layers = [(layer.ffn.num_experts, layer.ffn.top_k,
                            (nbytes(params.ffn.gate_up_proj) + nbytes(params.ffn.down_proj)) / layer.ffn.num_experts
                            / shards,
                            (nparams(params.ffn.gate_up_proj) + nparams(params.ffn.down_proj)) / layer.ffn.num_experts
                            / shards)
                           for layer, params in zip(tc.layers, t.layers) if isinstance(layer.ffn, MoESpec)]
        expert_bytes = sum(e * per_expert for e, _, per_expert, _ in self.moe_layers)
        expert_params = sum(e * per_expert for e, _, _, per_expert in self.moe_layers)
        # Every other weight a target forward reads (the embedding only a few rows), LM head included.
        self.target = Cost((nbytes(t) - nbytes(t.embed)) / shards - expert_bytes,
                           2 * ((nparams(t) - nparams(t.embed)) / shards - expert_params))
        # The draft's block pass: its layers and final norm, then the LM head again for the draft
        # logits (its own head for a reduced vocabulary); fc is read only by commit.
        head = d.lm_head if d.lm_head is not None else t.lm_head if t.lm_head is not None else t.embed
        self.draft_layers = Cost((nbytes(d.layers) + nbytes(d.norm)) / draft_shards,
                                 2 * (nparams(d.layers) + nparams(d.norm)) / draft_shards)
        head_shards = 1 if d.lm_head is not None else shards  # a reduced-vocabulary head is replicated
        self.draft_head = Cost(nbytes(head) / head_shards, 2 * nparams(head) / head_shards)
        # Commit: fc, then each draft layer's k/v columns of qkv_proj for the committed tokens.
        kv_columns = sum(layer.attention.qkv_proj.shape[0] * (layer.attention.qkv_proj.shape[1] - layer.attention.q_size)
                         for layer in d.layers)
        itemsize = d.fc.dtype.itemsize
        self.commit_weights = Cost(nbytes(d.fc) + kv_columns * itemsize / draft_shards,
                                   2 * (nparams(d.fc) + kv_columns / draft_shards))
        kv_per_token = lambda cfg: 2 * cfg.num_kv_heads * cfg.head_dim * 2 * len(cfg.attention_layers)  # noqa: E731
        # (K+V, bf16)
        self.target_kv_token, self.draft_kv_token = kv_per_token(tc) / shards, kv_per_token(dc) / draft_shards
        # A hybrid's recurrent and conv states, read and written once per step per sequence.
        self.state_bytes = state_bytes_per_sequence(tc) / shards
        # Attention FLOPs per (query, key) pair: q.k and p.v over every query head of every layer.
        attention_per_pair = lambda cfg: 4 * cfg.num_heads * cfg.head_dim * len(cfg.attention_layers)  # noqa: E731
        self.target_attention = attention_per_pair(tc) / shards
        self.draft_attention = attention_per_pair(dc) / draft_shards

    def seconds(self, cost: Cost) -> float:
        return max(cost.bytes / self.bw, cost.flops / self.rate) + cost.reduce_seconds

    def experts(self, tokens: int) -> Cost:
        """The routed experts of a target pass over ``tokens`` tokens."""
        return Cost(sum(expected_experts(e, k, tokens, self.skew) * per_expert
                        for e, k, per_expert, _ in self.moe_layers),
                    sum(2 * k * params * tokens for _, k, _, params in self.moe_layers))

    def verify(self, batch, context, block) -> Cost:
        """The target over ``block`` tokens per sequence (block 1: a plain decode step); the new
        tokens attend to the context and, causally, to each other."""
        pairs = batch * block * (context + (block + 1) / 2)
        return Cost(self.target.bytes + batch * context * self.target_kv_token + 2 * batch * self.state_bytes,
                    self.target.flops * batch * block + self.target_attention * pairs,
                    self.target_reductions * self.allreduce_seconds(batch * block)) + self.experts(batch * block)

    def draft(self, batch, context, block) -> Cost:
        """The draft's block pass over ``block`` positions (each attending to the context and the
        whole block) and its logits for the block-1 drafts."""
        return Cost(self.draft_layers.bytes + self.draft_head.bytes + batch * context * self.draft_kv_token,
                    self.draft_layers.flops * batch * block + self.draft_head.flops * batch * (block - 1)
                    + self.draft_attention * batch * block * (context + block),
                    self.draft_reductions * self.allreduce_seconds(batch * block))

    def commit(self, batch, block) -> Cost:
        """The committed block's context K/V for the draft (fc and the k/v projections)."""
        return Cost(self.commit_weights.bytes, self.commit_weights.flops * batch * block)

    def dflash_step(self, batch, context, block) -> Cost:
        return self.draft(batch, context, block) + self.verify(batch, context, block) + self.commit(batch, block)

    def weight_bytes(self) -> dict:
        out = {"target_weights": self.target.bytes, "draft_block_pass_weights": self.draft_layers.bytes,
               "lm_head_for_draft_logits": self.draft_head.bytes, "commit_weights": self.commit_weights.bytes}
        if self.state_bytes:
            out["recurrent_state_per_sequence"] = self.state_bytes
        if self.moe_layers:
            out["target_weights"] = self.target.bytes + self.experts(1).bytes  # a decode step's routed experts
            out["target_weights_besides_experts"] = self.target.bytes
            out["all_experts"] = sum(e * per_expert for e, _, per_expert, _ in self.moe_layers)
        return out


@dataclasses.dataclass
class Chunk:
    """One timed chunk: wall seconds, loop steps run, and the tokens each row emitted per step
    ([batch, steps], bonus included)."""

    seconds: float
    steps: int
    accept_lengths: np.ndarray


def time_chunk(engine: Engine, prompts: list[list[int]], max_new: int, seed: int,
               trace_dir: Path | None = None) -> Chunk:
    """Submit the prompts and run them to their first tokens (untimed; ``seed`` keys each
    request's replayed accept draws), then time the engine step that runs one decode chunk
    (under the JAX profiler, writing a Perfetto trace into ``trace_dir``, when given); the
    requests are cancelled after."""
    requests = [engine.submit(prompt, RequestParams(max_tokens=max_new, seed=seed, sample_index=i))
                for i, prompt in enumerate(prompts)]
    engine.prefill_waiting()
    jax.block_until_ready(engine.device.state)
    traced = contextlib.nullcontext() if trace_dir is None else jax.profiler.trace(
        str(trace_dir), create_perfetto_trace=True)
    with traced:
        start = time.perf_counter()
        engine.step()                          # dispatches the chunk (nothing else is in flight)
        jax.block_until_ready(engine.device.state)
        seconds = time.perf_counter() - start
    engine.step()                              # delivers its tokens (and dispatches one more chunk)
    taken = [len(r.accept_lengths) for r in requests]
    for request in requests:
        engine.cancel(request)
    engine.run_until_done()
    if taken != [engine.chunk_steps] * len(requests):
        raise RuntimeError(f"a sequence finished inside a timed chunk ({taken} of {engine.chunk_steps} steps)")
    return Chunk(seconds, engine.chunk_steps, np.asarray([r.accept_lengths[:engine.chunk_steps] for r in requests]))


def allreduce_seconds(mesh, rows: int, hidden: int, repeats: int, chain: int = 64) -> float:
    """Seconds of one f32 all-reduce of [rows, hidden] over the mesh, as the split forward sums its
    row-parallel partials: the median of ``repeats`` jitted loops of ``chain`` dependent ones."""
    axis = mesh.axis_names[0]

    def loop(x):
        return jax.lax.fori_loop(0, chain, lambda _, y: jax.lax.psum(y, axis) * (1.0 / mesh.size), x)

    program = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((rows, hidden), jnp.float32), NamedSharding(mesh, P()))
    return median_seconds(lambda: program(x).block_until_ready(), repeats) / chain


def mean_context(context: int, accept_lengths: np.ndarray) -> float:
    """Mean committed context at the start of each step of chunks [rows, steps] that start at
    ``context``."""
    return context + float(np.mean(np.cumsum(accept_lengths, axis=1) - accept_lengths))


def summarize_chunks(chunks: list[Chunk], context: int) -> dict:
    """Median ms per step over the chunks (each chunk's too, for the spread); tau and mean
    context pooled over all of them."""
    lengths = np.concatenate([chunk.accept_lengths for chunk in chunks])
    per_chunk = [chunk.seconds / chunk.steps * 1e3 for chunk in chunks]
    return {"ms_per_step": statistics.median(per_chunk), "ms_per_step_chunks": per_chunk,
            "tau_measured": float(np.mean(lengths)), "mean_context": mean_context(context, lengths),
            "steps": chunks[0].steps, "repeats": len(chunks)}


def run_loop(target, draft, batch, context, block, steps, alphas, repeats, rng, impl, steps_per_check):
    """Time the real decode loop (DFlash with ``draft``, plain decoding without) in chunks of
    ``steps`` steps, per alpha: a warm-up chunk, then ``repeats`` timed ones, each from a fresh
    prefill with its own replay seed (``summarize_chunks``; steps_per_check None: the default)."""
    prompts = random_prompts(rng, batch, context, target.config.vocab_size)
    # Every timed chunk starts from its prefill, so it needs steps x block tokens at most. One
    # max_new_tokens for every block size: the prefill is then the same program.
    max_new = steps * (draft.config.block_size if draft else 1) + 1
    steps_per_check = steps_per_check or default_steps_per_check(steps)
    engine = batch_engine(target, draft, [context] * batch, [max_new], block_size=block if draft else None,
                          chunk_steps=steps, steps_per_check=steps_per_check, impl=impl,
                          accept_replay=alphas[0] if draft else None)
    new_seed = lambda: int(rng.integers(2 ** 31))  # noqa: E731
    results = {}
    try:
        for alpha in alphas:
            if draft is not None:
                engine.set_accept_replay(alpha)
            start = time.monotonic()
            time_chunk(engine, prompts, max_new, new_seed())  # warm-up
            compiled = compile_seconds(start, time.monotonic())
            results[alpha] = summarize_chunks([time_chunk(engine, prompts, max_new, new_seed())
                                               for _ in range(repeats)], context)
            results[alpha].update(steps_per_check=steps_per_check, compile_s=compiled)
    finally:
        engine.close()
    return results


def baseline_row(run: dict, batch: int) -> dict:
    """A plain-decode result with its tok/s (one token per step)."""
    row = {key: value for key, value in run.items() if key != "tau_measured"}
    row["tokens_per_s"] = tokens_per_second(batch, 1, run["ms_per_step"])
    return row


def e2e_row(run: dict, baseline: dict, batch: int, alpha: float, block: int) -> dict:
    """A DFlash result with tok/s at the expected tau (unbiased for alpha) and at the measured
    one, and the speedup over ``baseline`` (a ``baseline_row``), all from the same median step."""
    tau = expected_tau(alpha, block)
    tokens_per_s = tokens_per_second(batch, tau, run["ms_per_step"])
    return {**run, "tau_expected": tau, "tokens_per_s": tokens_per_s,
            "tokens_per_s_measured": tokens_per_second(batch, run["tau_measured"], run["ms_per_step"]),
            "baseline_ms_per_step": baseline["ms_per_step"], "baseline_tokens_per_s": baseline["tokens_per_s"],
            "speedup": tokens_per_s / baseline["tokens_per_s"]}


def time_parts(target, draft, batch, context, block, iterations, repeats, rng, impl):
    """Draft, verify and commit alone, each as a dependent chain inside one jitted loop."""
    prompts = random_prompts(rng, batch, context, target.config.vocab_size)
    engine = batch_engine(target, draft, [context] * batch, [block + 1], block_size=block, chunk_steps=1,
                          accept_replay=1.0, impl=impl)
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, RequestParams(max_tokens=block + 1, sample_index=i))
    engine.prefill_waiting()
    state = engine.device.state        # the chains below take its cache: the engine is not used after
    cache, config = state.cache, engine.config
    block_lens = jnp.full((batch,), block, jnp.int32)
    masks = jnp.full((batch, block - 1), config.draft.mask_token_id, jnp.int32)

    @functools.partial(jax.jit, static_argnames="n")
    def draft_chain(tp, dp, cache, last, n):
        def body(i, last):
            hidden = draft_model.block_hidden(dp, config.draft, tp, jnp.concatenate([last[:, None], masks], 1),
                                              cache, block_lens, impl=config.impl)
            logits = draft_model.draft_logits(dp, config.draft, tp, hidden[:, 1:])
            return jnp.sum(jnp.argmax(logits, -1), axis=1).astype(jnp.int32) % (target.config.vocab_size // 2)
        return jax.lax.fori_loop(0, n, body, last)

    @functools.partial(jax.jit, static_argnames="n", donate_argnames="cache")
    def verify_chain(tp, cache, tokens, n):
        def body(i, carry):
            cache, tokens = carry
            hidden, _, cache = target_model.forward(tp, config.target, tokens, cache.lengths, cache,
                                                    tap_layers=config.tap_layers, impl=config.impl)
            # (a hybrid's commit replays the accepted tokens into its recurrent states: timed here)
            cache = cache.commit(cache.lengths, config.impl)
            return cache, jnp.argmax(target_model.logits(tp, hidden), -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, (cache, tokens))

    @functools.partial(jax.jit, static_argnames="n", donate_argnames="cache")
    def commit_chain(dp, cache, taps, n):
        positions = cache.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        kv_proj = draft_model.context_kv_proj(dp)  # once, as the decode loop does

        def body(i, cache):
            return draft_model.write_context(dp, config.draft, taps, positions, cache, impl=config.impl,
                                             kv_proj=kv_proj)
        return jax.lax.fori_loop(0, n, body, cache)

    last = state.last_token
    tokens = jnp.zeros((batch, block), jnp.int32)
    taps = jax.random.normal(jax.random.key(3), (batch, block, len(config.tap_layers) * config.target.hidden_size),
                             jnp.bfloat16)
    holder = {"cache": cache}

    def run_verify():
        holder["cache"], _ = jax.block_until_ready(verify_chain(target.params, holder["cache"], tokens, iterations))

    def run_commit():
        holder["cache"] = jax.block_until_ready(commit_chain(draft.params, holder["cache"], taps, iterations))

    out = {"draft_ms": median_seconds(lambda: draft_chain(target.params, draft.params, holder["cache"], last,
                                                          iterations).block_until_ready(), repeats)}
    out["verify_ms"] = median_seconds(run_verify, repeats)
    out["commit_ms"] = median_seconds(run_commit, repeats)
    engine.close()
    return {k: v / iterations * 1e3 for k, v in out.items()}


def load_reference(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
    """bench_reference.py's JSON, checked, with what it is compared at: the reference's tok/s at
    each alpha's expected tau, and the name of our cell it is compared with (which must be run)."""
    if not args.reference_json:
        return None
    path = Path(args.reference_json)
    if not path.is_file():
        parser.error(f"--reference-json {path}: no such file (run bench_reference.py first)")
    try:
        reference = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        parser.error(f"--reference-json {path}: not valid JSON ({error})")
    bad = [key for key in REFERENCE_KEYS if not isinstance(reference, dict) or not isinstance(
        reference.get(key), (int, float)) or reference[key] <= 0]
    if bad:
        parser.error(f"--reference-json {path}: needs positive numbers {', '.join(bad)} (run bench_reference.py)")
    if reference.get("block", REFERENCE_BLOCK) != REFERENCE_BLOCK:
        parser.error(f"--reference-json {path}: the reference was timed at block {reference['block']}, "
                     f"ours is compared at block {REFERENCE_BLOCK}")
    reference.setdefault("context", 512)  # bench_reference.py's default; older JSONs did not say
    context = reference["context"]
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        parser.error(f"--reference-json {path}: context must be a positive integer, got {context!r}")
    runs_cell = 1 in args.batches and REFERENCE_BLOCK in args.blocks and context in args.contexts
    if "e2e" in args.skip or not runs_cell:
        parser.error(f"--reference-json: the comparison cell (bs 1, block {REFERENCE_BLOCK}, ctx {context}) is not "
                     f"run: it needs 1 in --batches, {REFERENCE_BLOCK} in --blocks, {context} in --contexts and "
                     "e2e not skipped")
    # At equal (expected) acceptance, ours over the reference is the ratio of step times.
    reference["tokens_per_s_at"] = {str(a): expected_tau(a, REFERENCE_BLOCK) / reference["dflash_step_s"]
                                    for a in args.alphas}
    reference["compared_with"] = {str(a): f"bs1_ctx{context}_block{REFERENCE_BLOCK}_alpha{a}" for a in args.alphas}
    return reference


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict | None]:
    """The settings and the reference (``load_reference``), every value checked: a bad one is an
    ``error:`` line before any device work."""
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=output_dir, default="out")
    parser.add_argument("--reference-json")
    parser.add_argument("--batches", type=positive_ints, help="default: 1,8,32 (tiny: 1,8)")
    parser.add_argument("--contexts", type=positive_ints, help="default: 512,4096 (tiny: 16,64)")
    parser.add_argument("--blocks", type=positive_ints, help="default: 4,8,16 (llama3.1-8b: 4,8,10)")
    parser.add_argument("--alphas", type=acceptance_rates, default="0.86,0.68", help="each in [0, 1)")
    parser.add_argument("--steps", type=positive_int, default=16, help="DFlash steps per timed chunk "
                        "(the baseline's chunks take twice as many)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed chunks per cell")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    parser.add_argument("--ceiling-mib", type=positive_int, help="buffer size for the bandwidth ceiling "
                        "(default: 1024, 8 at --shape tiny)")
    parser.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor parallelism: the models split over this many devices (decode and e2e sections)")
    parser.add_argument("--replicate-draft", action="store_true", help="with --tp: the draft whole on every device")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tp: a MoE target's experts dealt out whole instead of split by width")
    parser.add_argument("--parts-batches", type=positive_ints, help="default: 1,32 (tiny: 1)")
    parser.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    parser.add_argument("--skip", type=names_from(SECTIONS, allow_empty=True), default="",
                        help=f"comma list of sections to skip: {','.join(SECTIONS)}")
    parser.add_argument("--steps-per-check", type=at_least(2), default=None,
                        help="decode steps between the loop's stop checks (must divide --steps; default: "
                        "decode.default_steps_per_check, what users get)")
    add_auto_kernels_option(parser)
    add_routing_option(parser)
    args = parser.parse_args(argv)
    check_routing(parser, args)
    for name, value in SHAPE_DEFAULTS[args.shape].items():  # the tiny shape's are small enough for a CPU
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_block_sizes(parser, "--blocks", args.blocks, args.shape)
    draft_block = SHAPES[args.shape][1].block_size
    check_positions(parser, "--contexts", args.contexts, args.steps * draft_block + 1, args.shape)
    # The DFlash chunks take --steps steps, the baseline's twice as many; parts runs no loop.
    shortest_chunk = args.steps if "e2e" not in args.skip else 2 * args.steps if "decode" not in args.skip else 0
    if args.steps_per_check and shortest_chunk % args.steps_per_check:
        parser.error(f"--steps-per-check {args.steps_per_check} must divide the steps of every timed chunk "
                     f"({shortest_chunk}: --steps for DFlash, twice that for the baseline)")
    if (args.steps_per_check or default_steps_per_check(args.steps)) < 2:
        parser.error(f"--steps {args.steps} would check for finished rows after every step, a host round trip "
                     "per step that the timed loop must not have: give an even --steps (default 16)")
    if args.tp > 1 and "parts" not in args.skip:
        parser.error("--tp times the decode and e2e sections (whole split programs): add --skip parts")
    if (args.replicate_draft or args.expert_parallel) and args.tp == 1:
        parser.error("--replicate-draft and --expert-parallel need --tp > 1")
    if args.tp > jax.device_count():
        parser.error(f"--tp {args.tp} needs {args.tp} devices; {jax.device_count()} visible")
    return args, load_reference(parser, args)


def main(argv: list[str] | None = None):
    args, reference = parse_args(argv)
    require_accelerator(args.shape)
    device = jax.devices()[0].device_kind
    if reference and reference.get("device", device) != device and not args.shape.startswith("tiny"):
        print(f"error: --reference-json was measured on {reference['device']}, this run is on {device}: "
              "a ratio of step times needs one GPU", file=sys.stderr)
        raise SystemExit(2)
    # One stop-check interval for the plain chunks (2 x steps) and the DFlash ones (steps).
    steps_per_check = args.steps_per_check or default_steps_per_check(args.steps)
    auto_kernels = override_auto_kernels(args.auto_kernels)
    with reported_as_errors():  # identical programs (a prefill shared by several block sizes) compile once
        keep_compiled_programs(args.compile_cache)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    report = run_record(args)
    report.update(shape=args.shape, impl=args.impl, auto_kernels=auto_kernels, tp=args.tp,
                  replicate_draft=args.replicate_draft, expert_parallel=args.expert_parallel,
                  routing=routing_name(args.routing), decode={}, parts={}, e2e={})
    moe = next((layer.ffn for layer in SHAPES[args.shape][0].layers if isinstance(layer.ffn, MoESpec)), None)
    if moe is not None:  # what each pass would read, routing independent between tokens
        report["distinct_experts"] = expert_report(moe.num_experts, moe.top_k, args.batches, max(args.blocks),
                                                   args.routing.skew if args.routing else None)
    if reference:
        report["reference"] = reference
    save = functools.partial(write_json, args.out / "bench_e2e.json", report)
    buffer_mib, matmul_size = CEILING_SIZES[args.shape]
    report["ceilings"] = ceilings = measure_ceilings(args.ceiling_mib or buffer_mib, matmul_size)
    log("ceilings", ceilings)
    tensor_parallel = None
    if args.tp > 1:
        tensor_parallel = TensorParallel(make_mesh(args.tp), replicate_draft=args.replicate_draft,
                                         expert_parallel=args.expert_parallel)
    target, draft = random_models(args.shape, tensor_parallel, args.routing)
    if moe is not None and tensor_parallel is None and "experts" not in args.skip:
        # the experts the target's own routing picks per pass, beside the expectations
        experts = report["distinct_experts"]
        experts["measured_context"] = context = min(args.contexts)
        block = max(args.blocks)
        for batch in args.batches:
            start = time.perf_counter()
            measured = measured_experts(target, batch, context, (1, block))
            experts["passes"][f"decode_bs{batch}"]["measured"] = measured[1]
            experts["passes"][f"verify_bs{batch}_block{block}"]["measured"] = measured[block]
            log("experts", batch, measured, f"{time.perf_counter() - start:.1f} s")
    report["allreduce_us"] = measured = {}  # per row count, when split

    def allreduce(rows: int) -> float:
        if rows not in measured:
            measured[rows] = allreduce_seconds(tensor_parallel.mesh, rows, target.config.hidden_size,
                                               args.repeats) * 1e6
            log("allreduce", rows, "rows", f"{measured[rows]:.1f} us")
        return measured[rows] / 1e6
    roof = Roofline(target, draft, ceilings, shards=args.tp, draft_shards=1 if args.replicate_draft else args.tp,
                    allreduce_seconds=None if tensor_parallel is None else allreduce,
                    skew=args.routing.skew if args.routing else 0.0)
    report["bytes"] = roof.weight_bytes()
    save()

    def baseline(batch, context):
        run = run_loop(target, None, batch, context, 1, args.steps * 2, [None], args.repeats, rng, args.impl,
                       steps_per_check)[None]
        row = baseline_row(run, batch)
        row["roofline_ms"] = roof.seconds(roof.verify(batch, context, 1)) * 1e3
        row["fraction_of_roofline"] = row["roofline_ms"] / row["ms_per_step"]
        return row

    decode = report["decode"]
    if "decode" not in args.skip:
        for batch in args.batches:
            for context in args.contexts:
                decode[f"bs{batch}_ctx{context}"] = row = baseline(batch, context)
                save()
                log("decode", batch, context, row)

    if "parts" not in args.skip:
        block = min(PARTS_BLOCK, draft.config.block_size)
        for batch in args.parts_batches:
            row = time_parts(target, draft, batch, PARTS_CONTEXT, block, 8, args.repeats, rng, args.impl)
            for part, cost in (("draft", roof.draft(batch, PARTS_CONTEXT, block)),
                               ("verify", roof.verify(batch, PARTS_CONTEXT, block)),
                               ("commit", roof.commit(batch, block))):
                row[f"{part}_roofline_ms"] = roof.seconds(cost) * 1e3
                row[f"{part}_fraction_of_roofline"] = row[f"{part}_roofline_ms"] / row[f"{part}_ms"]
            report["parts"][f"bs{batch}_ctx{PARTS_CONTEXT}_block{block}"] = row
            save()
            log("parts", batch, row)

    if "e2e" not in args.skip:
        for batch in args.batches:
            for context in args.contexts:
                base = decode.get(f"bs{batch}_ctx{context}") or baseline(batch, context)
                for block in args.blocks:
                    runs = run_loop(target, draft, batch, context, block, args.steps, args.alphas, args.repeats,
                                    rng, args.impl, steps_per_check)
                    for alpha, run in runs.items():
                        row = e2e_row(run, base, batch, alpha, block)
                        row["step_roofline_ms"] = roof.seconds(roof.dflash_step(batch, context, block)) * 1e3
                        row["step_fraction_of_roofline"] = row["step_roofline_ms"] / row["ms_per_step"]
                        report["e2e"][f"bs{batch}_ctx{context}_block{block}_alpha{alpha}"] = row
                        log("e2e", batch, context, block, alpha, row)
                    save()
    print_table(report)


def print_table(report):
    c = report["ceilings"]
    split = (f" | tp {report['tp']}" + (", draft replicated" if report["replicate_draft"] else "")
             + (", experts whole" if report["expert_parallel"] else "")) if report["tp"] > 1 else ""
    print(f"\n{report['shape']}{split} | {report['device']} | jax {report['jax']} | {report['date']} | copy "
          f"{c['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (" +
          ", ".join(f"{k} {v / 1e3:.2f}" for k, v in c["copies_GBps"].items()) +
          f" TB/s) | bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if report.get("distinct_experts"):
        print_expert_report(report["distinct_experts"], report["routing"])
    if report.get("allreduce_us"):
        print("f32 all-reduce (in the floors), us per rows: " +
              ", ".join(f"{rows}: {us:.1f}" for rows, us in sorted(report["allreduce_us"].items())))
    if report["decode"]:
        print("\nbaseline decode        ms/token  roofline ms  fraction  tok/s")
        for name, r in report["decode"].items():
            print(f"  {name:<20} {r['ms_per_step']:8.2f} {r['roofline_ms']:11.2f} {r['fraction_of_roofline']:9.2f}"
                  f" {r['tokens_per_s']:7.0f}")
    if report["parts"]:
        print(f"\nDFlash parts (ctx {PARTS_CONTEXT}), ms (floor, fraction)"
              "              draft                verify               commit")
        for name, r in report["parts"].items():
            print(f"  {name:<28}" + "".join(
                f" {r[f'{part}_ms']:7.2f} ({r[f'{part}_roofline_ms']:.2f}, {r[f'{part}_fraction_of_roofline']:.2f})"
                for part in ("draft", "verify", "commit")))
    if report["e2e"]:
        print("\nend to end (tok/s and speedup at the expected tau)\n"
              "                                     step ms (floor, fraction)  tau exp  tau meas   tok/s  baseline"
              "  speedup")
        for name, r in report["e2e"].items():
            print(f"  {name:<34} {r['ms_per_step']:7.2f} ({r['step_roofline_ms']:5.2f}, "
                  f"{r['step_fraction_of_roofline']:.2f}) {r['tau_expected']:8.2f}"
                  f" {r['tau_measured']:9.2f} {r['tokens_per_s']:7.0f} {r['baseline_tokens_per_s']:9.0f}"
                  f" {r['speedup']:7.2f}x")
    ref = report.get("reference")
    if ref:
        print(f"\nreference (dflash {ref.get('dflash', '?')}, torch {ref.get('torch', '?')}): decode "
              f"{ref['decode_step_s'] * 1e3:.2f} ms, DFlash step {ref['dflash_step_s'] * 1e3:.2f} ms, tok/s at the "
              "expected tau of alpha " + ", ".join(f"{a}: {v:.0f}" for a, v in ref["tokens_per_s_at"].items()))
        ours = {a: report["e2e"][cell]["tokens_per_s"] for a, cell in ref["compared_with"].items()}
        print(f"ours / reference at bs 1, ctx {ref['context']}, block {REFERENCE_BLOCK}, same tau: " + ", ".join(
            f"alpha {a}: {ours[a] / ref['tokens_per_s_at'][a]:.1f}x" for a in ours))


if __name__ == "__main__":
    main()

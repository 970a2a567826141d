"""Batched generation with or without a DFlash draft: the Python API and the CLI.

    python -m dflash_jax.generate --target DIR [--draft DIR] --prompt "def fib(n):" [--chat]

The CLI's flags are ``arguments.generate_parser``'s; ``main`` parses them and ``run`` runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from dflash_jax.runtime import distributed
from dflash_jax.model.cache import PagedKVCache, allocate_pages, check_cache_fits, check_page_size, zeroed_cache
from dflash_jax.entrypoints.arguments import DEFAULT_MODEL, DEFAULT_PROMPT, generate_parser, target_families
from dflash_jax.entrypoints.cli import (default_dtype, deferred_interrupts, exit_with, interrupt_exits,
                                        keep_compiled_programs, named_as_flags, one_line_warnings, or_na)
from dflash_jax.model.config import ModelConfig
from dflash_jax.model.hf_config import load_draft_config, load_target_config
from dflash_jax.runtime.engine import Engine, RequestOutput, RequestParams, compile_seconds
from dflash_jax.runtime.decode import (DecodeState, LoopConfig, bucket, check_steps_per_check, decode_chunk,
                               default_steps_per_check, prefill, state_specs)
from dflash_jax.loading.models import DTYPES, Draft, Target, load_draft, load_target, loaded_config
from dflash_jax.model.kernel_shapes import check_kernel_shapes
from dflash_jax.runtime.sampling import SamplingConfig
from dflash_jax.model.sharding import (TensorParallel, cache_specs, local_config, local_draft_config, make_mesh, named,
                                 replicated)
from dflash_jax.loading.tokenizer import Tokenizer, chat_options, read_prompt_file, render_prompts
from pallas_kernels.tuning import next_power_of_2
from tqdm import tqdm


@dataclasses.dataclass
class GenerationStats:
    """Per-sequence acceptance lengths (tokens emitted per step, bonus included, as the paper
    counts τ) and timings. Compile time is measured apart and excluded from tok/s."""

    accept_lengths: list[list[int]]
    new_tokens: list[int]
    block_size: int
    compile_seconds: float
    prefill_seconds: float
    decode_seconds: float
    # per sequence: "stop" (ended at a stop token) or "length" (cut at its max_new_tokens)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [len(a) for a in self.accept_lengths]

    @property
    def tau(self) -> float:
        """Mean tokens per speculation step over all sequences."""
        flat = [n for seq in self.accept_lengths for n in seq]
        return float(np.mean(flat)) if flat else float("nan")

    def tau_per_sequence(self) -> list[float]:
        return [float(np.mean(a)) if a else float("nan") for a in self.accept_lengths]

    def histogram(self) -> list[int]:
        """counts[k-1] = steps that emitted k tokens, k = 1..block_size."""
        counts = np.zeros(self.block_size, np.int64)
        for seq in self.accept_lengths:
            for n in seq:
                counts[n - 1] += 1
        return counts.tolist()

    def position_acceptance(self) -> list[float]:
        """rate[i-1] = fraction of steps whose draft token i (1..block-1) was accepted. Steps cut
        short by a stop token or max_new_tokens count as rejections from the cut on."""
        flat = np.array([n for seq in self.accept_lengths for n in seq])
        if flat.size == 0:
            return []
        return [float(np.mean(flat > i)) for i in range(1, self.block_size)]

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens emitted after the first one, over the decode time (NaN when
        none was: max_new_tokens 1, or every sequence stopped at its first token)."""
        decoded = sum(self.new_tokens) - len(self.new_tokens)
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds else float("nan")

    def speedup_over(self, baseline: GenerationStats) -> float | None:
        """Decode tok/s over ``baseline``'s; None when either decoded nothing."""
        ours, theirs = self.tokens_per_second, baseline.tokens_per_second
        return None if math.isnan(ours) or math.isnan(theirs) else ours / theirs

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    def summary(self) -> dict:
        """The statistics as JSON values; tau and tok/s are None when undefined (no step taken,
        nothing decoded after the first token)."""
        defined = lambda x: None if math.isnan(x) else x  # noqa: E731
        return {"tau": defined(self.tau), "steps": self.steps,
                "new_tokens": self.new_tokens, "histogram": self.histogram(),
                "position_acceptance": self.position_acceptance(),
                "tokens_per_second": defined(self.tokens_per_second), "time_to_first_token": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "compile_seconds": self.compile_seconds,
                "finish_reasons": self.finish_reasons}


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]        # new tokens per sequence (stop token included when hit)
    stats: GenerationStats


def _per_sequence(value, batch: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries for {batch} prompts")
        return list(value)
    return [value] * batch


def _integers(values, name: str) -> list[int]:
    """``values`` (a sequence or array of integers) as ints; ValueError naming ``name`` otherwise
    (floats would be truncated silently)."""
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    return array.tolist()


def _stop_lists(stop_token_ids, batch: int, vocab_size: int) -> list[list[int]]:
    """Each row's stop ids from None, one id, one list for every row or a list per row (lists,
    tuples or arrays); ids outside the vocabulary are named in a warning (they never stop)."""
    def scalar(x) -> bool:  # a number, numpy's and jax's 0-d arrays included
        return isinstance(x, numbers.Number) or getattr(x, "ndim", None) == 0

    if stop_token_ids is None:
        return [[] for _ in range(batch)]
    items = [stop_token_ids] if scalar(stop_token_ids) else list(stop_token_ids)
    if all(scalar(item) for item in items):  # one list for every row
        rows = [_integers(items, "stop_token_ids")] * batch
    else:
        rows = [_integers(row, f"stop_token_ids[{i}]")
                for i, row in enumerate(_per_sequence(items, batch, "stop_token_ids"))]
    in_vocabulary([t for row in rows for t in row], vocab_size)
    return rows


def in_vocabulary(stop_ids: Sequence[int], vocab_size: int, source: str = "") -> list[int]:
    """The stop ids that a sequence can emit; a warning (prefixed ``source``) names the others."""
    outside = sorted({t for t in stop_ids if not 0 <= t < vocab_size})
    if outside:
        warnings.warn(f"{source}stop token id(s) {outside} lie outside the vocabulary ({vocab_size} tokens) and "
                      "can never stop a sequence", stacklevel=2)
    return [t for t in stop_ids if 0 <= t < vocab_size]


def _stop_array(rows: list[list[int]]) -> np.ndarray:
    """[batch, S] stop ids, -1 padded; S a power of two (few shapes to compile)."""
    width = next_power_of_2(max(1, max(len(r) for r in rows)))
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], np.int32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def replay_alpha_array(replay_alpha: float | jax.Array | None,
                       tensor_parallel: TensorParallel | None = None) -> jax.Array | None:
    """A replay acceptance probability as the float32 device scalar a decode chunk takes (on
    every device of ``tensor_parallel``'s mesh), so a timed chunk copies nothing to the device
    (an array already placed so is passed as is)."""
    if replay_alpha is None:
        return None
    if not isinstance(replay_alpha, jax.Array):
        replay_alpha = jax.device_put(np.float32(replay_alpha))
    return replicated(replay_alpha, tensor_parallel)


def _generated(rows: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Each row of a host buffer [B, N] (tokens, accept lengths) cut at its count [B]."""
    return [row[:count].tolist() for row, count in zip(rows, counts)]


def _abstract_on_mesh(abstract, spec_tree, tensor_parallel: TensorParallel | None):
    """ShapeDtypeStructs of ``abstract`` carrying the shardings of ``spec_tree`` (what a split
    program is compiled for)."""
    if tensor_parallel is None:
        return abstract
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract,
                        named(spec_tree, tensor_parallel.mesh))


@dataclasses.dataclass
class PreparedGeneration:
    """A batch ready to run: compiled prefill and decode chunk, and everything they take.

    ``prefill()`` makes a fresh cache each call, so one preparation can be run many times
    (benchmarks do); ``chunk(state)`` advances every sequence by up to ``chunk_steps`` steps.
    """

    config: LoopConfig
    target: Target
    draft: Draft | None
    inputs: tuple                  # prompts, prompt_lens, max_new_tokens, stop_tokens
    sampling: SamplingConfig       # as_arrays: its values are run-time inputs
    page_table: np.ndarray
    num_pages: int
    page_size: int
    max_steps: int                 # steps the buffers hold: a row takes at most max_new_tokens - 1
    chunk_steps: int
    prefill_fn: Callable
    chunk_fn: Callable
    compile_seconds: float

    def _cache_args(self) -> tuple:
        """``zeroed_cache``'s arguments for this batch."""
        draft = None if self.config.draft is None else self.config.draft.model
        return (jnp.asarray(self.page_table, jnp.int32), self.config.target, draft, self.num_pages, self.page_size,
                self.target.params.embed.dtype, self.config.tensor_parallel)

    def new_cache(self) -> PagedKVCache:
        return zeroed_cache(*self._cache_args())

    def prefill(self, seed: int = 0) -> DecodeState:
        check_seed(seed)
        return self.prefill_fn(self.target.params, self._draft_params, *self.inputs, self.new_cache(),
                               replicated(jax.random.key(seed), self.config.tensor_parallel), self.sampling)

    def chunk(self, state: DecodeState, replay_alpha: float | jax.Array | None = None) -> DecodeState:
        """Advance every sequence by up to ``chunk_steps`` steps (``state`` is donated); a
        ``replay_alpha`` from ``replay_alpha_array`` is passed without a host-to-device copy."""
        return self.chunk_fn(self.target.params, self._draft_params, state,
                             replay_alpha_array(replay_alpha, self.config.tensor_parallel))

    @property
    def _draft_params(self):
        return None if self.draft is None else self.draft.params

    def run(self, seed: int = 0, *, on_chunk: Callable[[list[list[int]]], None] | None = None,
            replay_alpha: float | None = None) -> GenerationResult:
        """Prefill and decode until every sequence is done (``generate`` documents the arguments).
        ``on_chunk`` gets each chunk's tokens as soon as they reach the host; the time it takes
        is counted in neither ``prefill_seconds`` nor ``decode_seconds``."""
        if self.config.accept_replay != (replay_alpha is not None):
            raise ValueError("replay_alpha must be given exactly when the batch was prepared with accept_replay")
        if replay_alpha is not None and not 0 <= replay_alpha <= 1:
            raise ValueError(f"replay_alpha (an acceptance probability) must be in [0, 1], got {replay_alpha}")
        alpha = replay_alpha_array(replay_alpha, self.config.tensor_parallel)
        batch = self.inputs[0].shape[0]
        if jax.process_count() > 1:  # the others may still be compiling: time the prefill, not the wait
            multihost_utils.sync_global_devices("dflash_jax prefill")
        start = time.perf_counter()
        state = jax.block_until_ready(self.prefill(seed))
        prefill_seconds = time.perf_counter() - start
        if on_chunk is not None:  # the prefill's token: streamed text starts at the time to first token
            counts, tokens = jax.device_get((state.num_generated, state.tokens))
            on_chunk(_generated(tokens, counts))
        start = time.perf_counter()
        streaming_seconds = 0.0  # on_chunk's, taken out of decode_seconds
        # Each step emits a token for every unfinished row, so every row is done within this
        # many chunks; a loop past it is a bug, reported rather than run for ever.
        max_chunks = -(-self.max_steps // self.chunk_steps) + 1
        for _ in range(max_chunks):
            state = self.chunk(state, alpha)
            done, counts, *tokens = jax.device_get((state.done, state.num_generated)
                                                   + ((state.tokens,) if on_chunk else ()))
            if tokens:
                shown = time.perf_counter()
                on_chunk(_generated(tokens[0], counts))
                streaming_seconds += time.perf_counter() - shown
            if done.all():
                break
        else:
            raise RuntimeError(f"sequences {np.flatnonzero(~done).tolist()} were not done after {max_chunks} chunks of "
                               f"{self.chunk_steps} steps, more than their {self.max_steps} steps allow (a bug)")
        decode_seconds = time.perf_counter() - start - streaming_seconds

        steps, accept, out, stops = jax.device_get((state.steps, state.accept_lengths, state.tokens, self.inputs[3]))
        finish = ["stop" if counts[i] and out[i, counts[i] - 1] in set(stops[i].tolist()) - {-1} else "length"
                  for i in range(batch)]
        stats = GenerationStats(accept_lengths=_generated(accept, steps),
                                new_tokens=counts.tolist(), block_size=self.config.block_size,
                                compile_seconds=self.compile_seconds, prefill_seconds=prefill_seconds,
                                decode_seconds=decode_seconds, finish_reasons=finish)
        return GenerationResult(tokens=_generated(out, counts), stats=stats)


def check_prompts(config: ModelConfig, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int | Sequence[int], names: Sequence[str] | None = None) -> list[int]:
    """Each row's max_new_tokens, after checking that the prompts are non-empty token ids of the
    target's vocabulary and fit its positions with their new tokens (ValueError naming the
    prompt: as ``names`` has it, else ``prompt i``); needs only the target's config, so a CLI can
    check before loading weights."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    names = names or [f"prompt {i}" for i in range(len(prompts))]
    vocab, limit = config.vocab_size, config.max_position_embeddings
    max_new = _integers(_per_sequence(max_new_tokens, len(prompts), "max_new_tokens"), "max_new_tokens")
    if min(max_new) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    for name, prompt, m in zip(names, prompts, max_new, strict=True):
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        ids = _integers(prompt, name)
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab})")
        n = len(prompt)
        if n + m > limit:
            fits = f"at most {limit - n} new tokens fit after it" if n < limit else "the prompt alone is too long"
            raise ValueError(f"{name} has {n} tokens: with max_new_tokens {m} it needs {n + m} positions, "
                             f"more than the target's max_position_embeddings {limit} ({fits})")
    return max_new


def prepare(target: Target, prompts: Sequence[Sequence[int]], *, draft: Draft | None = None,
            max_new_tokens: int | Sequence[int] = 128, sampling: SamplingConfig | None = None,
            stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
            block_size: int | None = None, page_size: int = 16, num_pages: int | None = None,
            impl: str = "auto", chunk_steps: int | None = None, steps_per_check: int | None = None,
            accept_replay: bool = False) -> PreparedGeneration:
    """Validate a batch, allocate its pages and compile its prefill and decode chunk (the
    arguments are those of ``generate``). Raises before any device work on bad input."""
    sampling = sampling or SamplingConfig()
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    batch = len(prompts)
    max_new = check_prompts(target.config, prompts, max_new_tokens)
    check_page_size(target.config, page_size)
    if draft is not None:
        draft.config.check_target(target.config)
        if draft.params.fc.dtype != target.params.embed.dtype:
            raise ValueError(f"the draft's weights are {draft.params.fc.dtype} and the target's "
                             f"{target.params.embed.dtype}: load both in one dtype (their K/V share one cache)")
        block_size = draft.config.block_size if block_size is None else block_size
    elif block_size not in (None, 1):
        raise ValueError("block_size needs a draft")
    elif accept_replay:
        raise ValueError("accept_replay replays the acceptance of a draft's proposals: it needs a draft")
    tensor_parallel = target.tensor_parallel
    if draft is not None and draft.tensor_parallel != tensor_parallel:
        raise ValueError("the draft and the target must be on the same mesh (load the draft with its split target, "
                         "or split both with models.split_target / split_draft)")
    config = LoopConfig(target=target.config, draft=None if draft is None else draft.config,
                        block_size=1 if block_size is None else block_size, impl=impl, accept_replay=accept_replay,
                        tensor_parallel=tensor_parallel)

    local = config if tensor_parallel is None else config.local()  # the shapes each device's kernels see
    configs = [local.target] + ([local.draft.model] if draft is not None else [])
    check_kernel_shapes(impl, configs, page_size, config.block_size, target.params.embed.dtype.itemsize)
    lens = [len(p) for p in prompts]
    padded_len = _round_up(bucket(max(lens)), page_size)
    # Pages for every position a sequence may write: its prompt and its last block. The prefill
    # runs every row padded to the longest prompt; padding positions past a row's pages map to
    # the sentinel page, whose writes are dropped, and their outputs are never read. The pool and
    # the table's width are rounded up (``_bucket``), the table padded with the sentinel page.
    touched = [n + m + config.block_size for n, m in zip(lens, max_new)]
    if num_pages is None:
        num_pages = bucket(sum(max(1, -(-t // page_size)) for t in touched))
    page_table, num_pages = allocate_pages(touched, page_size, num_pages)
    width = bucket(page_table.shape[1])
    page_table = np.pad(page_table, ((0, 0), (0, width - page_table.shape[1])), constant_values=num_pages)

    tokens = np.zeros((batch, padded_len), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    inputs = replicated((jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), jnp.asarray(max_new, jnp.int32),
                          jnp.asarray(_stop_array(_stop_lists(stop_token_ids, batch, target.config.vocab_size)))),
                         tensor_parallel)
    max_steps = bucket(max(max_new))  # buffers; each row stops at its own max_new_tokens
    num_steps = chunk_steps or max_steps
    if chunk_steps is not None and chunk_steps < 1:
        raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    if steps_per_check is None:
        steps_per_check = default_steps_per_check(num_steps)
    check_steps_per_check(num_steps, steps_per_check)  # before compiling anything
    # Sized by the draft's trained block, not the run-time one: one prefill serves every block size.
    buffer_len = max_steps + (draft.config.block_size if draft is not None else 1)
    statics = dict(config=config.for_prefill(), buffer_len=buffer_len, max_steps=max_steps)
    prepared = PreparedGeneration(config, target, draft, inputs, replicated(sampling.as_arrays(), tensor_parallel),
                                  page_table, num_pages, page_size, max_steps, num_steps, None, None, 0.0)
    cache_shape = jax.eval_shape(prepared.new_cache)
    check_cache_fits(cache_shape, tensor_parallel)
    if tensor_parallel is not None:
        cache_shape = _abstract_on_mesh(cache_shape, cache_specs(cache_shape, tensor_parallel), tensor_parallel)
    args = (target.params, prepared._draft_params, *inputs, cache_shape,
            replicated(jax.random.key(0), tensor_parallel), prepared.sampling)
    start = time.perf_counter()
    zeroed_cache.lower(*prepared._cache_args()).compile()  # jit's cache keeps it for new_cache
    prepared.prefill_fn = prefill.lower(*args, **statics).compile()
    state_shape = jax.eval_shape(lambda *a: prefill(*a, **statics), *args)
    alpha = jax.ShapeDtypeStruct((), jnp.float32) if accept_replay else None
    if tensor_parallel is not None:
        state_shape = _abstract_on_mesh(state_shape, state_specs(state_shape, tensor_parallel), tensor_parallel)
        alpha = _abstract_on_mesh(alpha, P(), tensor_parallel) if accept_replay else None
    prepared.chunk_fn = decode_chunk.lower(target.params, prepared._draft_params, state_shape, alpha,
                                           config=config, num_steps=num_steps,
                                           steps_per_check=steps_per_check).compile()
    prepared.compile_seconds = time.perf_counter() - start
    return prepared


def generate(target: Target, prompts: Sequence[Sequence[int]], *, draft: Draft | None = None,
             max_new_tokens: int | Sequence[int] = 128, sampling: SamplingConfig | None = None,
             stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
             block_size: int | None = None, page_size: int = 16, num_pages: int | None = None,
             seed: int = 0, impl: str = "auto", chunk_steps: int | None = None,
             steps_per_check: int | None = None, on_chunk: Callable[[list[list[int]]], None] | None = None,
             accept_replay: float | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths.

    With ``draft`` it runs DFlash speculative decoding (block size = the draft's unless
    ``block_size`` is given); without, plain autoregressive decoding. Greedy output is the same
    either way. ``max_new_tokens`` and ``stop_token_ids`` may be per sequence. ``on_chunk``
    receives the tokens so far after the prefill (each row's first token) and after every
    ``chunk_steps`` steps (streaming); inside a chunk the
    loop looks for finished rows every ``steps_per_check`` steps (``decode.default_steps_per_check``;
    the output is the same for any value, only speed changes). ``impl`` picks
    kernels or references (see dflash_jax.model.ops). ``accept_replay`` is a
    benchmark-only override of the accept decision (each draft accepted with that probability).
    """
    prepared = prepare(target, prompts, draft=draft, max_new_tokens=max_new_tokens, sampling=sampling,
                       stop_token_ids=stop_token_ids, block_size=block_size, page_size=page_size,
                       num_pages=num_pages, impl=impl, chunk_steps=chunk_steps,
                       steps_per_check=steps_per_check, accept_replay=accept_replay is not None)
    return prepared.run(seed, on_chunk=on_chunk, replay_alpha=accept_replay)


# ----------------------------------------------------------------------------- command line


def _read_prompts(args) -> dict[str, str | list[dict]]:
    """--prompt (a default when neither is given), or the prompts of --batch-file, by how output
    and errors cite them: ``--prompt``, or the file and line (``prompts.txt:3``)."""
    if not args.batch_file:
        if args.prompt == "":
            raise ValueError("--prompt is empty")
        return {"--prompt": DEFAULT_PROMPT if args.prompt is None else args.prompt}
    if args.prompt is not None:
        raise ValueError("give --prompt or --batch-file, not both")
    path = "/dev/stdin" if args.batch_file == "-" else args.batch_file  # one name in warnings, errors and rows
    return {f"{path}:{line}": prompt for line, prompt in read_prompt_file(path, "--batch-file").items()}


def _open_jsonl(path: str | None):
    """--output-jsonl's stream: None, standard output for "-", else the file (created or emptied)."""
    if path is None:
        return None
    if path == "-":
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--output-jsonl {path}: {error.strerror}") from error


def _as_given(prompt: str | list[dict]) -> str:
    """A prompt as its user gave it, never rendered through the chat template: its text, or a
    chat's messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def check_seed(seed) -> None:
    """ValueError unless ``seed`` is an int in [0, 2**32): jax.random.key takes it modulo 2**32,
    so any other value would silently repeat another seed's samples."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def _check_flags(args, draft_dir, processes: distributed.Processes | None) -> None:
    """Reject bad numeric flags before any model is loaded (the library checks them too, later)."""
    for flag in ("max_new_tokens", "page_size", "chunk_steps", "steps_per_check"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.block_size is not None and draft_dir is None:
        raise ValueError("--block-size needs a draft")
    if args.replicate_draft and (args.tp == 1 or draft_dir is None):
        raise ValueError("--replicate-draft needs --tp > 1 and a draft")
    if args.expert_parallel and args.tp == 1:
        raise ValueError("--expert-parallel needs --tp > 1")
    if processes is not None and processes.num_processes > 1 and args.tp != jax.device_count():
        raise ValueError(f"--tp {args.tp}: {processes.num_processes} processes split the model over all their "
                         f"devices, {jax.device_count()} in all: pass --tp {jax.device_count()}")
    chat_options(args)
    check_seed(args.seed)
    if args.steps_per_check is not None:
        check_steps_per_check(args.chunk_steps, args.steps_per_check)
    if args.stats_json and distributed.is_first(processes):  # the process that writes it
        if Path(args.stats_json).is_dir():
            raise IsADirectoryError(f"--stats-json {args.stats_json} is a folder: give a file name")
        if not Path(args.stats_json).parent.is_dir():
            raise FileNotFoundError(f"--stats-json {args.stats_json}: its folder does not exist")
        if not os.access(Path(args.stats_json).parent, os.W_OK):
            raise PermissionError(f"--stats-json {args.stats_json}: its folder is not writable")


@contextlib.contextmanager
def _out_of_memory_as_error():
    """A device allocation failure (XLA's RESOURCE_EXHAUSTED) as a ValueError saying what to cut."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise ValueError(f"out of device memory ({str(error).splitlines()[0][:200]}): use fewer prompts per "
                         "batch, a smaller --max-new-tokens or a smaller --page-size") from error


def _print_stats(label: str, result: GenerationResult, with_draft: bool) -> None:
    stats = result.stats
    print(f"\n[{label}] {sum(stats.new_tokens)} tokens, {or_na(stats.tokens_per_second, '{:.1f}')} tok/s decode, "
          f"time to first token {stats.time_to_first_token * 1e3:.1f} ms "
          f"(compile {stats.compile_seconds:.1f} s, not counted)", file=sys.stderr)
    stopped = stats.finish_reasons.count("stop")
    print(f"[{label}] finished: {stopped} at a stop token, {len(stats.finish_reasons) - stopped} cut at "
          "--max-new-tokens", file=sys.stderr)
    if with_draft:
        hist = stats.histogram()
        print(f"[{label}] tau (mean accepted length, bonus included) {or_na(stats.tau, '{:.2f}')} over "
              f"{sum(stats.steps)} steps; block {stats.block_size}", file=sys.stderr)
        print(f"[{label}] accepted-length histogram 1..{stats.block_size}: {hist}", file=sys.stderr)
        rates = " ".join(f"{r:.2f}" for r in stats.position_acceptance())
        print(f"[{label}] per-position acceptance: {rates or 'n/a'}", file=sys.stderr)


# The library arguments that generate's flags set: in its errors they are named as the flags.
FLAGS = ("temperature", "top_p", "top_k", "max_new_tokens", "page_size", "chunk_steps", "steps_per_check",
         "block_size")


def _warn_ignored_flags(args, sampling: SamplingConfig, draft_dir) -> None:
    """A warning for each flag the run would ignore."""
    if args.baseline and draft_dir is None:
        warnings.warn("--baseline compares DFlash with plain decoding; with no draft there is nothing to compare")
    if sampling.greedy and (args.top_p != 1.0 or args.top_k):
        warnings.warn("--top-p and --top-k shape sampling; at --temperature 0 decoding is greedy and ignores them")


def _first_difference(ours: list[list[int]], base: list[list[int]]) -> str:
    """Where two batches of token lists first differ, for the --baseline comparison."""
    for i, (a, b) in enumerate(zip(ours, base)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"first difference: sequence {i}, new token {j}"
    return "no difference"


def _print_comparison(result: GenerationResult, base: GenerationResult, sampling: SamplingConfig, dtype: str) -> None:
    """The --baseline comparison: DFlash's speedup, and whether the outputs are identical."""
    identical = base.tokens == result.tokens
    print(f"[compare] speedup {or_na(result.stats.speedup_over(base.stats), '{:.2f}x')} over plain decoding; "
          f"outputs identical: {identical}" + ("" if sampling.greedy else " (sampling: not expected)"),
          file=sys.stderr)
    if not identical and sampling.greedy:
        print(f"[compare] {_first_difference(result.tokens, base.tokens)}"
              + ("" if dtype == "float32" else
                 f"; in {dtype} a block verify and a one-token decode round differently, so "
                 "a near-tie argmax can flip (--dtype float32, with JAX_DEFAULT_MATMUL_PRECISION="
                 "highest on a GPU, compares exactly)"), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The command line on ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    return run(generate_parser().parse_args(argv))


@one_line_warnings()
@interrupt_exits()
def run(args) -> int:
    """The command line on its parsed arguments (``generate_parser``); its exit status."""
    try:
        processes = distributed.initialize(args)  # before anything touches a device
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.dtype = args.dtype or default_dtype()
    with warnings.catch_warnings():
        if not distributed.is_first(processes):
            warnings.simplefilter("ignore")  # every process reads the same input: process 0 warns
        return _generate(args, processes)


def _generate(args, processes: distributed.Processes | None) -> int:
    """``run`` after the ``processes`` (None: this one alone) have joined: only process 0 prints
    results and writes --stats-json; the others compute beside it and print only errors."""
    leader = distributed.is_first(processes)
    target_dir, draft_dir = args.target, args.draft
    if target_dir is None:
        if not (DEFAULT_MODEL / "target" / "config.json").is_file():
            print("No model to run: this install has no embedded default model yet.\n"
                  f"Pass an HF target folder ({', '.join(target_families())}; or one made by "
                  "`python -m checkpoints_convert`):\n"
                  "  python -m dflash_jax.generate --target /path/to/Qwen3-8B "
                  "--draft /path/to/Qwen3-8B-DFlash-b16 --prompt 'Hello'", file=sys.stderr)
            return 2
        target_dir, draft_dir = DEFAULT_MODEL / "target", draft_dir or DEFAULT_MODEL / "draft"
        if args.baseline is None:  # the demo compares with plain decoding unless told not to
            args.baseline = not args.no_draft
    if args.no_draft:
        draft_dir = None
    # Everything that reads the user's input, cheapest first; weights last. Every process
    # reads its own copy (another host's files may be missing): if one fails, all stop.
    try:
        with distributed.stop_together():
            with named_as_flags(FLAGS):
                sampling = SamplingConfig(args.temperature, args.top_p, args.top_k)
                _check_flags(args, draft_dir, processes)
            _warn_ignored_flags(args, sampling, draft_dir)
            target_config = load_target_config(target_dir)  # a swapped or wrong folder fails here
            with named_as_flags(FLAGS):
                check_page_size(target_config, args.page_size)
            if draft_dir:
                draft_config = load_draft_config(draft_dir)
                try:
                    draft_config.check_target(target_config)
                except ValueError as error:
                    if args.target is None:  # the user's draft beside the embedded target
                        raise ValueError(f"{error} (no --target was given, so the target is the embedded "
                                         f"default model {target_dir}: pass your draft's target)") from error
                    raise
                if args.block_size is not None and not 2 <= args.block_size <= draft_config.block_size:
                    raise ValueError(f"--block-size must be in [2, {draft_config.block_size}] (the draft's "
                                     f"trained block size), got {args.block_size}")
            tokenizer = Tokenizer(target_dir)
            stop_ids = in_vocabulary(tokenizer.stop_token_ids, target_config.vocab_size, f"{target_dir}: ")
            given = _read_prompts(args)
            jsonl = _open_jsonl(args.output_jsonl) if leader else None
            texts = render_prompts(tokenizer, list(given.values()), **chat_options(args), flag="--batch-file")
            prompts = [tokenizer.encode(t) for t in texts]
            # what prepare checks, before the weights
            check_prompts(target_config, prompts, args.max_new_tokens, names=list(given))
            block = (args.block_size or draft_config.block_size) if draft_dir else 1
            tensor_parallel = None
            local_configs = [target_config] + ([draft_config.model] if draft_dir else [])
            if args.tp > 1:
                tensor_parallel = TensorParallel(make_mesh(args.tp), replicate_draft=args.replicate_draft,
                                                 expert_parallel=args.expert_parallel)
                as_loaded = loaded_config(target_dir, args.dtype, args.mxfp4_experts, args.tp)  # (experts dequantised?)
                local_configs = [local_config(as_loaded, args.tp, expert_parallel=args.expert_parallel)]
                if draft_dir:
                    local_configs.append(local_draft_config(draft_config, tensor_parallel).model)
            check_kernel_shapes(args.impl, local_configs, args.page_size, block, jnp.dtype(DTYPES[args.dtype]).itemsize)
            keep_compiled_programs(args.compile_cache)
            target = load_target(target_dir, args.dtype, progress=leader, tensor_parallel=tensor_parallel,
                                  mxfp4_experts=args.mxfp4_experts)
            draft = load_draft(draft_dir, target, args.dtype, progress=leader) if draft_dir else None
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    streaming = len(prompts) == 1 and args.output_jsonl != "-"   # standard output then holds the JSON alone
    if leader:
        print(f"target {target_dir}" + (f", draft {draft_dir} (block {args.block_size or draft.config.block_size})"
                                        if draft else ", no draft") + f", {args.dtype}, jax {jax.__version__} on "
              + (f"{args.tp} x " if args.tp > 1 else "") + f"{jax.local_devices()[0].device_kind}"
              + (f" over {jax.process_count()} processes" if jax.process_count() > 1 else "")
              + (" (draft replicated)" if args.replicate_draft else ""), file=sys.stderr)
        if args.dtype == "bfloat16" and jax.default_backend() == "cpu":
            print("hint: on a CPU, bfloat16 runs 2-3x slower than float32 (the CPU default: leave out --dtype)",
                  file=sys.stderr)

    names, given_prompts = list(given), list(given.values())

    @_out_of_memory_as_error()
    def run(use_draft: Draft | None, stream: bool, report: bool) -> GenerationResult:
        """Every prompt through one engine (continuous batching over --max-num-seqs slots): a
        single prompt streams its text; a batch prints each answer as it finishes (and writes
        it to --output-jsonl), with a progress bar."""
        longest = max(len(p) for p in prompts)
        with distributed.stop_together():  # its memory check is each device's own
            engine = Engine(target, use_draft, tokenizer, max_num_seqs=min(args.max_num_seqs, len(prompts)),
                            max_model_len=longest + args.max_new_tokens, page_size=args.page_size,
                            block_size=args.block_size if use_draft else None, chunk_steps=args.chunk_steps,
                            steps_per_check=args.steps_per_check, impl=args.impl, stop_token_ids=stop_ids,
                            top_k_cap=max(args.top_k, 1), seed=args.seed)
        if stream and not args.completion_only:  # a chat's answer is a turn of its own: it starts a line
            print(_as_given(given_prompts[0]) + ("\n" if args.chat else ""), end="", flush=True)
        progress = tqdm(total=len(prompts), unit="prompt", file=sys.stderr, disable=not report or stream,
                        dynamic_ncols=True)
        start = time.monotonic()

        def on_output(index: int, output: RequestOutput) -> None:
            if stream:
                print(output.text, end="\n" if output.finished else "", flush=True)
            if not output.finished:
                return
            request = requests[index]
            if report and not stream:
                header = "" if args.completion_only else \
                    f"=== {names[index]} {json.dumps(given_prompts[index], ensure_ascii=False)}\n"
                if jsonl is not sys.stdout:
                    print(f"{header}{request.text}\n", flush=True)
                progress.update()
                progress.set_postfix_str(f"{engine.stats.generation_tokens / (time.monotonic() - start):.1f} tok/s")
            if report and jsonl is not None:
                steps = request.accept_lengths
                jsonl.write(json.dumps({"index": index, "prompt_name": names[index], "prompt": given_prompts[index],
                                        "text": request.text, "token_ids": request.token_ids,
                                        "finish_reason": output.finish_reason, "accept_lengths": steps,
                                        "tau": sum(steps) / len(steps) if steps else None},
                                       ensure_ascii=False) + "\n")
                jsonl.flush()

        params = [RequestParams(max_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, sample_index=i)
                  for i in range(len(prompts))]
        # A Ctrl-C takes effect between engine steps: raised anywhere else it can be swallowed (a
        # callback inside jax ignores it) or leave device work in flight.
        with deferred_interrupts("stopping after this step") as interrupted:
            requests = [engine.submit(p, q, on_output=functools.partial(on_output, i))
                        for i, (p, q) in enumerate(zip(prompts, params))]
            while engine.step():
                if interrupted():
                    raise KeyboardInterrupt
        end = time.monotonic()
        progress.close()
        first = min(r.first_token_time for r in requests)
        stats = GenerationStats(accept_lengths=[r.accept_lengths for r in requests],
                                new_tokens=[len(r.token_ids) for r in requests], block_size=engine.config.block_size,
                                compile_seconds=compile_seconds(start, end),
                                prefill_seconds=first - start - compile_seconds(start, first),
                                decode_seconds=end - first - compile_seconds(first, end),
                                finish_reasons=[r.finish_reason for r in requests])
        return GenerationResult(tokens=[r.token_ids for r in requests], stats=stats)

    try:
        result = run(draft, streaming and leader, leader)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if leader:
        _print_stats("dflash" if draft else "plain", result, draft is not None)
    summary = {"dflash" if draft else "plain": result.stats.summary()}
    if draft is not None and args.baseline:
        try:
            base = run(None, False, False)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if leader:
            _print_stats("plain", base, False)
            _print_comparison(result, base, sampling, args.dtype)
        summary["plain"] = base.stats.summary()
        summary["speedup"] = result.stats.speedup_over(base.stats)
    if jsonl not in (None, sys.stdout):
        jsonl.close()
    if args.stats_json and leader:
        try:
            Path(args.stats_json).write_text(json.dumps(summary, indent=2, allow_nan=False))
        except OSError as error:  # the statistics are on stderr above
            print(f"error: --stats-json: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    exit_with(main)

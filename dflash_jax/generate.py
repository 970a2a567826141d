"""Batched generation with or without a DFlash draft: the Python API and the CLI.

    python -m dflash_jax.generate --target DIR [--draft DIR] --prompt "def fib(n):" [--chat]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cache import allocate_pages, init_cache
from dflash_jax.decode import DecodeState, LoopConfig, decode_chunk, prefill
from dflash_jax.models import Draft, Target, load_draft, load_target
from dflash_jax.sampling import SamplingConfig


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
        """Decode throughput: tokens emitted after the first one, over the decode time."""
        return (sum(self.new_tokens) - len(self.new_tokens)) / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    def summary(self) -> dict:
        return {"tau": self.tau, "steps": self.steps, "new_tokens": self.new_tokens,
                "histogram": self.histogram(), "position_acceptance": self.position_acceptance(),
                "tokens_per_second": self.tokens_per_second, "time_to_first_token": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "compile_seconds": self.compile_seconds}


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


def _stop_array(stop_token_ids, batch: int) -> np.ndarray:
    if stop_token_ids is None:
        rows = [[] for _ in range(batch)]
    elif all(isinstance(t, (int, np.integer)) for t in stop_token_ids):
        rows = [list(stop_token_ids)] * batch
    else:
        rows = _per_sequence(list(stop_token_ids), batch, "stop_token_ids")
    width = max(1, max(len(r) for r in rows))
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], np.int32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def generate(target: Target, prompts: Sequence[Sequence[int]], *, draft: Draft | None = None,
             max_new_tokens: int | Sequence[int] = 128, sampling: SamplingConfig | None = None,
             stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
             block_size: int | None = None, page_size: int = 16, num_pages: int | None = None,
             seed: int = 0, impl: str = "auto", chunk_steps: int | None = None,
             on_chunk: Callable[[list[list[int]]], None] | None = None,
             accept_replay: float | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths.

    With ``draft`` it runs DFlash speculative decoding (block size = the draft's unless
    ``block_size`` is given); without, plain autoregressive decoding. Greedy output is the same
    either way. ``on_chunk`` receives the tokens so far after every ``chunk_steps`` steps (for
    streaming). ``accept_replay`` is a benchmark-only override of the accept decision.
    """
    sampling = sampling or SamplingConfig()
    batch = len(prompts)
    if batch == 0:
        raise ValueError("prompts is empty")
    vocab = target.config.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
    max_new = [int(n) for n in _per_sequence(max_new_tokens, batch, "max_new_tokens")]
    if min(max_new) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if draft is not None:
        draft.config.check_target(target.config)
        block_size = draft.config.block_size if block_size is None else block_size
    elif block_size not in (None, 1):
        raise ValueError("block_size needs a draft")
    config = LoopConfig(target=target.config, draft=None if draft is None else draft.config,
                        block_size=block_size or 1, sampling=sampling, impl=impl, accept_replay=accept_replay)

    lens = [len(p) for p in prompts]
    padded_len = _round_up(max(lens), page_size)
    # Every position a sequence may touch: its padded prompt, and its last block.
    touched = [max(padded_len, n + m + config.block_size) for n, m in zip(lens, max_new)]
    limit = target.config.max_position_embeddings
    if max(n + m for n, m in zip(lens, max_new)) > limit:
        raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings ({limit})")
    page_table, num_pages = allocate_pages(touched, page_size, num_pages)
    dtype = target.params.embed.dtype
    groups = [(target.config, target.config.num_layers)]
    if draft is not None:
        groups.append((draft.config.model, draft.config.model.num_layers))
    cache = init_cache(groups, page_table, num_pages, page_size, dtype)

    tokens = np.zeros((batch, padded_len), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    max_steps = max(max_new)
    buffer_len = max_steps + config.block_size
    prefill_args = (target.params, None if draft is None else draft.params, jnp.asarray(tokens),
                    jnp.asarray(lens, jnp.int32), jnp.asarray(max_new, jnp.int32),
                    jnp.asarray(_stop_array(stop_token_ids, batch)), cache, jax.random.key(seed))
    chunk = chunk_steps or max_steps

    compile_start = time.perf_counter()
    prefill_fn = prefill.lower(*prefill_args, config=config, buffer_len=buffer_len,
                               max_steps=max_steps).compile()
    state_shape = jax.eval_shape(lambda *a: prefill(*a, config=config, buffer_len=buffer_len,
                                                    max_steps=max_steps), *prefill_args)
    chunk_fn = decode_chunk.lower(target.params, prefill_args[1], state_shape, config=config,
                                  num_steps=chunk).compile()
    compile_seconds = time.perf_counter() - compile_start

    start = time.perf_counter()
    state: DecodeState = jax.block_until_ready(prefill_fn(*prefill_args))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while True:
        state = chunk_fn(target.params, prefill_args[1], state)
        done, counts, out = jax.device_get((state.done, state.num_generated, state.tokens))
        if on_chunk is not None:
            on_chunk([out[i, :counts[i]].tolist() for i in range(batch)])
        if done.all():
            break
    decode_seconds = time.perf_counter() - start

    steps, accept = jax.device_get((state.steps, state.accept_lengths))
    stats = GenerationStats(accept_lengths=[accept[i, :steps[i]].tolist() for i in range(batch)],
                            new_tokens=counts.tolist(), block_size=config.block_size,
                            compile_seconds=compile_seconds, prefill_seconds=prefill_seconds,
                            decode_seconds=decode_seconds)
    return GenerationResult(tokens=[out[i, :counts[i]].tolist() for i in range(batch)], stats=stats)

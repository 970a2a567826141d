"""The generate command line: prompts (or a batch file) through the library's ``generate``.

    python -m dflash_jax.generate --target DIR [--draft DIR] --prompt "def fib(n):" [--chat]

The flags are ``arguments.generate_parser``'s; ``main`` parses them and ``run`` runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from dflash_jax.entrypoints.arguments import DEFAULT_MODEL, DEFAULT_PROMPT, generate_parser, target_families
from dflash_jax.entrypoints.cli import (default_dtype, deferred_interrupts, exit_with, interrupt_exits,
                                        keep_compiled_programs, named_as_flags, one_line_warnings, or_na)
from dflash_jax.loading.models import DTYPES, Draft, load_draft, load_target, loaded_config, mxfp4_step_tokens
from dflash_jax.loading.tokenizer import Tokenizer, chat_options, read_prompt_file, render_prompts
from dflash_jax.model.cache import check_page_size
from dflash_jax.model.hf_config import load_draft_config, load_target_config
from dflash_jax.model.kernel_shapes import check_kernel_shapes
from dflash_jax.model.sharding import TensorParallel, local_config, local_draft_config, make_mesh
from dflash_jax.runtime import distributed
from dflash_jax.runtime.decode import check_steps_per_check
from dflash_jax.runtime.engine import Request, RequestOutput
from dflash_jax.runtime.generation import GenerationResult, check_prompts, check_seed, generate, in_vocabulary
from dflash_jax.runtime.sampling import SamplingConfig


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
            # what generate checks, before the weights
            check_prompts(target_config, prompts, args.max_new_tokens, names=list(given))
            block = (args.block_size or draft_config.block_size) if draft_dir else 1
            step_tokens = mxfp4_step_tokens(args.impl, min(len(prompts), args.max_num_seqs), block)
            tensor_parallel = None
            local_configs = [target_config] + ([draft_config.model] if draft_dir else [])
            if args.tp > 1:
                tensor_parallel = TensorParallel(make_mesh(args.tp), replicate_draft=args.replicate_draft,
                                                 expert_parallel=args.expert_parallel)
                as_loaded = loaded_config(target_dir, args.dtype, args.mxfp4_experts, args.tp,  # (experts dequantised?)
                                          step_tokens)
                local_configs = [local_config(as_loaded, args.tp, expert_parallel=args.expert_parallel)]
                if draft_dir:
                    local_configs.append(local_draft_config(draft_config, tensor_parallel).model)
            check_kernel_shapes(args.impl, local_configs, args.page_size, block, jnp.dtype(DTYPES[args.dtype]).itemsize)
            keep_compiled_programs(args.compile_cache)
            target = load_target(target_dir, args.dtype, progress=leader, tensor_parallel=tensor_parallel,
                                  mxfp4_experts=args.mxfp4_experts, step_tokens=step_tokens)
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
        if stream and not args.completion_only:  # a chat's answer is a turn of its own: it starts a line
            print(_as_given(given_prompts[0]) + ("\n" if args.chat else ""), end="", flush=True)
        progress = tqdm(total=len(prompts), unit="prompt", file=sys.stderr, disable=not report or stream,
                        dynamic_ncols=True)
        start, generated = time.monotonic(), 0

        def on_output(index: int, request: Request, output: RequestOutput) -> None:
            nonlocal generated
            generated += len(output.token_ids)
            if stream:
                print(output.text, end="\n" if output.finished else "", flush=True)
            if not output.finished:
                return
            if report and not stream:
                header = "" if args.completion_only else \
                    f"=== {names[index]} {json.dumps(given_prompts[index], ensure_ascii=False)}\n"
                if jsonl is not sys.stdout:
                    print(f"{header}{request.text}\n", flush=True)
                progress.update()
                progress.set_postfix_str(f"{generated / (time.monotonic() - start):.1f} tok/s")
            if report and jsonl is not None:
                steps = request.accept_lengths
                jsonl.write(json.dumps({"index": index, "prompt_name": names[index], "prompt": given_prompts[index],
                                        "text": request.text, "token_ids": request.token_ids,
                                        "finish_reason": output.finish_reason, "accept_lengths": steps,
                                        "tau": sum(steps) / len(steps) if steps else None},
                                       ensure_ascii=False) + "\n")
                jsonl.flush()

        # A Ctrl-C takes effect between engine steps: raised anywhere else it can be swallowed (a
        # callback inside jax ignores it) or leave device work in flight.
        with deferred_interrupts("stopping after this step") as interrupted:
            def between_steps() -> None:
                if interrupted():
                    raise KeyboardInterrupt

            with distributed.stop_together():  # the engine's memory check is each device's own
                result = generate(target, prompts, draft=use_draft, tokenizer=tokenizer,
                                  max_new_tokens=args.max_new_tokens, sampling=sampling, stop_token_ids=stop_ids,
                                  block_size=args.block_size if use_draft else None, page_size=args.page_size,
                                  seed=args.seed, impl=args.impl, chunk_steps=args.chunk_steps,
                                  steps_per_check=args.steps_per_check, max_num_seqs=args.max_num_seqs,
                                  on_output=on_output, on_step=between_steps)
        progress.close()
        return result

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

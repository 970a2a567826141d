"""Where the offline engine's time goes at one concurrency: the same requests run twice, once as
the engine runs them (host overlapping device) and once with every prefill call, decode chunk and
slot update waited for and timed, so the device programs' own times, the host's share and what
the overlap hides can be read apart. Random weights at a real shape, acceptance replayed.

    PYTHONPATH=. python3 benchmarks/engine_breakdown.py --shape qwen3-8b --concurrency 32 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import word_tokenizer  # noqa: E402
from common import (SHAPES, acceptance_rate, add_engine_options, add_routing_option, check_routing,  # noqa: E402
                    engine_run_models, output_dir, positive_int, positive_ints, random_prompts, run_record, write_json)

from dflash_jax.runtime.engine import device as engine_module  # noqa: E402
from dflash_jax.entrypoints.cli import COMPILE_CACHE_HELP, reported_as_errors  # noqa: E402
from dflash_jax.runtime.engine import Engine, RequestParams, compile_seconds  # noqa: E402

PROGRAMS = ("prefill_slots", "engine_chunk", "admit_slots", "set_page_rows", "release_slots")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    p.add_argument("--out", type=output_dir, help="write engine_breakdown.json here")
    p.add_argument("--concurrency", type=positive_int, default=32, help="the engine's slots")
    p.add_argument("--rounds", type=positive_int, default=3, help="requests per slot")
    p.add_argument("--prompt-len", type=positive_int, default=512)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--alpha", type=acceptance_rate, default=0.86, help="replayed acceptance of the DFlash runs")
    p.add_argument("--blocks", type=positive_ints, default=[16, 8], help="DFlash block sizes (beside plain decoding)")
    p.add_argument("--chunk-steps", type=positive_int, default=8)
    add_engine_options(p, "--prompt-len + --max-tokens")
    add_routing_option(p)
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    args = p.parse_args(argv)
    check_routing(p, args)
    return args


@contextmanager
def waited(times: dict[str, list[float]]):
    """Every engine program waited for and its seconds appended to ``times[name]``."""
    real = {name: getattr(engine_module, name) for name in PROGRAMS}

    def timed(name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = jax.block_until_ready(real[name](*args, **kwargs))
            times.setdefault(name, []).append(time.perf_counter() - start)
            return out
        return call

    for name in PROGRAMS:
        setattr(engine_module, name, timed(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(engine_module, name, fn)


@contextmanager
def reads_timed(times: list[float]):
    """The host's waits for results (``engine._on_host``) appended to ``times``."""
    real = engine_module._on_host

    def on_host(tree):
        start = time.perf_counter()
        out = real(tree)
        times.append(time.perf_counter() - start)
        return out

    engine_module._on_host = on_host
    try:
        yield
    finally:
        engine_module._on_host = real


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds less compilation) for ``prompts`` submitted at once."""
    before, start = engine.stats.generation_tokens, time.monotonic()
    for prompt in prompts:
        engine.submit(prompt, RequestParams(max_tokens=max_tokens, ignore_eos=True))
    engine.run_until_done()
    end = time.monotonic()
    return engine.stats.generation_tokens - before, end - start - compile_seconds(start, end)


def breakdown(engine: Engine, prompts: list[list[int]], args) -> dict:
    run(engine, prompts[:args.concurrency], args.max_tokens)          # compiles; not timed
    reads: list[float] = []
    with reads_timed(reads):
        tokens, wall = run(engine, prompts, args.max_tokens)
    times: dict[str, list[float]] = {}
    with waited(times):
        _, waited_wall = run(engine, prompts, args.max_tokens)
    programs = {name: {"calls": len(t), "seconds": sum(t), "median_ms": 1e3 * float(np.median(t))}
                for name, t in times.items()}
    device = sum(p["seconds"] for p in programs.values())
    prefill = programs.get("prefill_slots", {"seconds": float("nan")})["seconds"]
    return {"tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall, "host_blocked_s": sum(reads),
            "waited_wall_s": waited_wall, "programs": programs, "host_s": waited_wall - device,
            "prompt_tok_s": len(prompts) * args.prompt_len / prefill}


def main(argv=None) -> int:
    args = parse_args(argv)
    target, draft = engine_run_models(args)
    prompts = random_prompts(np.random.default_rng(0), args.concurrency * args.rounds, args.prompt_len,
                             target.config.vocab_size)
    report = {**run_record(args), "rows": []}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = word_tokenizer(target.config.vocab_size, Path(folder))
        for block in [None, *args.blocks]:
            use_draft = None if block is None else draft
            engine = Engine(target, use_draft, tokenizer, max_num_seqs=args.concurrency,
                            max_model_len=max(args.max_model_len or 0, args.prompt_len + args.max_tokens),
                            block_size=block, chunk_steps=args.chunk_steps, max_waiting=len(prompts),
                            prefix_caching=False,                                # prompts rerun: prefill each
                            accept_replay=None if block is None else args.alpha,
                            speculative_policy=args.speculative_policy,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            batch_invariant=args.batch_invariant)
            engine.warmup(prompt_lengths=[args.prompt_len])
            row = {"mode": "plain" if block is None else f"dflash block {block}", **breakdown(engine, prompts, args)}
            engine.close()      # its KV pool goes before the next engine makes one
            report["rows"].append(row)
            print(line(row), file=sys.stderr, flush=True)
            if args.out:
                write_json(args.out / "engine_breakdown.json", report)
    print(f"{report['device']} | {args.shape} | c {args.concurrency} | {len(prompts)} requests of "
          f"{args.prompt_len} + {args.max_tokens} tokens")
    print("\n".join(line(row) for row in report["rows"]))
    return 0


def line(row: dict) -> str:
    programs = row["programs"]
    parts = ", ".join(f"{name} {p['calls']} x {p['median_ms']:.1f} ms = {p['seconds']:.2f} s"
                      for name, p in programs.items())
    return (f"{row['mode']:<15} {row['output_tok_s']:8.0f} tok/s, {row['wall_s']:.2f} s overlapped (host blocked on "
            f"reads {row['host_blocked_s']:.2f} s) | waited {row['waited_wall_s']:.2f} s: {parts}; host "
            f"{row['host_s']:.2f} s; prefill {row['prompt_tok_s']:.0f} prompt tok/s")


if __name__ == "__main__":
    with reported_as_errors():
        raise SystemExit(main())

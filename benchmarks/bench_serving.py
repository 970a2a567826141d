"""Serving benchmark: the OpenAI-compatible server over random models at a real shape, driven by
concurrent streaming clients (the async ``openai`` client), plain decoding against DFlash with
acceptance replayed at ``--alpha``; the offline engine on the same batches in the same run.

Per concurrency c: a server with c slots (or ``--max-num-seqs``), DFlash under
``--speculative-policy`` (adaptive, as ``serve``'s default), in this process (uvicorn in a
thread, 127.0.0.1, a free port); c clients each send ``--rounds`` requests one after another
(prompts of ``--prompt-len`` random token ids, ``--max-tokens`` new tokens, ``ignore_eos``), all
streamed. The clients run in a process of their own (as vLLM's serving benchmark does), so
their parsing does not take the server's interpreter lock. Reports output tok/s (all tokens over
the wall time), TTFT p50/p99, effective TPOT (per request: time after the first token over the
tokens after it; mean), ITL p99 (gaps between streamed chunks: DFlash delivers bursts), mean
acceptance (tokens per DFlash step, from the server's spec-decode counters), the mean block width
verified, and the offline engine's tok/s on the same prompts with c slots.
``--soak-seconds S`` then keeps ``--soak-concurrency`` clients busy for S seconds against one
DFlash server and reports its KV pages in use and the device's memory before and after.

Random weights: speed does not depend on their values; the text is a synthetic word-level
vocabulary ("w123 "), one word per token.

    PYTHONPATH=. python3 benchmarks/bench_serving.py --shape qwen3-8b --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, acceptance_rate, engine_run_models, output_dir, positive_int, positive_ints,  # noqa: E402
                    random_prompts, run_record, write_json)

from dflash_jax.entrypoints.cli import COMPILE_CACHE_HELP, reported_as_errors  # noqa: E402
from dflash_jax.runtime.engine import Engine, RequestParams, compile_seconds  # noqa: E402
from dflash_jax.entrypoints.server import BackgroundServer  # noqa: E402
from dflash_jax.loading.tokenizer import Tokenizer  # noqa: E402

MODEL = "bench"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    p.add_argument("--out", type=output_dir, help="write bench_serving.json here")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=positive_int, default=4, help="requests each client sends, one after another")
    p.add_argument("--prompt-len", type=positive_int, default=512)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--alpha", type=acceptance_rate, default=0.86, help="replayed acceptance of the DFlash runs")
    p.add_argument("--modes", default="baseline,dflash", help="comma list of baseline, dflash")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--chunk-steps", type=positive_int, default=8)
    p.add_argument("--speculative-policy", choices=("fixed", "adaptive"), default="adaptive",
                   help="the DFlash runs' policy (the server's default: adaptive)")
    p.add_argument("--max-num-seqs", type=positive_int,
                   help="the servers' slots (default: the concurrency of the row)")
    p.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="the engines' step token budget while prompts wait (default: the engine's)")
    p.add_argument("--max-model-len", type=positive_int,
                   help="the engines' context (default: --prompt-len + --max-tokens; one value across runs "
                        "lets --compile-cache serve them all)")
    p.add_argument("--skip-offline", action="store_true", help="no offline-engine rows")
    p.add_argument("--soak-seconds", type=float, default=0.0)
    p.add_argument("--soak-concurrency", type=positive_int, default=64)
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - {"baseline", "dflash"}:
        p.error(f"--modes: baseline and/or dflash, got {','.join(args.modes)}")
    return args


def word_tokenizer(vocab_size: int, folder: Path) -> Tokenizer:
    """A word-level tokenizer of ``vocab_size`` words "w0".."wN" (each token decodes to a word)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tokenizer = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Metaspace(replacement=" ", prepend_scheme="never")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    return Tokenizer(folder)


async def _one_request(client, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft": stamps[0] - start, "end": end - start, "tokens": tokens,
            "itl": np.diff(stamps).tolist(), "tpot": (end - stamps[0]) / max(tokens - 1, 1)}


async def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """``concurrency`` clients taking the prompts in turn; (per-request records, wall seconds)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    queue = list(prompts)
    records: list[dict] = []

    async def worker():
        while queue:
            records.append(await _one_request(client, queue.pop(), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return records, wall


def drive_elsewhere(clients: ProcessPoolExecutor, url: str, prompts: list[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[dict], float]:
    """``drive`` in the clients' process."""
    return clients.submit(_drive_sync, url, prompts, concurrency, max_tokens).result()


def _drive_sync(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    return asyncio.run(drive(url, prompts, concurrency, max_tokens))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[dict], wall: float, stats) -> dict:
    itl = [gap for r in records for gap in r["itl"]]
    tokens = sum(r["tokens"] for r in records)
    drafts = stats.num_drafts
    return {"requests": len(records), "tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "ttft_p50_ms": 1e3 * _percentile([r["ttft"] for r in records], 50),
            "ttft_p99_ms": 1e3 * _percentile([r["ttft"] for r in records], 99),
            "tpot_ms": 1e3 * statistics.fmean(r["tpot"] for r in records),
            "itl_p99_ms": 1e3 * _percentile(itl, 99),
            "tau": 1 + stats.num_accepted_tokens / drafts if drafts else None,
            "verified": 1 + stats.num_draft_tokens / drafts if drafts else None}


def context_length(args) -> int:
    """The engines' max_model_len: ``--max-model-len``, else a prompt and its new tokens."""
    needed = args.prompt_len + args.max_tokens
    if args.max_model_len is not None and args.max_model_len < needed:
        raise SystemExit(f"--max-model-len {args.max_model_len} is below --prompt-len + --max-tokens ({needed})")
    return args.max_model_len or needed


def offline(target, draft, tokenizer, prompts, concurrency: int, args, alpha) -> dict:
    """The same prompts through an engine stepped in this thread (no HTTP; no prefix caching, as
    the server's): tok/s over the wall time less compilation."""
    engine = Engine(target, draft, tokenizer, max_num_seqs=concurrency, max_model_len=context_length(args),
                    block_size=args.block_size if draft else None, chunk_steps=args.chunk_steps, prefix_caching=False,
                    accept_replay=alpha, speculative_policy=args.speculative_policy,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    params = RequestParams(max_tokens=args.max_tokens, ignore_eos=True)
    start = time.monotonic()
    for prompt in prompts:
        engine.submit(prompt, params)
    engine.run_until_done()
    end = time.monotonic()
    wall = end - start - compile_seconds(start, end)
    return {"output_tok_s": engine.stats.generation_tokens / wall, "wall_s": wall}


def engine_for(target, draft, tokenizer, slots: int, args, alpha) -> Engine:
    """A server's engine, its programs compiled (``Engine.warmup``, as ``serve`` does); no prefix
    caching: the warm-up's prompts come again in the timed run, and every prompt is to be
    prefilled as a new one would be."""
    engine = Engine(target, draft, tokenizer, max_num_seqs=args.max_num_seqs or slots,
                    max_model_len=context_length(args),
                    block_size=args.block_size if draft else None, chunk_steps=args.chunk_steps,
                    max_waiting=100000, prefix_caching=False, accept_replay=alpha,
                    speculative_policy=args.speculative_policy, max_num_batched_tokens=args.max_num_batched_tokens)
    start = time.monotonic()
    programs = engine.warmup(prompt_lengths=[args.prompt_len])
    print(f"  {engine.slots} slots, {'DFlash' if draft else 'baseline'}: {programs} programs compiled in "
          f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return engine


def soak(target, draft, tokenizer, args, rng, clients: ProcessPoolExecutor, progress) -> dict:
    """``--soak-concurrency`` clients for ``--soak-seconds`` against one DFlash server; after
    every round (c requests) ``progress`` gets the figures so far (a run cut off keeps them)."""
    c = args.soak_concurrency
    engine = engine_for(target, draft, tokenizer, c, args, args.alpha)
    memory = lambda: (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use")  # noqa: E731
    with BackgroundServer(engine, MODEL) as server:
        warm = random_prompts(rng, c, args.prompt_len, target.config.vocab_size)
        drive_elsewhere(clients, server.url, warm, c, args.max_tokens)
        figures = {"seconds": args.soak_seconds, "concurrency": c, "pages_total": engine.num_pages,
                   "before": {"pages_in_use": engine.pages_in_use, "device_bytes_in_use": memory()}}
        start, rounds, requests, tokens, elapsed = time.monotonic(), 0, 0, 0, 0.0
        while elapsed < args.soak_seconds:  # (the figures' elapsed: a last round reports >= the soak)
            batch = random_prompts(rng, c, args.prompt_len, target.config.vocab_size)
            records = drive_elsewhere(clients, server.url, batch, c, args.max_tokens)[0]
            rounds, requests, tokens = rounds + 1, requests + len(records), tokens + sum(r["tokens"] for r in records)
            elapsed = time.monotonic() - start
            figures.update(elapsed_s=elapsed, requests=requests, tokens=tokens, output_tok_s=tokens / elapsed,
                           after={"pages_in_use": engine.pages_in_use, "device_bytes_in_use": memory()})
            progress(figures)
            print(f"  soak: {elapsed:.0f} s, {rounds} rounds, {requests} requests, pages in use "
                  f"{engine.pages_in_use}", file=sys.stderr, flush=True)
    return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    target, draft = engine_run_models(args)
    rng = np.random.default_rng(0)
    report = {**run_record(args), "rows": []}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder, ProcessPoolExecutor(1, mp_context=spawn) as clients:
        tokenizer = word_tokenizer(target.config.vocab_size, Path(folder))
        for c in args.concurrency:
            prompts = random_prompts(rng, c * args.rounds, args.prompt_len, target.config.vocab_size)
            for mode in args.modes:
                use_draft, alpha = (draft, args.alpha) if mode == "dflash" else (None, None)
                engine = engine_for(target, use_draft, tokenizer, c, args, alpha)
                with BackgroundServer(engine, MODEL) as server:
                    url = server.url
                    drive_elsewhere(clients, url, prompts[:c], c, args.max_tokens)        # not timed
                    counted = ("num_drafts", "num_accepted_tokens", "num_draft_tokens")
                    stats_before = {name: getattr(server.engine.stats, name) for name in counted}
                    records, wall = drive_elsewhere(clients, url, prompts, c, args.max_tokens)
                    stats = server.engine.stats
                    for name in counted:
                        setattr(stats, name, getattr(stats, name) - stats_before[name])
                    row = {"concurrency": c, "mode": mode, **summarize(records, wall, stats)}
                engine.close()       # its KV pool goes before the next engine makes one
                if not args.skip_offline:
                    offline(target, use_draft, tokenizer, prompts[:c], c, args, alpha)    # compiles; not timed
                    timed = offline(target, use_draft, tokenizer, prompts, c, args, alpha)
                    row["offline_tok_s"] = timed["output_tok_s"]
                    row["server_over_offline"] = row["output_tok_s"] / row["offline_tok_s"]
                report["rows"].append(row)
                print(table(report).splitlines()[-1], file=sys.stderr, flush=True)
                if args.out:
                    write_json(args.out / "bench_serving.json", report)
        if args.soak_seconds > 0 and "dflash" in args.modes:
            def progress(figures: dict) -> None:
                report["soak"] = figures
                if args.out:
                    write_json(args.out / "bench_serving.json", report)
            progress(soak(target, draft, tokenizer, args, rng, clients, progress))
    print(table(report))
    return 0


def table(report: dict) -> str:
    lines = [f"{report['device']} | jax {report['jax']} | {report['date']} | {report['settings']['shape']} | "
             f"prompt {report['settings']['prompt_len']}, max_tokens {report['settings']['max_tokens']}, "
             f"alpha {report['settings']['alpha']}",
             "  c  mode      tok/s   offline  srv/off  TTFT p50  p99 ms   TPOT ms  ITL p99   tau  width  speedup"]
    base = {r["concurrency"]: r["output_tok_s"] for r in report["rows"] if r["mode"] == "baseline"}
    for r in report["rows"]:
        speedup = r["output_tok_s"] / base[r["concurrency"]] if r["mode"] == "dflash" and r["concurrency"] in base \
            else None
        lines.append(f"{r['concurrency']:>3}  {r['mode']:<8} {r['output_tok_s']:>7.1f} "
                     f"{r.get('offline_tok_s', float('nan')):>9.1f} {r.get('server_over_offline', float('nan')):>8.2f} "
                     f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>7.1f} {r['tpot_ms']:>9.2f} {r['itl_p99_ms']:>8.1f} "
                     f"{r['tau'] if r['tau'] is not None else float('nan'):>5.2f} "
                     f"{r.get('verified') or float('nan'):>6.2f} "
                     + (f"{speedup:.2f}x" if speedup else ""))
    if "soak" in report:
        s = report["soak"]
        lines.append(f"soak {s['elapsed_s']:.0f} s at c={s['concurrency']}: {s['requests']} requests, "
                     f"{s['output_tok_s']:.0f} tok/s; pages in use "
                     f"{s['before']['pages_in_use']} -> {s['after']['pages_in_use']} of {s['pages_total']}; device "
                     f"bytes {s['before']['device_bytes_in_use']} -> {s['after']['device_bytes_in_use']}")
    return "\n".join(lines)


if __name__ == "__main__":
    with reported_as_errors():
        raise SystemExit(main())

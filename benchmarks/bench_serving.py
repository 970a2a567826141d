"""Serving benchmark: the OpenAI-compatible server over random models at a real shape, driven by
concurrent streaming clients (the async ``openai`` client), plain decoding against DFlash with
acceptance replayed at ``--alpha``; the offline engine on the same batches in the same run.

Per concurrency c: a server with c slots (or ``--max-num-seqs``: then one server per mode
serves every concurrency, one after another), DFlash under
``--speculative-policy`` (adaptive, as ``serve``'s default), in this process (uvicorn in a
thread, 127.0.0.1, a free port); c clients each send ``--rounds`` requests one after another
(prompts of ``--prompt-len`` random token ids, ``--max-tokens`` new tokens, ``ignore_eos``), all
streamed, after c requests of other prompts that warm the server up (not timed; JSON rows:
as many as they time, as the grammar's programs compile at the first step of each row count,
which ``Engine.warmup`` does not run). The clients run in a
process of their own (as vLLM's serving benchmark does), so their parsing does not take the
server's interpreter lock. Reports output tok/s (all tokens over the wall time), TTFT p50/p99,
effective TPOT (per request: time after the first token over the tokens after it; mean), ITL p99
(gaps between streamed chunks: DFlash delivers bursts), mean acceptance (tokens per DFlash step,
from the server's spec-decode counters), the mean block width verified (and, under adaptive
verification, the step costs each DFlash server measured: ms per step at each width and row
count, ``step_costs_ms`` by the server's slots), DFlash over plain at the
same settings, and the offline engine's tok/s on the same prompts with c slots, after its
warm-up (``Engine.warmup``: adaptive verification's step costs are measured before the clock
starts; ``--skip-offline``: none).

``--shared-prefix-len N``: every prompt starts with the same N random tokens (a shared system
prompt), then its own ``--prompt-len``. ``--prefix-caching on,off`` runs each server with the
engine's prefix caching on, off or both (default: ``on,off`` with a shared prefix; ``off``
without, as random prompts share nothing). Every row reports the prefix cache's hit rate (prompt
tokens found cached over those looked up, the engine's counters; 0 with caching off) and the
prompt tokens prefill ran; a caching-on row its TTFT p50 against the same server's without
caching (``ttft_p50_off_over_on``). The warm-up's prompts share the prefix and nothing else, so
the cache holds the shared prefix only.

``--structured none,json``: plain rows, JSON rows or both, on the same servers. A JSON row's
requests carry ``response_format`` (a JSON schema: an object with one string field "text" of at
most the characters of 7/8 of ``--max-tokens`` - 16 words, so most outputs close before the cap)
and no ``ignore_eos`` (the grammar ends them with the end-of-sequence token); the row counts the
outputs that finished (``json_finished``) and those of them that parse and fit the schema
(``json_valid``).

``--max-num-batched-tokens`` sets the servers' step token budget while prompts wait (the engine's
mixed steps; default: the engine's), ``--max-model-len`` their context (one value across runs lets
``--compile-cache`` serve them all).

``--soak-seconds S`` then keeps ``--soak-concurrency`` clients busy for S seconds against one
DFlash server and reports its KV pages in use and the device's memory before and after.

Random weights: speed does not depend on their values. The text is a synthetic word-level
vocabulary (" w123"), one word per token, whose first ids are JSON's punctuation, a space,
digits, the schema's field name and an end-of-sequence token instead (``JSON_TOKENS``): JSON under
the schema can be written, and inside its string every word is legal, so random drafts mostly
are and the replayed acceptance limits the speed, as with a model whose drafts follow the format.

    PYTHONPATH=. python3 benchmarks/bench_serving.py --shape qwen3-8b --out $OUT
    # a 2000-token system prompt at c32, prefix caching on against off (DFlash servers)
    PYTHONPATH=. python3 benchmarks/bench_serving.py --concurrency 32 --modes dflash --shared-prefix-len 2000 --out $OUT
    # JSON under a schema at c1: DFlash against plain decoding, both under the grammar
    PYTHONPATH=. python3 benchmarks/bench_serving.py --concurrency 1 --structured json --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from common import (SHAPES, acceptance_rate, add_engine_options, add_routing_option, check_routing,  # noqa: E402
                    engine_run_models, names_from, output_dir, positive_int, positive_ints, random_prompts,
                    run_record, write_json)

from dflash_jax.entrypoints.cli import COMPILE_CACHE_HELP, at_least, reported_as_errors  # noqa: E402
from dflash_jax.runtime.engine import Engine, RequestParams, compile_seconds  # noqa: E402
from dflash_jax.runtime.engine.prefix_cache import prefix_caching_unsupported  # noqa: E402
from dflash_jax.runtime.grammar import grammar_from_request  # noqa: E402
from dflash_jax.entrypoints.server import BackgroundServer  # noqa: E402
from dflash_jax.loading.tokenizer import Tokenizer  # noqa: E402

MODEL = "bench"
# The tokenizer's first ids (the rest are words " w<id>"): what JSON under the benchmark's schema
# is written with, and the end-of-sequence token a grammar ends with.
EOS = "</s>"
JSON_TOKENS = ("{", "}", '"', ":", ",", "[", "]", " ", "text", EOS, *"0123456789")
# Counters of the engine's stats a row reports as their change over its timed run.
COUNTED = ("num_drafts", "num_accepted_tokens", "num_draft_tokens", "prefix_cache_queries", "prefix_cache_hits",
           "prefill_tokens_computed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    p.add_argument("--out", type=output_dir, help="write bench_serving.json here")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=positive_int, default=4, help="requests each client sends, one after another")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="each prompt's own tokens")
    p.add_argument("--shared-prefix-len", type=at_least(0), default=0,
                   help="tokens every prompt starts with (a shared system prompt) before its own")
    p.add_argument("--prefix-caching", type=names_from(("on", "off")),
                   help="comma list of on, off: the servers' prefix caching (default: on,off with a shared "
                        "prefix, off without)")
    p.add_argument("--structured", type=names_from(("none", "json")), default=["none"],
                   help="comma list of none (plain text, ignore_eos), json (JSON under a schema): rows per server")
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--alpha", type=acceptance_rate, default=0.86, help="replayed acceptance of the DFlash runs")
    p.add_argument("--modes", default="baseline,dflash", help="comma list of baseline, dflash")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--chunk-steps", type=positive_int, default=8)
    p.add_argument("--max-num-seqs", type=positive_int,
                   help="the servers' slots (default: the concurrency of the row)")
    add_engine_options(p, "--shared-prefix-len + --prompt-len + --max-tokens")
    add_routing_option(p)
    p.add_argument("--skip-offline", action="store_true", help="no offline-engine rows")
    p.add_argument("--soak-seconds", type=float, default=0.0)
    p.add_argument("--soak-concurrency", type=positive_int, default=64)
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    args = p.parse_args(argv)
    check_routing(p, args)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - {"baseline", "dflash"}:
        p.error(f"--modes: baseline and/or dflash, got {','.join(args.modes)}")
    if args.prefix_caching is None:
        args.prefix_caching = ["on", "off"] if args.shared_prefix_len else ["off"]
    target_config, draft_config = SHAPES[args.shape]
    unsupported = prefix_caching_unsupported(target_config, draft_config.model)
    if "on" in args.prefix_caching and unsupported:
        p.error(f"--prefix-caching on: not for --shape {args.shape} ({unsupported})")
    if args.batch_invariant and "on" in args.prefix_caching:
        p.error("--batch-invariant runs without prefix caching: pass --prefix-caching off")
    if args.batch_invariant and "dflash" in args.modes and args.speculative_policy != "fixed":
        p.error("--batch-invariant needs --speculative-policy fixed for the DFlash runs")
    return args


def word_tokenizer(vocab_size: int, folder: Path) -> Tokenizer:
    """A tokenizer of ``vocab_size`` tokens: ``JSON_TOKENS`` first ("</s>" the end-of-sequence
    token), then one word " w<id>" per id. Byte-level (GPT-2's alphabet: a space is "Ġ"), with a
    pre-tokenizer that splits text into exactly these tokens: llguidance tokenizes the text a
    grammar forces (``{"text":"``) with it, and allows only tokens of that tokenization there."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    if vocab_size <= len(JSON_TOKENS):
        raise ValueError(f"a vocabulary of {vocab_size} tokens leaves no words after the {len(JSON_TOKENS)} JSON ones")
    vocab = {token.replace(" ", "Ġ"): i for i, token in enumerate(JSON_TOKENS)}
    vocab.update({f"Ġw{i}": i for i in range(len(JSON_TOKENS), vocab_size)})
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="Ġ"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" w[0-9]+|text|[\s\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return Tokenizer(folder)


def json_response_format(vocab_size: int, max_tokens: int) -> dict:
    """The JSON rows' ``response_format``: an object with one string field "text" of at most the
    characters of 7/8 of ``max_tokens`` - 16 words of the vocabulary's mean length (the object's
    other tokens and a short tail fit in the rest, so most outputs end before the cap); compact
    (llguidance's free whitespace between tokens is off: a random model could emit spaces there
    for ever)."""
    words = range(len(JSON_TOKENS), vocab_size)
    mean_chars = sum(len(f" w{i}") for i in words) / len(words)
    schema = {"type": "object",
              "properties": {"text": {"type": "string", "maxLength": max(1, int(mean_chars * (max_tokens - 16) * 7 / 8))}},
              "required": ["text"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def valid_json(text: str, response_format: dict) -> bool:
    """Whether ``text`` is JSON that ``json_response_format``'s schema accepts."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    limit = response_format["json_schema"]["schema"]["properties"]["text"]["maxLength"]
    return isinstance(value, dict) and set(value) == {"text"} and isinstance(value["text"], str) \
        and len(value["text"]) <= limit


async def _one_request(client, prompt: list[int], max_tokens: int, response_format: dict | None) -> dict:
    start = time.perf_counter()
    stamps, tokens, pieces, finish_reason = [], 0, [], None
    extra = {"ignore_eos": True} if response_format is None else {"response_format": response_format}
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].text:
                stamps.append(time.perf_counter())
                pieces.append(chunk.choices[0].text)
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    record = {"ttft": stamps[0] - start, "end": end - start, "tokens": tokens,
              "itl": np.diff(stamps).tolist(), "tpot": (end - stamps[0]) / max(tokens - 1, 1)}
    if response_format is not None:
        record["finished"] = finish_reason == "stop"
        record["valid"] = record["finished"] and valid_json("".join(pieces), response_format)
    return record


async def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                response_format: dict | None = None) -> tuple[list[dict], float]:
    """``concurrency`` clients taking the prompts in turn, each request under ``response_format``
    (None: plain text, ``ignore_eos``); (per-request records, wall seconds)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    queue = list(prompts)
    records: list[dict] = []

    async def worker():
        while queue:
            records.append(await _one_request(client, queue.pop(), max_tokens, response_format))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return records, wall


def drive_elsewhere(clients: ProcessPoolExecutor, url: str, prompts: list[list[int]], concurrency: int,
                    max_tokens: int, response_format: dict | None = None) -> tuple[list[dict], float]:
    """``drive`` in the clients' process."""
    return clients.submit(_drive_sync, url, prompts, concurrency, max_tokens, response_format).result()


def _drive_sync(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                response_format: dict | None) -> tuple[list[dict], float]:
    return asyncio.run(drive(url, prompts, concurrency, max_tokens, response_format))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[dict], wall: float, counts: dict) -> dict:
    """A row's figures from its requests' records and the change of the engine's ``COUNTED``
    stats over the run."""
    itl = [gap for r in records for gap in r["itl"]]
    tokens = sum(r["tokens"] for r in records)
    drafts = counts["num_drafts"]
    queries = counts["prefix_cache_queries"]
    row = {"requests": len(records), "tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
           "ttft_p50_ms": 1e3 * _percentile([r["ttft"] for r in records], 50),
           "ttft_p99_ms": 1e3 * _percentile([r["ttft"] for r in records], 99),
           "tpot_ms": 1e3 * statistics.fmean(r["tpot"] for r in records),
           "itl_p99_ms": 1e3 * _percentile(itl, 99),
           "tau": 1 + counts["num_accepted_tokens"] / drafts if drafts else None,
           "verified": 1 + counts["num_draft_tokens"] / drafts if drafts else None,
           "prefix_cache_hit_rate": counts["prefix_cache_hits"] / queries if queries else 0.0,
           "prefill_tokens_computed": counts["prefill_tokens_computed"]}
    if records and "valid" in records[0]:
        row["json_finished"] = sum(r["finished"] for r in records)
        row["json_valid"] = sum(r["valid"] for r in records)
    return row


def offline(target, draft, tokenizer, prompts, concurrency: int, args, alpha, *, prefix_caching: bool = False,
            grammar: str | None = None) -> dict:
    """The same prompts through an engine stepped in this thread (no HTTP; prefix caching and
    the grammar as the row's server), after its ``warmup`` (compiled programs, and adaptive
    verification's step costs measured) and, under a grammar, llguidance's view of the tokenizer
    built: tok/s over the wall time less compilation."""
    engine = Engine(target, draft, tokenizer, max_num_seqs=concurrency, max_model_len=max_model_len(args),
                    block_size=args.block_size if draft else None, chunk_steps=args.chunk_steps,
                    prefix_caching=prefix_caching, accept_replay=alpha, speculative_policy=args.speculative_policy,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    batch_invariant=args.batch_invariant)
    engine.warmup(prompt_lengths=prompt_lengths(args, engine))
    if grammar is not None:
        _ = engine.grammar_tokenizer   # built at the first request otherwise (seconds at 150k tokens)
    params = RequestParams(max_tokens=args.max_tokens, ignore_eos=grammar is None, grammar=grammar)
    start = time.monotonic()
    for prompt in prompts:
        engine.submit(prompt, params)
    engine.run_until_done()
    end = time.monotonic()
    wall = end - start - compile_seconds(start, end)
    return {"output_tok_s": engine.stats.generation_tokens / wall, "wall_s": wall}


def max_model_len(args) -> int:
    """The engines' context: ``--max-model-len``, else a prompt (and its shared prefix) and its
    new tokens."""
    needed = args.shared_prefix_len + args.prompt_len + args.max_tokens
    if args.max_model_len is not None and args.max_model_len < needed:
        raise SystemExit(f"--max-model-len {args.max_model_len} is below the prompt and its new tokens ({needed})")
    return args.max_model_len or needed


def prompt_lengths(args, engine: Engine) -> list[int]:
    """The prompt lengths ``engine`` prefills: whole prompts and, with prefix caching, what
    follows the shared prefix's cached pages."""
    length = args.shared_prefix_len + args.prompt_len
    cached = args.shared_prefix_len // engine.page_size * engine.page_size if engine.prefix_caching else 0
    return sorted({length, length - cached})


def engine_for(target, draft, tokenizer, slots: int, args, alpha, prefix_caching: bool = False) -> Engine:
    """A server's engine, its programs compiled (``Engine.warmup``, as ``serve`` does) for the
    prompts' length and, with prefix caching, for what follows a cached shared prefix."""
    engine = Engine(target, draft, tokenizer, max_num_seqs=args.max_num_seqs or slots,
                    max_model_len=max_model_len(args),
                    block_size=args.block_size if draft else None, chunk_steps=args.chunk_steps,
                    max_waiting=100000, prefix_caching=prefix_caching, accept_replay=alpha,
                    speculative_policy=args.speculative_policy,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    batch_invariant=args.batch_invariant)
    start = time.monotonic()
    programs = engine.warmup(prompt_lengths=prompt_lengths(args, engine))
    print(f"  {engine.slots} slots, {'DFlash' if draft else 'baseline'}{', prefix caching' if prefix_caching else ''}: "
          f"{programs} programs compiled in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return engine


def server_rows(server: BackgroundServer, clients: ProcessPoolExecutor, concurrency: int, warm: dict, timed: dict,
                args, response_format: dict | None, settings: dict) -> list[dict]:
    """One row per ``--structured`` kind on one server (``settings``: its mode and prefix
    caching): the requests of ``warm[kind]`` (not timed), then those of ``timed[kind]`` timed,
    with the engine's counters over the timed run."""
    rows = []
    for kind in args.structured:
        request_format = response_format if kind == "json" else None
        drive_elsewhere(clients, server.url, warm[kind], concurrency, args.max_tokens, request_format)
        before = {name: getattr(server.engine.stats, name) for name in COUNTED}
        records, wall = drive_elsewhere(clients, server.url, timed[kind], concurrency, args.max_tokens, request_format)
        counts = {name: getattr(server.engine.stats, name) - before[name] for name in COUNTED}
        rows.append({"concurrency": concurrency, **settings, "structured": kind, **summarize(records, wall, counts)})
    return rows


def compare(rows: list[dict]) -> None:
    """Fill in each row's comparisons with the rows of the same settings so far: a DFlash row's
    tok/s over plain decoding's (``dflash_over_baseline``), a caching-on row's TTFT p50 without
    caching over its own (``ttft_p50_off_over_on``)."""
    def key(row: dict, *drop: str) -> tuple:
        return tuple(row[name] for name in ("concurrency", "mode", "prefix_caching", "structured") if name not in drop)

    plain = {key(r, "mode"): r for r in rows if r["mode"] == "baseline"}
    uncached = {key(r, "prefix_caching"): r for r in rows if not r["prefix_caching"]}
    for row in rows:
        if row["mode"] == "dflash" and key(row, "mode") in plain:
            row["dflash_over_baseline"] = row["output_tok_s"] / plain[key(row, "mode")]["output_tok_s"]
        if row["prefix_caching"] and key(row, "prefix_caching") in uncached:
            row["ttft_p50_off_over_on"] = uncached[key(row, "prefix_caching")]["ttft_p50_ms"] / row["ttft_p50_ms"]


def soak(target, draft, tokenizer, args, new_prompts, clients: ProcessPoolExecutor, progress) -> dict:
    """``--soak-concurrency`` clients for ``--soak-seconds`` against one DFlash server (prompts
    from ``new_prompts(count)``, no prefix caching); after every round (c requests)
    ``progress`` gets the figures so far (a run cut off keeps them)."""
    c = args.soak_concurrency
    engine = engine_for(target, draft, tokenizer, c, args, args.alpha)
    memory = lambda: (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use")  # noqa: E731
    with BackgroundServer(engine, MODEL) as server:
        drive_elsewhere(clients, server.url, new_prompts(c), c, args.max_tokens)
        figures = {"seconds": args.soak_seconds, "concurrency": c, "pages_total": engine.num_pages,
                   "before": {"pages_in_use": engine.pages_in_use, "device_bytes_in_use": memory()}}
        start, rounds, requests, tokens, elapsed = time.monotonic(), 0, 0, 0, 0.0
        while elapsed < args.soak_seconds:  # (the figures' elapsed: a last round reports >= the soak)
            records = drive_elsewhere(clients, server.url, new_prompts(c), c, args.max_tokens)[0]
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
    vocab = target.config.vocab_size
    rng = np.random.default_rng(0)
    shared = random_prompts(rng, 1, args.shared_prefix_len, vocab)[0] if args.shared_prefix_len else []

    def new_prompts(count: int) -> list[list[int]]:
        return [shared + own for own in random_prompts(rng, count, args.prompt_len, vocab)]

    response_format = json_response_format(vocab, args.max_tokens) if "json" in args.structured else None
    grammar = grammar_from_request(response_format) if response_format else None
    report = {**run_record(args), "rows": []}
    if response_format:
        report["response_format"] = response_format
    # Each kind its own prompts, and the warm-up others: a prefix cache holds the shared prefix only.
    # The grammar's programs compile at the first request of each row count (Engine.warmup compiles
    # none), so JSON warms up with as many requests as it times.
    timed = {c: {kind: new_prompts(c * args.rounds) for kind in args.structured} for c in args.concurrency}
    warm = {c: {kind: new_prompts(c * args.rounds if kind == "json" else c) for kind in args.structured}
            for c in args.concurrency}
    # One server per slot count (c, or --max-num-seqs: one for every c), mode and prefix caching.
    by_slots: dict[int, list[int]] = {}
    for c in args.concurrency:
        by_slots.setdefault(args.max_num_seqs or c, []).append(c)
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder, ProcessPoolExecutor(1, mp_context=spawn) as clients:
        tokenizer = word_tokenizer(vocab, Path(folder))
        for slots, concurrencies in by_slots.items():
            for mode in args.modes:
                use_draft, alpha = (draft, args.alpha) if mode == "dflash" else (None, None)
                for caching in args.prefix_caching:
                    on = caching == "on"
                    engine = engine_for(target, use_draft, tokenizer, slots, args, alpha, prefix_caching=on)
                    if engine.device.step_costs is not None:   # adaptive verification's, measured at warmup
                        report.setdefault("step_costs_ms", {})[slots] = {
                            "widths": list(engine.config.widths),
                            "by_rows": {rows: [round(1e3 * float(t), 3) for t in costs]
                                        for rows, costs in engine.device.step_costs.items()}}
                    served = []
                    with BackgroundServer(engine, MODEL) as server:
                        for c in concurrencies:
                            for row in server_rows(server, clients, c, warm[c], timed[c], args, response_format,
                                                   {"mode": mode, "prefix_caching": on}):
                                served.append(row)
                                report["rows"].append(row)
                                compare(report["rows"])
                                print(table(report).splitlines()[-1], file=sys.stderr, flush=True)
                                if args.out:
                                    write_json(args.out / "bench_serving.json", report)
                    engine.close()       # its KV pool goes before the next engine makes one
                    if args.skip_offline:
                        continue
                    for row in served:
                        prompts = timed[row["concurrency"]][row["structured"]]
                        settings = {"prefix_caching": on, "grammar": grammar if row["structured"] == "json" else None}
                        row["offline_tok_s"] = offline(target, use_draft, tokenizer, prompts, row["concurrency"],
                                                       args, alpha, **settings)["output_tok_s"]
                        row["server_over_offline"] = row["output_tok_s"] / row["offline_tok_s"]
                        if args.out:
                            write_json(args.out / "bench_serving.json", report)
        if args.soak_seconds > 0 and "dflash" in args.modes:
            def progress(figures: dict) -> None:
                report["soak"] = figures
                if args.out:
                    write_json(args.out / "bench_serving.json", report)
            progress(soak(target, draft, tokenizer, args, new_prompts, clients, progress))
    print(table(report))
    for slots, costs in report.get("step_costs_ms", {}).items():
        print(f"DFlash server of {slots} slots, step ms at widths {costs['widths']}: "
              + "; ".join(f"{rows} rows {ms}" for rows, ms in costs["by_rows"].items()))
    return 0


def _label(row: dict) -> str:
    return row["mode"] + ("+cache" if row.get("prefix_caching") else "") + (" json" if row.get("structured") == "json"
                                                                            else "")


def table(report: dict) -> str:
    settings = report["settings"]
    shared = f"shared prefix {settings['shared_prefix_len']} + " if settings.get("shared_prefix_len") else ""
    width = max([8] + [len(_label(r)) for r in report["rows"]])
    lines = [f"{report['device']} | jax {report['jax']} | {report['date']} | {settings['shape']} | "
             f"prompt {shared}{settings['prompt_len']}, max_tokens {settings['max_tokens']}, "
             f"alpha {settings['alpha']}",
             f"  c  {'mode':<{width}}   tok/s   offline  srv/off  TTFT p50  p99 ms   TPOT ms  ITL p99   tau  width"
             "  speedup"]
    for r in report["rows"]:
        speedup = r.get("dflash_over_baseline")
        notes = []
        if r.get("prefix_caching"):
            notes.append(f"hit {r['prefix_cache_hit_rate']:.0%}")
            if "ttft_p50_off_over_on" in r:
                notes.append(f"TTFT p50 uncached/cached {r['ttft_p50_off_over_on']:.2f}x")
        if "json_valid" in r:
            notes.append(f"JSON valid {r['json_valid']} of {r['json_finished']} finished ({r['requests']} requests)")
        lines.append(f"{r['concurrency']:>3}  {_label(r):<{width}} {r['output_tok_s']:>7.1f} "
                     f"{r.get('offline_tok_s', float('nan')):>9.1f} {r.get('server_over_offline', float('nan')):>8.2f} "
                     f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>7.1f} {r['tpot_ms']:>9.2f} {r['itl_p99_ms']:>8.1f} "
                     f"{r['tau'] if r['tau'] is not None else float('nan'):>5.2f} "
                     f"{r.get('verified') or float('nan'):>6.2f} "
                     + (f"{speedup:>7.2f}x" if speedup else " " * 8) + ("  " + "; ".join(notes) if notes else ""))
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

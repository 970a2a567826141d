"""``python -m dflash_jax.serve``: the OpenAI-compatible server (``server``) over one engine.

    python -m dflash_jax.serve --target /path/to/Qwen3-8B --draft /path/to/Qwen3-8B-DFlash-b16

Binds 127.0.0.1:8000 unless told otherwise. SIGTERM or Ctrl-C stops accepting requests, lets
the running ones finish (up to --shutdown-timeout seconds) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

import jax

from dflash_jax.cli import (COMPILE_CACHE_HELP, DefaultsHelpFormatter, at_least, exit_with, keep_compiled_programs,
                            one_line_warnings, positive_float)
from dflash_jax.config import load_draft_config, load_target_config
from dflash_jax.engine import Engine
from dflash_jax.models import DTYPES, MXFP4_EXPERTS, MXFP4_EXPERTS_HELP, load_draft, load_target
from dflash_jax.sharding import TensorParallel, make_mesh
from dflash_jax.tokenizer import Tokenizer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.serve", formatter_class=DefaultsHelpFormatter,
                                description="The OpenAI-compatible HTTP server over one serving engine "
                                            "(continuous batching; DFlash with --draft).")
    p.add_argument("--target", required=True, help="HF folder of a supported target, or a converted folder")
    p.add_argument("--draft", help="DFlash draft folder (default: none: plain decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=at_least(1), default=8000, help="port to bind")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the target folder's name)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=16, help="requests decoded together (slots)")
    p.add_argument("--max-model-len", type=at_least(2),
                   help="prompt + generated tokens per request (default: the target's max_position_embeddings)")
    p.add_argument("--num-pages", type=at_least(1),
                   help="KV pages in the pool (default: every slot at --max-model-len, or what 90%% of the free "
                        "device memory holds if less)")
    p.add_argument("--page-size", type=at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--block-size", type=at_least(2), help="speculation block (default: the draft's trained size)")
    p.add_argument("--chunk-steps", type=at_least(1), default=8, help="decode steps per on-device chunk")
    p.add_argument("--prefill-chunk", type=at_least(1), default=512,
                   help="prompt tokens a request prefills per engine step")
    p.add_argument("--max-waiting", type=at_least(1), default=1024, help="queued requests before 503")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and cache dtype")
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas", "interpret"],
                   help="kernels (auto: Pallas where measured faster) or plain-JAX references")
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor parallelism: devices the models split over")
    p.add_argument("--replicate-draft", action="store_true", help="with --tp: the whole draft on every device")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tp: a MoE target's experts dealt out whole instead of split by width")
    p.add_argument("--mxfp4-experts", choices=MXFP4_EXPERTS, default="auto",
                   help=MXFP4_EXPERTS_HELP)
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of requests that give none")
    p.add_argument("--shutdown-timeout", type=positive_float, default=60.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--accept-replay", type=float, metavar="ALPHA",
                   help="benchmarks only: accept each draft token with probability ALPHA instead of by the target "
                        "(the output is then not the target's; default: off)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    return p


@one_line_warnings()
def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from dflash_jax.server import create_app

    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if jax.process_count() > 1:
        print("error: the server runs in one process (several hosts: not supported yet)", file=sys.stderr)
        return 2
    try:
        target_config = load_target_config(args.target)
        if args.draft:
            load_draft_config(args.draft).check_target(target_config)
        tokenizer = Tokenizer(args.target)
        if (args.replicate_draft or args.expert_parallel) and args.tp == 1:
            raise ValueError("--replicate-draft and --expert-parallel need --tp > 1")
        tensor_parallel = TensorParallel(make_mesh(args.tp), replicate_draft=args.replicate_draft,
                                         expert_parallel=args.expert_parallel) if args.tp > 1 else None
        keep_compiled_programs(args.compile_cache)
        target = load_target(args.target, args.dtype, progress=True, tensor_parallel=tensor_parallel,
                             mxfp4_experts=args.mxfp4_experts)
        draft = load_draft(args.draft, target, args.dtype, progress=True) if args.draft else None
        engine = Engine(target, draft, tokenizer, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        num_pages=args.num_pages, page_size=args.page_size, block_size=args.block_size,
                        chunk_steps=args.chunk_steps, prefill_chunk=args.prefill_chunk,
                        max_waiting=args.max_waiting, impl=args.impl, seed=args.seed,
                        accept_replay=args.accept_replay)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(args.target).resolve().name
    start = time.monotonic()
    print("compiling the engine's programs (kept for later starts: --compile-cache)...", file=sys.stderr)
    programs = engine.warmup()
    print(f"{programs} programs ready in {time.monotonic() - start:.1f} s", file=sys.stderr)
    app = create_app(engine, name)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (target {args.target}"
          + (f", draft {args.draft}" if args.draft else ", no draft") + ")", file=sys.stderr)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again for the handler found before
    # it: this one, so that a requested stop exits 0 rather than by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


if __name__ == "__main__":
    exit_with(main)

"""``python -m dflash_jax.serve``: the OpenAI-compatible server (``server``) over one engine.

    python -m dflash_jax.serve --target /path/to/Qwen3-8B --draft /path/to/Qwen3-8B-DFlash-b16

Without --target it serves the embedded default pair. Binds 127.0.0.1:8000 unless told otherwise.
With --api-key (or $DFLASH_API_KEY) every route but /health needs ``Authorization: Bearer <key>``.
SIGTERM or Ctrl-C stops accepting requests, lets the running ones finish (up to
--shutdown-timeout seconds) and exits 0. The flags are ``arguments.serve_parser``'s; ``main``
parses them and ``run`` runs them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import jax

from dflash_jax.entrypoints.arguments import (API_KEY_VARIABLE, CPU_MAX_MODEL_LEN, CPU_MAX_NUM_SEQS, DEFAULT_MODEL,
                                              DEFAULT_MODEL_NAME, MAX_NUM_SEQS, serve_parser)
from dflash_jax.entrypoints.cli import default_dtype, exit_with, keep_compiled_programs, one_line_warnings
from dflash_jax.loading.models import load_draft, load_target, mxfp4_step_tokens
from dflash_jax.loading.tokenizer import Tokenizer
from dflash_jax.model.hf_config import load_draft_config, load_target_config
from dflash_jax.model.sharding import TensorParallel, make_mesh
from dflash_jax.runtime.engine import Engine


def _log_to_stderr(level_name: str) -> None:
    """The server's log lines (its requests, uvicorn's) from ``level_name`` up; jax's own from
    warning up (all of them at debug; $JAX_LOGGING_LEVEL, when set, chooses instead). At info jax
    says, on every machine without a TPU, that it could not initialise the TPU backend: a backend
    it tries quietly wherever $JAX_PLATFORMS names none, which is no news to a server's reader."""
    level = getattr(logging, level_name.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if jax.config.jax_logging_level in (None, "NOTSET"):
        for name in ("jax", "jaxlib"):
            logging.getLogger(name).setLevel(level if level == logging.DEBUG else max(level, logging.WARNING))


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key requests must carry: --api-key's value ``flag``, else $DFLASH_API_KEY in
    ``environ``; None when neither is set. ValueError, naming which of the two, for a key that is
    empty or not printable ASCII without spaces (what an Authorization header carries as it is)."""
    key, source = (flag, "--api-key") if flag is not None else (environ.get(API_KEY_VARIABLE), f"${API_KEY_VARIABLE}")
    if key is not None and not (key and all("!" <= character <= "~" for character in key)):
        raise ValueError(f"{source} must be a non-empty key of printable ASCII without spaces")
    return key


def _prefix_caching_state(engine: Engine, turned_off: bool) -> str:
    """Whether the engine reuses cached prompt prefixes, and why not when it does not."""
    if engine.prefix_caching:
        return "on: --no-prefix-caching"
    if turned_off:
        return "off: --no-prefix-caching"
    return f"off: {engine.prefix_caching_unsupported}"


def main(argv: list[str] | None = None) -> int:
    """The server on ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    return run(serve_parser().parse_args(argv))


@one_line_warnings()
def run(args) -> int:
    """The server on its parsed arguments (``serve_parser``); its exit status."""
    import uvicorn

    from dflash_jax.entrypoints.server import create_app

    _log_to_stderr(args.log_level)
    if jax.process_count() > 1:
        print("error: the server runs in one process (several hosts: not supported yet)", file=sys.stderr)
        return 2
    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or default_dtype()
    target_dir, draft_dir = args.target, args.draft
    if target_dir is None:
        target_dir, draft_dir = DEFAULT_MODEL / "target", draft_dir or DEFAULT_MODEL / "draft"
    try:
        api_key = resolve_api_key(args.api_key, os.environ)
        target_config = load_target_config(target_dir)
        draft_config = load_draft_config(draft_dir) if draft_dir else None
        if draft_dir:
            try:
                draft_config.check_target(target_config)
            except ValueError as error:
                if args.target is None:  # the user's draft beside the embedded target
                    raise ValueError(f"{error} (no --target was given, so the target is the embedded default "
                                     f"model {target_dir}: pass your draft's target)") from error
                raise
        tokenizer = Tokenizer(target_dir)
        max_num_seqs = args.max_num_seqs or (CPU_MAX_NUM_SEQS if on_cpu else MAX_NUM_SEQS)
        max_model_len = args.max_model_len
        if max_model_len is None and on_cpu:
            max_model_len = min(CPU_MAX_MODEL_LEN, target_config.max_position_embeddings)
        if (args.replicate_draft or args.expert_parallel) and args.tp == 1:
            raise ValueError("--replicate-draft and --expert-parallel need --tp > 1")
        tensor_parallel = TensorParallel(make_mesh(args.tp), replicate_draft=args.replicate_draft,
                                         expert_parallel=args.expert_parallel) if args.tp > 1 else None
        keep_compiled_programs(args.compile_cache)
        block = (args.block_size or draft_config.block_size) if draft_dir else 1
        target = load_target(target_dir, dtype, progress=True, tensor_parallel=tensor_parallel,
                             mxfp4_experts=args.mxfp4_experts,
                             step_tokens=mxfp4_step_tokens(args.impl, max_num_seqs, block))
        draft = load_draft(draft_dir, target, dtype, progress=True) if draft_dir else None
        engine = Engine(target, draft, tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        num_pages=args.num_pages, page_size=args.page_size, block_size=args.block_size,
                        chunk_steps=args.chunk_steps, prefill_chunk=args.prefill_chunk,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_waiting=args.max_waiting, impl=args.impl, seed=args.seed,
                        prefix_caching=False if args.no_prefix_caching else None, accept_replay=args.accept_replay,
                        speculative_policy=args.speculative_policy or ("fixed" if args.batch_invariant else "adaptive"),
                        batch_invariant=args.batch_invariant)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    name = args.served_model_name or (Path(target_dir).resolve().name if args.target else DEFAULT_MODEL_NAME)
    start = time.monotonic()
    print("compiling the engine's programs (kept for later starts: --compile-cache)...", file=sys.stderr)
    programs = engine.warmup()
    print(f"{programs} programs ready in {time.monotonic() - start:.1f} s", file=sys.stderr)
    app = create_app(engine, name, api_key=api_key)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (target {target_dir}"
          + (f", draft {draft_dir}" if draft_dir else ", no draft") + f", {dtype}; {max_num_seqs} requests at a time, "
          f"up to {engine.max_model_len} tokens each: --max-num-seqs, --max-model-len; prefix caching "
          f"{_prefix_caching_state(engine, args.no_prefix_caching)})", file=sys.stderr)
    if api_key is not None:
        source = "--api-key" if args.api_key is not None else f"${API_KEY_VARIABLE}"
        print(f"every route but /health needs the API key of {source} (Authorization: Bearer <key>)",
              file=sys.stderr)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again for the handler found before
    # it: this one, so that a requested stop exits 0 rather than by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


if __name__ == "__main__":
    exit_with(main)

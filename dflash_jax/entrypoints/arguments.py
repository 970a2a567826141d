"""The flags of ``python -m dflash_jax.generate`` and ``python -m dflash_jax.serve``, built without
importing jax: a command line parses its arguments first, so --help and a usage error answer at
once, and only a run that goes ahead pays for jax (seconds).

The few values that heavier modules own are read here without importing them: the dtypes of
``loading.models.DTYPES``, the choices of ``loading.models.MXFP4_EXPERTS``, the target families of
``model.families.FAMILIES`` (read from its source); tests hold each copy equal to its original.
The chat flags (also train_draft's) and the several-host flags are defined here.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

from dflash_jax.entrypoints.cli import (COMPILE_CACHE_HELP, DTYPE_DEFAULT_HELP, DefaultsHelpFormatter, at_least,
                                        positive_float)

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "default_model"
DEFAULT_MODEL_NAME = "dflash-jax-default"  # what the server calls the embedded pair
API_KEY_VARIABLE = "DFLASH_API_KEY"  # the server's API key when --api-key is not given
DEFAULT_PROMPT = "def fibonacci(n):\n"
DTYPE_NAMES = ("bfloat16", "float32", "float16")
MXFP4_CHOICES = ("auto", "keep", "dequantize")
MXFP4_EXPERTS_HELP = ("how an MXFP4 checkpoint's routed experts (gpt-oss) are held: keep (MXFP4, decoded by the "
                      "experts' kernel: a quarter of the memory), dequantize (to --dtype at load: faster DFlash "
                      "steps and batches), auto (wherever it is faster: MXFP4 where the experts' kernel runs on "
                      "one GPU and every step runs one token, plain decoding without a draft of one sequence at a "
                      "time; else dequantize where that fits 80%% of a device's memory for JAX)")
IMPLS = ("auto", "reference", "pallas", "interpret", "interpret-tpu")
# A server on a CPU answers its first request in seconds with a small pool: every slot at the
# target's full context (4096 positions x 16 slots for the embedded pair) takes tens of seconds a
# request there.
CPU_MAX_MODEL_LEN, CPU_MAX_NUM_SEQS, MAX_NUM_SEQS = 512, 4, 16


def target_families() -> list[str]:
    """The supported target families by name (``Family.label``; a release and its text-only save
    named once), read from the source of the registry ``dflash_jax.model.families.FAMILIES``:
    importing the registry would import jax."""
    source = Path(importlib.util.find_spec("dflash_jax.model.families").origin)
    registry = next(node.value for node in ast.parse(source.read_text(encoding="utf-8")).body
                    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FAMILIES"])
    labels = [ast.literal_eval(entry.args[1]) for entry in registry.elts]  # Family(name, label, ...), _hybrid(...)
    return list(dict.fromkeys(label.split(" (")[0] for label in labels))


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags generate and serve share: dtype, kernels, tensor parallelism, MXFP4 experts."""
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help=f"float dtype of the weights and the KV cache ({DTYPE_DEFAULT_HELP}: on a CPU bfloat16 "
                        "runs 2-3x slower)")
    p.add_argument("--impl", default="auto", choices=IMPLS,
                   help="auto: on an NVIDIA GPU of compute capability >= 8.0 the kernels that win there (the "
                        "attention kernels, the norm/RoPE kernels that write KV pages, the routed experts, the gated "
                        "delta rule, single-row projections at hidden <= 3072), XLA for the rest; on a TPU the TPU "
                        "kernels; "
                        "references elsewhere. pallas: every kernel of the backend; interpret: the GPU kernels in "
                        "Pallas interpret mode; interpret-tpu: the TPU kernels in TPU interpret mode (both slow; "
                        "for checking on a CPU)")
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor parallelism: split the target (and the draft) over this many devices; each "
                        "device reads only its slices of the checkpoint")
    p.add_argument("--replicate-draft", action="store_true",
                   help="with --tp: a whole copy of the draft on every device instead of splitting it")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tp: deal a MoE target's routed experts out whole (num_experts / N a device) "
                        "instead of splitting every expert's width")
    p.add_argument("--mxfp4-experts", choices=MXFP4_CHOICES, default="auto", help=MXFP4_EXPERTS_HELP)


def _target_help(default: str) -> str:
    return (f"HF folder of a supported target ({', '.join(target_families())}) or a folder made by "
            f"checkpoints_convert (default: {default})")


def add_chat_arguments(parser: argparse.ArgumentParser, chat_help: str) -> None:
    """--chat (described by ``chat_help``), --system and --no-thinking, as generate and
    train_draft take them; ``loading.tokenizer.chat_options`` reads them back."""
    parser.add_argument("--chat", action="store_true", help=chat_help)
    parser.add_argument("--system", help="--chat: a system message before each text prompt (default: no system "
                        "message)")
    parser.add_argument("--no-thinking", action="store_true",
                        help="--chat: pass enable_thinking=false to the template (Qwen3: answer without a "
                             "thinking section)")


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes`` and ``--process-id`` (each defaulting to its
    environment variable), which ``runtime.distributed.initialize`` reads."""
    hosts = parser.add_argument_group("several hosts", "run the same command on every host, each with its own "
                                      "--process-id; all three flags (or their environment variables) or none. "
                                      "--tp then counts every device of every process")
    hosts.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, where the others join (default: $JAX_COORDINATOR_ADDRESS)")
    hosts.add_argument("--num-processes", metavar="N", help="processes in all (default: $JAX_NUM_PROCESSES)")
    hosts.add_argument("--process-id", metavar="I", help="this process, 0 .. N-1 (default: $JAX_PROCESS_ID)")


def generate_parser() -> argparse.ArgumentParser:
    """``python -m dflash_jax.generate``'s flags."""
    p = _parser("python -m dflash_jax.generate", "Generate text for prompts with a target and its DFlash draft "
                                                 "(speculative decoding), or with the target alone.")
    p.add_argument("--target", help=_target_help("the embedded default model, run with its draft and compared "
                                                 "with plain decoding"))
    p.add_argument("--draft", help="DFlash draft folder (z-lab or speculators format, or converted) (default: none, "
                   "plain decoding; without --target, the embedded model's draft)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (baseline)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction,
                   help="also run without the draft and compare outputs and speed (default: on for the embedded "
                        "model, run without --target; off otherwise)")
    p.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r} when there is no --batch-file)")
    p.add_argument("--batch-file", help="one prompt per line (.txt; blank lines are skipped, and output and errors "
                                        "cite each prompt by its line), or per line an object with a \"prompt\" "
                                        "string or a \"messages\" chat (.jsonl); - reads lines of text from standard "
                                        "input (named /dev/stdin). Answers print as they finish (default: none, the "
                                        "one --prompt)")
    p.add_argument("--output-jsonl", metavar="FILE",
                   help="write one JSON object per prompt as it finishes (index, prompt_name, prompt, text, "
                        "token_ids, finish_reason, accept_lengths, tau); - writes them to standard output instead "
                        "of the answers (default: not written)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=MAX_NUM_SEQS,
                   help="prompts decoded together; the others wait and join as earlier ones finish (continuous "
                        "batching: the KV pages for this many at a time)")
    add_chat_arguments(p, "render the prompts with the tokenizer's chat template")
    p.add_argument("--completion-only", action="store_true",
                   help="print only the generated text, not the prompt before it (batches: not the === line)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the most likely tokens whose probabilities reach this sum (1: all tokens)")
    p.add_argument("--top-k", type=int, default=0, help="sample from this many most likely tokens (0: all tokens)")
    p.add_argument("--block-size", type=int, help="speculation block, 2 .. the draft's trained size (default: the "
                   "draft's trained size)")
    _add_model_flags(p)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of the paged KV cache")
    # Each chunk costs ~2.4 ms of host round trip at Qwen3-8B on an H200 (the GPU idles): 13%
    # of the step time at 4 steps per chunk, 4% at 16, which still streams ~10 updates a second.
    p.add_argument("--chunk-steps", type=int, default=16,
                   help="decode steps between streamed updates (fewer: smoother streaming, slower)")
    p.add_argument("--steps-per-check", type=int, default=None,
                   help="decode steps between the loop's checks for finished sequences (must divide "
                        "--chunk-steps; default: the largest of 4, 2, 1 that does)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2**32): the same seed repeats a run's samples")
    p.add_argument("--stats-json", help="write the statistics here as JSON (default: not written; stderr has them)")
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    add_host_arguments(p)
    return p


def serve_parser() -> argparse.ArgumentParser:
    """``python -m dflash_jax.serve``'s flags."""
    p = _parser("python -m dflash_jax.serve", "The OpenAI-compatible HTTP server over one serving engine "
                                              "(continuous batching; DFlash with --draft).")
    p.add_argument("--target", help=_target_help("the embedded default model, with its draft"))
    p.add_argument("--draft", help="DFlash draft folder (default: none: plain decoding; without --target, the "
                                   "embedded model's draft)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=at_least(1), default=8000, help="port to bind")
    p.add_argument("--api-key", metavar="KEY",
                   help="every route but /health then needs the header Authorization: Bearer KEY (401 "
                        f"otherwise); printable ASCII without spaces (default: ${API_KEY_VARIABLE}; unset: no key "
                        "needed)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the target folder's name; "
                                               f"{DEFAULT_MODEL_NAME} for the embedded model)")
    p.add_argument("--max-num-seqs", type=at_least(1),
                   help=f"requests decoded together (slots) (default: {CPU_MAX_NUM_SEQS} on CPU, {MAX_NUM_SEQS} on "
                        "GPU/TPU)")
    p.add_argument("--max-model-len", type=at_least(2),
                   help=f"prompt + generated tokens per request (default: {CPU_MAX_MODEL_LEN} on CPU, so that a CPU "
                        "answers in seconds; the target's max_position_embeddings on GPU/TPU)")
    p.add_argument("--num-pages", type=at_least(1),
                   help="KV pages in the pool (default: every slot at --max-model-len, or what 90%% of the free "
                        "device memory holds if less)")
    p.add_argument("--page-size", type=at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--block-size", type=at_least(2), help="speculation block (default: the draft's trained size)")
    p.add_argument("--chunk-steps", type=at_least(1), default=8, help="decode steps per on-device chunk")
    p.add_argument("--speculative-policy", choices=("fixed", "adaptive"),
                   help="with a draft: verify the whole block every step (fixed), or each step the block width "
                        "with the most expected tokens per second for the requests running, from their acceptance "
                        "so far and step times measured at start-up (adaptive; lossless either way) "
                        "(default: adaptive; fixed with --batch-invariant)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's greedy tokens do not depend on what else runs, in bfloat16 too: every "
                        "program runs at one shape whatever the load (decode chunks of every slot, full prefill "
                        "calls); the fixed policy, no prefix caching")
    p.add_argument("--prefill-chunk", type=at_least(1), default=512,
                   help="prompt tokens a request prefills per engine step")
    p.add_argument("--max-num-batched-tokens", type=at_least(1),
                   help="while prompts wait to be prefilled, the tokens an engine step computes: its prefill "
                        "call's beside its decode chunk's (steps x rows x block); every step runs both, so a "
                        "burst of arrivals never stalls decoding (default: 8 rows x --prefill-chunk beside one "
                        "group of decode steps of every slot)")
    p.add_argument("--max-waiting", type=at_least(1), default=1024, help="queued requests before 503")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt whole instead of reusing the KV pages of prompt prefixes seen before "
                        "(default: reused, except on Qwen3.5 / Qwen3-Next hybrids, whose recurrent state a cached "
                        "prefix cannot restore)")
    _add_model_flags(p)
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of requests that give none")
    p.add_argument("--shutdown-timeout", type=positive_float, default=60.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--accept-replay", type=float, metavar="ALPHA",
                   help="benchmarks only: accept each draft token with probability ALPHA instead of by the target "
                        "(the output is then not the target's; default: off)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the server's log level (jax's own messages from warning up, all of them at debug)")
    p.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    return p

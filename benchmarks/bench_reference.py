"""The z-lab reference (PyPI ``dflash`` + transformers Qwen3, torch) at Qwen3-8B shape on the GPU.

Times its own ``dflash_generate``: with ``block_size=1`` it is plain target decoding (every step
runs one token: decode time over steps); with 16 a DFlash step (random weights accept ~1 token
per step). ``dflash_generate`` shortens the verify block of the last steps to the tokens still
allowed, so the DFlash run generates ``--new-tokens`` + 16 tokens and a pre-hook on the draft
clocks only the steps that verify a whole block (``FullBlockClock``). Also a device-to-device
copy bandwidth. Writes JSON. Needs CUDA; run before the JAX benchmark (separate process: JAX
preallocates GPU memory):

    pip install --no-deps wheels/dflash-0.1.0-py3-none-any.whl
    python3 benchmarks/bench_reference.py --out $OUT/reference.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

BLOCK = 16  # the DFlash block timed; bench_e2e.py compares with its own block-16 cell


class FullBlockClock:
    """Times the steps of one ``dflash_generate`` run that verify a whole ``block``: called with
    each draft call's block length (the step's verify size), it marks the start of the first
    step and of the first shorter one, which ends the full steps (the shortened blocks come only
    at the end); ``now`` must wait for the device."""

    def __init__(self, block: int, now: Callable[[], float]):
        self.block, self.now = block, now
        self.start = self.end = None
        self.full_steps = 0

    def on_draft(self, block_len: int) -> None:
        if self.end is not None:
            return
        if self.start is None:
            self.start = self.now()
        if block_len == self.block:
            self.full_steps += 1
        else:
            self.end = self.now()

    def seconds_per_step(self, finished_at: float) -> float:
        """Mean seconds per full step; ``finished_at``: the run's end, used when no step was short."""
        if not self.full_steps:
            raise RuntimeError(f"no step verified a whole block of {self.block}")
        return ((self.end if self.end is not None else finished_at) - self.start) / self.full_steps


def decode_step_seconds(draft, target, ids, new_tokens: int) -> float:
    """Seconds per step of one plain-decoding ``dflash_generate`` run (block 1: one token a step)."""
    import dflash.model as dm
    out = dm.dflash_generate(draft, target, ids, max_new_tokens=new_tokens, stop_token_ids=None, block_size=1,
                             return_stats=True)
    return out.time_per_output_token * out.num_output_tokens / len(out.acceptance_lengths)


def dflash_step_seconds(draft, target, ids, new_tokens: int, now: Callable[[], float]) -> float:
    """Mean seconds per step of one ``dflash_generate`` run at block ``BLOCK`` over the steps that
    verify a whole block: it generates ``new_tokens`` + BLOCK tokens, and a pre-hook on the draft
    reports each step's block length to a ``FullBlockClock``."""
    import dflash.model as dm
    clock = FullBlockClock(BLOCK, now)
    hook = draft.register_forward_pre_hook(
        lambda module, positional, keywords: clock.on_draft(keywords["noise_embedding"].shape[1]), with_kwargs=True)
    try:
        dm.dflash_generate(draft, target, ids, max_new_tokens=new_tokens + BLOCK, stop_token_ids=None,
                           block_size=BLOCK)
    finally:
        hook.remove()
    return clock.seconds_per_step(now())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings, checked before torch touches the GPU."""
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per timed run (the DFlash "
                        f"run generates {BLOCK} more so that these many steps verify a whole block)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for flag in ("context", "new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a folder; give the JSON file's path")
    return args


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: bench_reference.py times the reference on a CUDA GPU, and torch sees none", file=sys.stderr)
        raise SystemExit(2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                 tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=36, **shape)).eval()
        draft_config = Qwen3Config(num_hidden_layers=5, **shape)
        draft_config.block_size, draft_config.num_target_layers = BLOCK, 36
        draft_config.dflash_config = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
        draft = DFlashDraftModel(draft_config).eval()
    ids = torch.randint(0, 151000, (1, args.context), device="cuda")

    def synced_now() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    def median_after_warmup(run: Callable[[], float]) -> float:
        return statistics.median([run() for _ in range(args.repeats + 1)][1:])

    decode = median_after_warmup(lambda: decode_step_seconds(draft, target, ids, args.new_tokens))
    dflash_step = median_after_warmup(lambda: dflash_step_seconds(draft, target, ids, args.new_tokens, synced_now))
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copies = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    copy_bw = 10 * 2 * src.numel() * 2 / statistics.median(copies[1:])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dflash": metadata.version("dflash"),
              "transformers": metadata.version("transformers"), "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(sys.argv),
              "context": args.context, "new_tokens": args.new_tokens, "repeats": args.repeats, "block": BLOCK,
              "decode_step_s": decode, "dflash_step_s": dflash_step, "copy_bandwidth_bytes_per_s": copy_bw}
    print(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The z-lab reference (PyPI ``dflash`` + transformers Qwen3, torch) at Qwen3-8B shape on the GPU.

Times its own ``dflash_generate``: with ``block_size=1`` it is plain target decoding, with 16 a
DFlash step (random weights accept ~1 token per step, so time per step = time per token x tokens
per step). Also a device-to-device copy bandwidth. Writes JSON. Run before the JAX benchmark
(separate process: JAX preallocates GPU memory):

    pip install --no-deps wheels/dflash-0.1.0-py3-none-any.whl
    python3 benchmarks/bench_reference.py --out $OUT/reference.json
"""

import argparse
import json
import statistics
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import dflash.model as dm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                 tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=36, **shape)).eval()
        draft_config = Qwen3Config(num_hidden_layers=5, **shape)
        draft_config.block_size, draft_config.num_target_layers = 16, 36
        draft_config.dflash_config = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
        draft = dm.DFlashDraftModel(draft_config).eval()
    ids = torch.randint(0, 151000, (1, args.context), device="cuda")

    def step_seconds(block_size):
        runs = []
        for _ in range(args.repeats + 1):
            out = dm.dflash_generate(draft, target, ids, max_new_tokens=args.new_tokens, stop_token_ids=None,
                                     block_size=block_size, return_stats=True)
            runs.append(out.time_per_output_token * out.num_output_tokens / len(out.acceptance_lengths))
        return statistics.median(runs[1:])

    decode, dflash_step = step_seconds(1), step_seconds(16)
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
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "context": args.context, "decode_step_s": decode, "dflash_step_s": dflash_step,
              "copy_bandwidth_bytes_per_s": copy_bw}
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

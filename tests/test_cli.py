"""The generate CLI end to end on a tiny HF folder with a real byte-level BPE tokenizer."""

import json
import subprocess
import sys

import pytest
import torch

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                   "<|im_end|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    vocab = _write_tokenizer(target_dir)
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **shape)).save_pretrained(target_dir)
    dcfg = Qwen3Config(num_hidden_layers=1, **shape)
    dcfg.block_size, dcfg.num_target_layers = 4, 2
    dcfg.dflash_config = {"mask_token_id": 3, "target_layer_ids": [1]}
    dcfg.architectures = ["DFlashDraftModel"]
    DFlashDraftModel(dcfg).save_pretrained(draft_dir)
    return target_dir, draft_dir


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dflash_jax.generate", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_cli_streams_dflash_and_matches_baseline(model_dirs, tmp_path):
    target_dir, draft_dir = model_dirs
    stats = tmp_path / "stats.json"
    run = _cli("--target", target_dir, "--draft", draft_dir, "--prompt", "def fib", "--max-new-tokens", 12,
               "--baseline", "--dtype", "float32", "--stats-json", stats)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def fib")
    assert "outputs identical: True" in run.stderr
    summary = json.loads(stats.read_text())
    assert summary["dflash"]["new_tokens"] == summary["plain"]["new_tokens"]
    assert sum(summary["dflash"]["histogram"]) == sum(summary["dflash"]["steps"])


def test_cli_batch_file_and_chat(model_dirs, tmp_path):
    target_dir, _ = model_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def a\nclass B\n")
    run = _cli("--target", target_dir, "--batch-file", prompts, "--chat", "--max-new-tokens", 5,
               "--temperature", 0.8, "--top-k", 20)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("=== ") == 2 and "<|im_start|>user" in run.stdout


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent"], "not found"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--top-p", "0"], "top_p"),
    (["--block-size", "9"], "block_size"),
])
def test_cli_errors_are_one_line(model_dirs, args, message):
    target_dir, draft_dir = model_dirs
    base = [] if args[0] == "--target" else ["--target", target_dir, "--draft", draft_dir]
    run = _cli(*base, *args)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def test_cli_without_model_explains_what_to_pass(monkeypatch):
    from dflash_jax import generate

    monkeypatch.setattr(generate, "DEFAULT_MODEL", ROOT / "no-such-default")
    assert generate.main([]) == 2

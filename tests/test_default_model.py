"""The embedded default pair: within its size budget, loadable by transformers, lossless, and what
``generate`` and ``serve`` run without --target (chats included)."""

import pytest
import torch

from dflash_jax.generate import DEFAULT_MODEL, generate, main
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.loading.tokenizer import Tokenizer

PROMPTS = ["import os\n\ndef ", "class Stack:\n    def __init__(self):\n", "for i in range("]


def test_default_pair_fits_its_budget():
    files = [p for p in DEFAULT_MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20
    assert max(p.stat().st_size for p in files) <= 16 * 2**20


def test_load_takes_the_three_float_dtypes_by_name_or_object():
    import jax.numpy as jnp
    for dtype in ("int8", jnp.int8, jnp.float64, "f32"):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
            load_target(DEFAULT_MODEL / "target", dtype)
    assert load_target(DEFAULT_MODEL / "target", jnp.float16).params.embed.dtype == jnp.float16


@pytest.fixture(scope="module")
def pair():
    target = load_target(DEFAULT_MODEL / "target", "float32")
    return target, load_draft(DEFAULT_MODEL / "draft", target, "float32"), Tokenizer(DEFAULT_MODEL / "target")


def test_default_pair_is_lossless(pair):
    target, draft, tok = pair
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = generate(target, prompts, max_new_tokens=40, stop_token_ids=tok.stop_token_ids)
    spec = generate(target, prompts, draft=draft, max_new_tokens=40, stop_token_ids=tok.stop_token_ids)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 1.0  # the trained draft does get tokens accepted


def test_default_target_matches_transformers(pair):
    from transformers import Qwen3ForCausalLM

    from dflash_jax.model import target as target_model
    from dflash_jax.model.cache import allocate_pages, init_cache
    import jax.numpy as jnp

    target, _, tok = pair
    ids = tok.encode(PROMPTS[1])
    hf = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    table, pages = allocate_pages([len(ids)], 16)
    cache = init_cache(target.config, None, table, pages, 16, jnp.float32)
    hidden, _, _ = target_model.forward(target.params, target.config, jnp.asarray([ids]),
                                        jnp.zeros((1,), jnp.int32), cache, impl="reference")
    got = target_model.logits(target.params, hidden)[0]
    assert float(abs(got - expected).max()) < 1e-3


def test_default_chat_template_renders_as_transformers_does():
    """The pair's tokenizer has no chat tokens: its template writes "User: ..." turns as text."""
    from transformers import AutoTokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "return a + b"}, {"role": "user", "content": "and sub?"}]
    ours = Tokenizer(DEFAULT_MODEL / "target").apply_chat_template(chat)
    theirs = AutoTokenizer.from_pretrained(DEFAULT_MODEL / "target").apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert ours == theirs == ("System: Be brief.\n\nUser: def add(a, b):\n\nAssistant: return a + b\n\n"
                              "User: and sub?\n\nAssistant:")


def test_cli_runs_the_default_pair(capsys):
    """No --target: the embedded pair, in float32 on a CPU, compared with plain decoding; --chat
    renders the prompt with its template."""
    assert main(["--max-new-tokens", "12", "--chat", "--prompt", "def add(a, b):"]) == 0
    captured = capsys.readouterr()
    assert "tau" in captured.err and "outputs identical: True" in captured.err
    assert captured.out.startswith("def add(a, b):\n")  # the prompt as given, the answer on a line of its own


def test_serve_without_target_chats_with_the_default_pair(monkeypatch, capsys):
    """``python -m dflash_jax.serve`` with no --target serves the embedded pair under its own name,
    and its chat template answers chat completions (the app run in-process, its programs compiled
    on the first request instead of at start)."""
    import signal

    import uvicorn
    from fastapi.testclient import TestClient

    from dflash_jax.entrypoints import serve

    served = {}
    monkeypatch.setattr(serve.Engine, "warmup", lambda self: 0)
    monkeypatch.setattr(uvicorn, "run", lambda app, **settings: served.update(app=app))
    monkeypatch.setattr(signal, "signal", lambda *args: None)    # the test process keeps its handlers
    monkeypatch.setattr(serve, "_log_to_stderr", lambda level: None)  # and its logging
    assert serve.main(["--max-num-seqs", "1", "--max-model-len", "64", "--impl", "reference"]) == 0
    assert "serving dflash-jax-default on http://127.0.0.1:8000/v1" in capsys.readouterr().err
    with TestClient(served["app"]) as client:
        models = client.get("/v1/models").json()["data"]
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "def add(a, b):"}],
                                                             "max_tokens": 4, "temperature": 0}).json()
    assert [m["id"] for m in models] == ["dflash-jax-default"]
    assert answer["choices"][0]["message"]["role"] == "assistant" and answer["usage"]["completion_tokens"] >= 1

"""The OpenAI-compatible server through real HTTP and the ``openai`` client, on a tiny pair with a
real tokenizer and chat template: outputs equal offline generation, concurrency with mixed
settings, streaming, chat, metrics, disconnects, errors; and ``python -m dflash_jax.serve`` as
a user starts and stops it."""

import concurrent.futures
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from builders import write_chat_pair

from dflash_jax.runtime.engine import Engine, RequestParams
from dflash_jax.runtime.grammar import grammar_from_request
from dflash_jax.runtime.sampling import SamplingConfig
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.entrypoints.server import BackgroundServer
from dflash_jax.loading.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    write_chat_pair(target_dir, draft_dir, max_position_embeddings=256)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def models(model_dirs):
    target = load_target(model_dirs[0], "float32")
    return target, load_draft(model_dirs[1], target, "float32"), Tokenizer(model_dirs[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server(BackgroundServer):
    """The app over an engine in this process, with the tests' clients."""

    def __init__(self, engine: Engine, api_key: str | None = None):
        super().__init__(engine, MODEL, api_key=api_key)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=600)

    def metric(self, name: str) -> float:
        return _metric(self.url, name)


def _metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's labelled values on the server at ``url``."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _engine(models, with_draft=True, **kwargs) -> Engine:
    target, draft, tokenizer = models
    settings = dict(max_num_seqs=4, max_model_len=160, page_size=8, chunk_steps=4, prefill_chunk=32, impl="reference",
                    speculative_policy="adaptive" if with_draft else "fixed")   # the server's default
    return Engine(target, draft if with_draft else None, tokenizer, **{**settings, **kwargs})


@pytest.fixture(scope="module")
def server(models):
    with _Server(_engine(models)) as running:
        yield running


OFFLINE_TOKENS = 40   # the most any test's greedy request asks for, or more


def _offline(models, prompt_ids, max_tokens, with_draft=True) -> str:
    """Greedy generation of one prompt alone, cut at the model's end-of-sequence ids, as text: the
    first ``max_tokens`` of a run of ``OFFLINE_TOKENS`` (one engine shape for every call, compiled
    once; greedy tokens do not depend on how many follow)."""
    assert max_tokens <= OFFLINE_TOKENS
    target, draft, tokenizer = models
    tokens = generate(target, [prompt_ids], draft=draft if with_draft else None, max_new_tokens=OFFLINE_TOKENS,
                      stop_token_ids=tokenizer.stop_token_ids, impl="reference").tokens[0]
    return tokenizer.decode(tokens[:max_tokens])


PROMPTS = ["def fibonacci(n):", "return n if", "else fibonacci(n - 1)\n", "def"]


@pytest.mark.parametrize("with_draft", [True, False], ids=["dflash", "plain"])
def test_completions_equal_offline_greedy(models, server, with_draft):
    running = server if with_draft else _Server(_engine(models, with_draft=False)).__enter__()
    try:
        client = running.client()
        for prompt in PROMPTS:
            result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            ids = models[2].encode(prompt)
            assert result.choices[0].text == _offline(models, ids, 24, with_draft)
            assert result.usage.prompt_tokens == len(ids)
            assert result.usage.completion_tokens == len(models[2].encode(result.choices[0].text)) or \
                result.choices[0].finish_reason == "length"
    finally:
        if not with_draft:
            running.__exit__(None, None, None)


def test_sixteen_concurrent_requests_with_mixed_settings(models, server):
    client = server.client()
    jobs = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)]
        settings = dict(max_tokens=4 + (i * 7) % 30)
        if i % 4 == 1:
            settings.update(temperature=0.8, top_p=0.9, seed=i)
        elif i % 4 == 2:
            settings.update(temperature=1.0, n=2, extra_body={"top_k": 5, "min_p": 0.05})
        elif i % 4 == 3:
            settings.update(temperature=0, stop=["fib"])
        else:
            settings.update(temperature=0)
        jobs.append((prompt, settings))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: client.completions.create(model=MODEL, prompt=job[0], **job[1]), jobs))
    for (prompt, settings), result in zip(jobs, results):
        assert len(result.choices) == settings.get("n", 1)
        assert all(c.finish_reason in ("stop", "length") for c in result.choices)
        if settings["temperature"] == 0:
            full = _offline(models, models[2].encode(prompt), settings["max_tokens"])
            expected = full.split("fib")[0] if "stop" in settings else full
            assert result.choices[0].text == expected
            assert "fib" not in result.choices[0].text or "stop" not in settings
    assert server.metric("dflash:num_requests_running") == 0


def test_streamed_chunks_join_to_the_whole_text(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_completions_use_the_template(models, server):
    client = server.client()
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    ids = models[2].encode(models[2].apply_chat_template(messages))
    assert result.choices[0].message.content == _offline(models, ids, 20)
    assert result.choices[0].message.role == "assistant" and result.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == result.choices[0].message.content


def test_models_health_and_metrics(models, server):
    """The counters and gauges; a prompt sent twice is found in the prefix cache the second time
    (all but its last, partial page of 8 tokens)."""
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in server.client().models.list()] == [MODEL]
    server.client().completions.create(model=MODEL, prompt="def", max_tokens=8, temperature=0)
    for name in ("dflash:prompt_tokens_total", "dflash:generation_tokens_total", "dflash:spec_decode_num_drafts_total",
                 "dflash:spec_decode_num_draft_tokens_total", "dflash:time_to_first_token_seconds_count",
                 "dflash:e2e_request_latency_seconds_count", "dflash:spec_decode_num_verified_tokens_per_pos_total",
                 "dflash:prefix_cache_queries_total"):
        assert server.metric(name) > 0, name
    stats = server.engine.stats
    assert server.metric("dflash:spec_decode_num_verified_tokens_per_pos_total") == stats.num_draft_tokens
    assert server.metric("dflash:spec_decode_num_accepted_tokens_per_pos_total") == stats.num_accepted_tokens
    assert server.metric("dflash:kv_cache_pages_total") == server.engine.num_pages
    prompt = " ".join(PROMPTS) * 2
    length = len(models[2].encode(prompt))
    queries, hits = server.metric("dflash:prefix_cache_queries_total"), server.metric("dflash:prefix_cache_hits_total")
    server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    first_hits = server.metric("dflash:prefix_cache_hits_total") - hits
    server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert server.metric("dflash:prefix_cache_queries_total") - queries == 2 * length
    assert server.metric("dflash:prefix_cache_hits_total") - hits - first_hits == (length - 1) // 8 * 8 > 0


def test_errors_have_openai_shape(server):
    post = lambda body, **kw: httpx.post(server.url + "/v1/completions", timeout=600, **kw)  # noqa: E731
    bad = post(None, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    for body, named in [({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "max_tokens": 0},
                                                                             "max_tokens"),
                        ({"prompt": "x", "top_p": 1.5}, "top_p"), ({"prompt": "x", "presence_penalty": 0.5},
                                                                   "presence_penalty"),
                        ({"prompt": "x" * 400, "max_tokens": 10}, "maximum context length"),
                        ({"prompt": "x", "top_k": 1000, "temperature": 1}, "top_k")]:
        response = post(None, json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and named in error["message"], (body, error)
        assert error["code"] == 400 and error["type"] == "BadRequestError"
    unknown = post(None, json={"model": "gpt-4", "prompt": "x"})
    assert unknown.status_code == 404 and "gpt-4" in unknown.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", temperature=-1)
    json_object = "the request body must be a JSON object (Content-Type: application/json), got "
    for response, status, message in [
        (httpx.get(server.url + "/v1/nothing"), 404, "there is no route /v1/nothing (the routes: GET /health, "),
        (httpx.get(server.url + "/v1/completions"), 405, "/v1/completions does not take GET, only POST"),
        (post(None, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}), 400,
         json_object + "Content-Type: text/plain"),
        (post(None, json=["x"]), 400, json_object + "a list"),
        (post(None, json={"prompt": "x", "max_tokens": 1e30}), 400,
         "max_tokens must be an integer >= 1 (with the prompt's tokens, at most 160), got 1e+30"),
        (post(None, json={"prompt": "x", "n": 0}), 400, "n must be an integer in [1, 128], got 0"),
    ]:
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (status, status) and error["message"].startswith(message), \
            error
        assert set(error) == {"message", "type", "param", "code"}


def test_chat_without_a_template_points_to_completions(model_dirs, server, tmp_path, monkeypatch):
    """A model without a chat template refuses chat completions by saying what to send instead (the
    server has no --chat flag to drop, which generate's message names)."""
    folder = tmp_path / "untemplated"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((model_dirs[0] / "tokenizer.json").read_bytes())
    monkeypatch.setattr(server.engine, "tokenizer", Tokenizer(folder))
    response = httpx.post(server.url + "/v1/chat/completions", timeout=600,
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"] == {
        "message": f"{MODEL} has no chat template, so it takes no chat completions: send the text to "
                   "/v1/completions as its prompt", "type": "BadRequestError", "param": "messages", "code": 400}


def test_a_full_queue_answers_503(models):
    with _Server(_engine(models, max_num_seqs=1, max_waiting=1)) as running:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 140, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(running.url + "/v1/completions", json=body, timeout=600),
                                    range(4)))
        codes = sorted(a.status_code for a in answers)
        assert codes[0] == 200 and codes[-1] == 503, codes
        refused = next(a for a in answers if a.status_code == 503).json()["error"]
        assert "queue is full" in refused["message"] and refused["code"] == 503


def test_an_api_key_guards_every_route_but_health(models):
    """With an API key, a request without ``Authorization: Bearer <key>`` is refused with OpenAI's
    401 (its message says whether the header was missing or the key wrong, and never repeats the
    key given), on every route but /health, an unknown one included; with the key, completions
    answer whole and streamed."""
    key = "sk-test-0123456789"
    required = "a valid API key is required: Authorization: Bearer <key> "
    with _Server(_engine(models), api_key=key) as running:
        with pytest.raises(openai.AuthenticationError) as missing:
            running.client().models.list(extra_headers={"Authorization": openai.omit})
        with pytest.raises(openai.AuthenticationError) as wrong:
            running.client("sk-wrong-key").completions.create(model=MODEL, prompt="def", max_tokens=4)
        for refused, why in [(missing, "(the request has no Authorization header)"),
                             (wrong, "(the request's key is wrong)")]:
            assert refused.value.status_code == 401
            assert refused.value.response.json() == {"error": {"message": required + why,
                                                               "type": "AuthenticationError", "param": None,
                                                               "code": 401}}
            assert refused.value.response.headers["www-authenticate"] == "Bearer"
        assert "sk-wrong-key" not in wrong.value.response.text
        not_bearer = httpx.get(running.url + "/v1/models", headers={"Authorization": f"Basic {key}"})
        assert not_bearer.status_code == 401 and not_bearer.json()["error"]["message"] == \
            required + "(the request's Authorization header is not a Bearer token)"

        client = running.client(key)
        answer = client.completions.create(model=MODEL, prompt="def", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0, stream=True)
        assert [chunk.choices[0].finish_reason for chunk in streamed][-1] in ("stop", "length")
        assert [m.id for m in client.models.list()] == [MODEL]

        signed = {"Authorization": f"Bearer {key}"}
        assert httpx.get(running.url + "/health").status_code == 200
        for path, status_with_the_key in [("/metrics", 200), ("/v1/nothing", 404)]:
            assert httpx.get(running.url + path).status_code == 401, path
            assert httpx.get(running.url + path, headers=signed).status_code == status_with_the_key, path


def test_the_api_key_is_the_flag_else_the_environment_variable():
    """``serve`` takes --api-key, else $DFLASH_API_KEY, else no key; an empty key, or one an HTTP
    header cannot carry as it is, stops it with an error naming where the key came from."""
    from dflash_jax.entrypoints.arguments import serve_parser
    from dflash_jax.entrypoints.serve import resolve_api_key

    flag = serve_parser().parse_args(["--api-key", "from-the-flag"]).api_key
    assert serve_parser().parse_args([]).api_key is None
    assert resolve_api_key(flag, {"DFLASH_API_KEY": "from-the-environment"}) == "from-the-flag"
    assert resolve_api_key(None, {"DFLASH_API_KEY": "from-the-environment"}) == "from-the-environment"
    assert resolve_api_key(None, {}) is None
    for given, environ, source in [("", {}, "--api-key"), ("two words", {}, "--api-key"),
                                   (None, {"DFLASH_API_KEY": ""}, "$DFLASH_API_KEY"),
                                   (None, {"DFLASH_API_KEY": "clé"}, "$DFLASH_API_KEY")]:
        with pytest.raises(ValueError, match=f"^{re.escape(source)} must be a non-empty key of printable ASCII"):
            resolve_api_key(given, environ)


def test_serve_command_answers_and_stops_on_sigterm(model_dirs):
    """What a user runs: the module with its flags; SIGTERM lets the request finish and exits 0. On
    a CPU it defaults to float32 and a small pool (4 slots of at most 512 tokens: the tiny
    target's 256 positions here)."""
    port = _free_port()
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "XLA_FLAGS": os.environ["XLA_FLAGS"],
           "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]}
    command = [sys.executable, "-m", "dflash_jax.serve", "--target", str(model_dirs[0]), "--draft", str(model_dirs[1]),
               "--port", str(port), "--impl", "reference", "--served-model-name", MODEL, "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.25)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, url + "/v1/completions", timeout=600,
                                 json={"prompt": "def", "max_tokens": 100, "temperature": 0, "ignore_eos": True})
            while not answer.done() and _metric(url, "dflash:num_requests_running") == 0:   # SIGTERM once it runs
                assert time.monotonic() < deadline, "the request did not start"
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            response = answer.result()
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 100
        assert process.wait(60) == 0
        started = process.communicate()[1]
        assert "float32; 4 requests at a time, up to 256 tokens each" in started
        assert "prefix caching on: --no-prefix-caching" in started
    finally:
        if process.poll() is None:
            process.kill()


def test_logprobs_equal_the_target_log_softmax(models, model_dirs, server, monkeypatch):
    """Completions' token_logprobs / top_logprobs and chat's logprobs.content are the target's
    log-softmax (transformers, whole sequence) at each emitted token, streamed or not."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model_dirs[0]).float().eval()
    target, draft, tokenizer = models
    client = server.client()

    def expected(prompt_ids, token_ids):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + token_ids])).logits[0]
        return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1]

    ids = tokenizer.encode(PROMPTS[0])
    settings = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.7, seed=3, logprobs=2,
                    extra_body={"ignore_eos": True})
    # the sampled tokens' ids: the engine's request behind the completion (a seeded request run again
    # need not draw the same tokens: adaptive verification picks its widths from the acceptance so far)
    submitted, submit = [], server.engine.submit
    monkeypatch.setattr(server.engine, "submit", lambda *args, **kwargs: submitted.append(submit(*args, **kwargs))
                        or submitted[-1])
    choice = client.completions.create(**settings).choices[0]
    request = submitted[0]
    assert request.finished
    streamed = [c.choices[0].logprobs for c in client.completions.create(**settings, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert sum((p.token_logprobs for p in streamed), []) == choice.logprobs.token_logprobs
    assert [tokenizer.token_text(t) for t in request.token_ids] == choice.logprobs.tokens
    table = expected(ids, request.token_ids)
    for position, (token, value, top) in enumerate(zip(request.token_ids, choice.logprobs.token_logprobs,
                                                      choice.logprobs.top_logprobs)):
        assert value == pytest.approx(table[position, token].item(), abs=1e-4)
        best = torch.topk(table[position], 2).values.tolist()  # tokens of one text share a key: compare by value
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values()) and max(top.values()) == \
            pytest.approx(best[0], abs=1e-4)

    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    greedy = generate(target, [chat_ids], draft=draft, max_new_tokens=8, stop_token_ids=tokenizer.stop_token_ids,
                      impl="reference").tokens[0]
    table = expected(chat_ids, greedy)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.token_text(t) for t in greedy]
    for position, (token, entry) in enumerate(zip(greedy, content)):
        assert entry.logprob == pytest.approx(table[position, token].item(), abs=1e-4)
        assert [e.token for e in entry.top_logprobs] == [tokenizer.token_text(t)
                                                         for t in torch.topk(table[position], 3).indices.tolist()]


# ----------------------------------------------------------------------------- text, engine-level


def _engine_run(models, params, with_draft=True, **settings):
    """One request through a fresh engine with the tiny pair's tokenizer: (request, outputs)."""
    target, draft, tokenizer = models
    engine = Engine(target, draft if with_draft else None, tokenizer,
                    **{**dict(max_num_seqs=1, max_model_len=160, page_size=8, chunk_steps=4, prefill_chunk=32,
                              impl="reference"), **settings})
    outputs = []
    request = engine.submit(tokenizer.encode(PROMPTS[0]), params, on_output=outputs.append)
    engine.run_until_done()
    assert engine.pages_in_use == 0
    return request, outputs


def test_a_stop_string_ends_the_text_tokens_and_logprobs(models):
    """The tokens and log-probabilities end with the token that completes a stop string (not
    the rest of its DFlash step), the text before the stop string."""
    tokenizer = models[2]
    whole, _ = _engine_run(models, RequestParams(max_tokens=40, ignore_eos=True))
    stop = tokenizer.decode(whole.token_ids[:4])[-2:]            # completed by the 4th token
    assert stop and stop not in tokenizer.decode(whole.token_ids[:3])
    request, outputs = _engine_run(models, RequestParams(max_tokens=40, ignore_eos=True, stop=(stop,), logprobs=0))
    text = tokenizer.decode(whole.token_ids)
    assert "".join(o.text for o in outputs) == text[:text.find(stop)] and outputs[-1].finish_reason == "stop"
    assert request.token_ids == whole.token_ids[:4] == sum((o.token_ids for o in outputs), [])
    assert [lp.token_id for o in outputs for lp in o.logprobs] == request.token_ids


def test_a_stop_token_is_in_the_tokens_not_the_text(models):
    tokenizer = models[2]
    whole, _ = _engine_run(models, RequestParams(max_tokens=20, ignore_eos=True))
    stop = whole.token_ids[5]
    cut = whole.token_ids.index(stop)
    request, outputs = _engine_run(models, RequestParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))
    assert request.token_ids == whole.token_ids[:cut + 1] and outputs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outputs) == tokenizer.decode(whole.token_ids[:cut])


def test_a_stop_string_across_two_outputs_is_held_back_and_never_sent(models):
    """Plain decoding, one token per output: a stop string made of the end of one token's text
    and the start of the next one's is held back, then cut; nothing of it is ever sent."""
    tokenizer = models[2]
    settings = dict(chunk_steps=1, with_draft=False)
    whole, _ = _engine_run(models, RequestParams(max_tokens=30, ignore_eos=True), **settings)
    pieces = [tokenizer.decode(whole.token_ids[:i + 1]) for i in range(len(whole.token_ids))]
    for i in range(1, len(pieces) - 1):
        before, after = pieces[i][len(pieces[i - 1]):], pieces[i + 1][len(pieces[i]):]
        stop = before[-1:] + after[:1]
        if len(stop) == 2 and "\ufffd" not in stop and pieces[i + 1].find(stop) == len(pieces[i]) - 1:
            break
    else:
        raise AssertionError("no stop string spans two tokens' texts")
    request, outputs = _engine_run(models, RequestParams(max_tokens=30, ignore_eos=True, stop=(stop,)), **settings)
    assert len(outputs) > 2 and outputs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outputs) == pieces[i + 1][:pieces[i + 1].find(stop)]


def test_a_dropped_client_cancels_its_request(models, caplog):
    """A client that drops a stream, or stops waiting for a whole answer, cancels its request:
    it ends with "abort" long before its max_tokens, its pages come back (the page gauge at its
    idle value), and the log has its line as a finished request's."""
    caplog.set_level(logging.INFO, logger="dflash_jax.entrypoints.server")
    engine = _engine(models, with_draft=False, chunk_steps=1)
    submitted, submit, step = [], engine.submit, engine.step
    engine.submit = lambda *a, **k: submitted.append(submit(*a, **k)) or submitted[-1]

    def slow_step():   # ~20 ms a token: 150 tokens would take seconds
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    with _Server(engine) as running:
        with httpx.stream("POST", running.url + "/v1/completions", json={**body, "stream": True},
                          timeout=600) as response:
            next(response.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(running.url + "/v1/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 600
        while not (len(submitted) == 2 and all(r.finished for r in submitted)) or engine.pages_in_use:
            assert time.monotonic() < deadline, [r.finish_reason for r in submitted]
            time.sleep(0.05)
        assert [r.finish_reason for r in submitted] == ["abort", "abort"]
        assert all(len(r.token_ids) < 150 for r in submitted)
        lines = [record.getMessage() for record in caplog.records if "finish=cancelled" in record.getMessage()]
        assert sorted(line.split()[1] for line in lines) == sorted(r.id for r in submitted), lines
        assert running.metric("dflash:kv_cache_pages_used") == 0 and running.metric("dflash:num_requests_running") == 0


def test_the_server_log_leaves_out_jax_s_info_lines(monkeypatch):
    """At --log-level info the server logs its requests, not jax's info lines (on every machine
    without a TPU: "Unable to initialize backend 'tpu'"); jax's warnings still show, and at debug
    everything does."""
    from dflash_jax.entrypoints import serve

    monkeypatch.setattr(logging, "basicConfig", lambda **settings: None)  # pytest's handlers stay
    backend = logging.getLogger("jax._src.xla_bridge")
    before = {name: logging.getLogger(name).level for name in ("jax", "jaxlib")}
    try:
        serve._log_to_stderr("info")
        assert not backend.isEnabledFor(logging.INFO) and backend.isEnabledFor(logging.WARNING)
        serve._log_to_stderr("debug")
        assert backend.isEnabledFor(logging.DEBUG)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


ANSWER_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
                 "required": ["ok", "n"], "additionalProperties": False,
                 "x-guidance": {"whitespace_flexible": False}}   # llguidance's option: no free whitespace


def _check_answer(text: str) -> None:
    answer = json.loads(text)
    assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool) and answer["n"] in (1, 22, 333)


def test_structured_output_follows_the_grammar_and_dflash_equals_plain(models, server):
    """response_format json_schema on both routes: schema-valid JSON, DFlash (the adaptive
    server) greedy equal to plain greedy under the same grammar; sampled answers valid too;
    guided_regex; a malformed schema is a 400 naming response_format."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    plain = _Server(_engine(models, with_draft=False)).__enter__()
    try:
        texts = []
        for running in (server, plain):
            client = running.client()
            whole = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=48,
                                              temperature=0, extra_body={"response_format": response_format})
            chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "answer"}],
                                                  max_tokens=48, temperature=0, response_format=response_format)
            texts.append((whole.choices[0].text, chat.choices[0].message.content))
            assert whole.choices[0].finish_reason == chat.choices[0].finish_reason == "stop"
        assert texts[0] == texts[1]
        for text in texts[0]:
            _check_answer(text)
    finally:
        plain.__exit__(None, None, None)
    sampled = server.client().completions.create(model=MODEL, prompt="return n if", max_tokens=48, n=4, seed=3,
                                                 temperature=1.0, extra_body={"response_format": response_format})
    for choice in sampled.choices:
        _check_answer(choice.text)
    yes_no = server.client().completions.create(model=MODEL, prompt="def", max_tokens=8, temperature=0,
                                                extra_body={"guided_regex": "(yes|no)"})
    assert yes_no.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().completions.create(model=MODEL, prompt="def", max_tokens=8, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}})
    assert refused.value.body["param"] == "response_format"


def test_every_feature_mixed_loses_nothing(models):
    """An engine with adaptive verification, prefix caching, a small pool and grammars, under
    random arrivals of greedy, sampled and grammar-constrained requests on shared prefixes, some
    cancelled: the page accounting holds after every step, every request finishes, each greedy
    free-text request gives its tokens decoded alone, every grammar one valid JSON, and every page
    comes back free or cached."""
    import random

    target, draft, tokenizer = models
    engine = _engine(models, max_num_seqs=3, num_pages=40, speculative_policy="adaptive")
    grammar = grammar_from_request({"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}})
    rng = random.Random(5)
    prefixes = [tokenizer.encode(text) for text in ("def fibonacci(n):\n    return", "return n if n < 2 else")]
    kinds = ["greedy", "sampled", "grammar"] * 4
    prompts = [rng.choice(prefixes) + [rng.randint(1, 250) for _ in range(rng.randint(0, 12))] for _ in kinds]
    params = [RequestParams(max_tokens=rng.randint(4, 24) if kind != "grammar" else 40,
                            sampling=SamplingConfig(temperature=1.0 if kind == "sampled" else 0.0), seed=rng.randint(0, 9),
                            grammar=grammar if kind == "grammar" else None) for kind in kinds]
    pending, submitted = list(range(len(kinds))), {}
    while pending or engine.has_work():
        if pending and rng.random() < 0.6:
            index = pending.pop(0)
            submitted[index] = engine.submit(prompts[index], params[index])
        live = [r for i, r in submitted.items() if not r.finished and kinds[i] == "sampled"]
        if live and rng.random() < 0.05:
            engine.cancel(rng.choice(live))
        engine.step()
        engine.scheduler.check_invariants()
    assert all(r.finished for r in submitted.values()) and len(submitted) == len(kinds)
    alone = _engine(models, max_num_seqs=1, speculative_policy="fixed", prefix_caching=False)
    for index, request in submitted.items():
        if kinds[index] == "greedy":
            reference = alone.submit(prompts[index], params[index])
            alone.run_until_done()
            assert request.token_ids == reference.token_ids
        elif kinds[index] == "grammar":
            assert request.finish_reason == "stop"
            _check_answer(tokenizer.decode(request.token_ids[:-1]))
    assert engine.pages_in_use == 0 and engine.scheduler.reserved == 0 and engine.num_running == 0
    assert len(engine.scheduler.free_pages) + engine.cached_pages == engine.num_pages
    assert engine.stats.prefix_cache_hits > 0

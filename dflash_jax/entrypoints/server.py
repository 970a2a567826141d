"""An OpenAI-compatible HTTP server over one ``Engine`` (FastAPI): completions and chat
completions (streamed as server-sent events or whole), models, health and Prometheus metrics.

The engine steps in its own thread; each HTTP request submits its prompts x n samples and
reads their outputs through an asyncio queue fed from that thread. A client that disconnects
mid-stream cancels its requests (their pages are freed at the engine's next step). Every error
is OpenAI's JSON shape: 400 for a body that is not a JSON object and for bad or unsupported
parameters (naming them and what they take), 401 for a request without the server's API key when
it has one (every route but /health), 404 for an unknown model or route, 405 for a route's wrong
method, 503 when the queue is full or the server is stopping. One log line per request, as it
finishes or is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import typing
import uuid
from collections.abc import AsyncIterator

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from dflash_jax.runtime.engine import Engine, QueueFullError, RequestOutput, RequestParams
from dflash_jax.runtime.grammar import grammar_from_request
from dflash_jax.runtime.sampling import SamplingConfig

log = logging.getLogger("dflash_jax.entrypoints.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
            503: "ServiceUnavailableError"}.get(status, "APIError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _authorization_refusal(authorization: bytes | None, api_key: bytes) -> str | None:
    """Why the Authorization header ``authorization`` (None: no such header) does not carry
    ``api_key`` as a Bearer token, or None when it does. The keys are compared in constant time,
    and the message never repeats the key given."""
    required = "a valid API key is required: Authorization: Bearer <key>"
    if authorization is None:
        return f"{required} (the request has no Authorization header)"
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return f"{required} (the request's Authorization header is not a Bearer token)"
    if not hmac.compare_digest(token.strip(), api_key):
        return f"{required} (the request's key is wrong)"
    return None


class _RequireAPIKey:
    """ASGI middleware: an HTTP request to any path but /health needs ``Authorization: Bearer
    <api_key>`` and is otherwise answered 401 before any route sees it (so an unknown route is a
    401 too: its 404 lists the routes, which only a client with the key reads)."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            refusal = _authorization_refusal(dict(scope["headers"]).get(b"authorization"), self.api_key)
            if refusal is not None:
                response = _error(401, refusal, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _Sampling(BaseModel):
    """The request fields both routes share (OpenAI's names, and vLLM's for the extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    response_format: dict | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# What the request fields that are not plain numbers take, for the errors that name them.
_SHAPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
           "messages": 'a list of {"role", "content"} objects', "stop": "a string or a list of strings",
           "stop_token_ids": "a list of token ids (integers)", "stream_options": "an object",
           "response_format": 'an object: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                              '"json_schema": {"name": ..., "schema": {...}}}',
           "guided_regex": "a regular expression (a string)", "guided_grammar": "a Lark or GBNF grammar (a string)"}
_TOKEN_COUNTS = ("max_tokens", "max_completion_tokens")


def _expected(model: type[BaseModel], name: str) -> str | None:
    """What the request field ``name`` of ``model`` takes, in words ("an integer >= 1", "a number
    in (0, 1]"), from its type and bounds; None for a field it cannot describe."""
    if name in _SHAPES:
        return _SHAPES[name]
    field = model.model_fields.get(name)
    kinds = [] if field is None else [t for t in typing.get_args(field.annotation) or (field.annotation,)
                                      if t is not type(None)]
    if kinds == [bool]:
        return "true or false"
    if kinds not in ([int], [float]):
        return None
    bounds = {key: getattr(m, key) for m in field.metadata for key in ("ge", "gt", "le", "lt") if hasattr(m, key)}
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    kind = "an integer" if kinds == [int] else "a number"
    if low and high:
        return f"{kind} in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{kind} {'>=' if low[0] == '[' else '>'} {low[1]}"
    return f"{kind} {'<=' if high[0] == ']' else '<'} {high[1]}" if high else kind


def _invalid_body(error: dict, content_type: str) -> str:
    """The message for a body that is not a JSON object: nothing, another content type, or JSON of
    another kind (a list, a string)."""
    media_type = content_type.split(";")[0].strip().lower()
    kinds = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             type(None): "null"}
    if error.get("type") == "missing":
        got = "nothing"
    elif media_type != "application/json":
        got = f"Content-Type: {media_type}" if media_type else "a body without a Content-Type"
    else:
        got = kinds.get(type(error.get("input")), "another JSON value")
    return f"the request body must be a JSON object (Content-Type: application/json), got {got}"


# Fields the engine does not implement: refused unless left at their neutral value.
_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "echo": False,
                "best_of": None, "logit_bias": None, "suffix": None, "tools": None, "tool_choice": None}


class Metrics(prometheus_client.registry.Collector):
    """Prometheus metrics of one server: the engine's counters and gauges read at scrape time,
    latency histograms observed as requests finish (vLLM's names, prefix ``dflash:``)."""

    def __init__(self, engine: Engine, model: str):
        self.engine, self.model = engine, model
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self)
        labels = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = prometheus_client.Histogram("dflash:time_to_first_token_seconds", "Time to first token",
                                                buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), **labels)
        self.tpot = prometheus_client.Histogram("dflash:time_per_output_token_seconds",
                                                "Time per output token after the first",
                                                buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1), **labels)
        self.e2e = prometheus_client.Histogram("dflash:e2e_request_latency_seconds", "End-to-end request latency",
                                               buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), **labels)
        self.finished = prometheus_client.Counter("dflash:request_success", "Requests finished",
                                                  labelnames=["model_name", "finished_reason"], registry=self.registry)

    def observe(self, request, reason: str) -> None:
        now = time.monotonic()
        self.e2e.labels(self.model).observe(now - request.arrival)
        if request.first_token_time is not None:
            self.ttft.labels(self.model).observe(request.first_token_time - request.arrival)
            if len(request.token_ids) > 1:
                self.tpot.labels(self.model).observe((now - request.first_token_time) / (len(request.token_ids) - 1))
        self.finished.labels(self.model, reason).inc()

    def collect(self):
        engine, stats, model = self.engine, self.engine.stats, [self.model]

        def counter(name, text, value):
            family = CounterMetricFamily(f"dflash:{name}", text, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def gauge(name, text, value):
            family = GaugeMetricFamily(f"dflash:{name}", text, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield counter("prompt_tokens", "Prompt tokens of requests whose prefill ended (cached or run)",
                      stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", stats.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits)
        yield counter("spec_decode_num_drafts", "DFlash steps (drafts verified)", stats.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified", stats.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens)
        per_position = CounterMetricFamily("dflash:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each block position",
                                           labels=["model_name", "position"])
        for position, count in enumerate(stats.accepted_per_position):
            per_position.add_metric([self.model, str(position)], count)
        yield per_position
        verified = CounterMetricFamily("dflash:spec_decode_num_verified_tokens_per_pos",
                                       "Draft tokens verified at each block position (the adaptive policy verifies "
                                       "fewer at high load)", labels=["model_name", "position"])
        for position, count in enumerate(stats.verified_per_position):
            verified.add_metric([self.model, str(position)], count)
        yield verified
        yield gauge("num_requests_running", "Requests holding a slot", engine.num_running)
        yield gauge("num_requests_waiting", "Requests queued", engine.num_waiting)
        yield gauge("kv_cache_pages_used", "KV pages in use", engine.pages_in_use)
        yield gauge("kv_cache_pages_total", "KV pages of the pool", engine.num_pages)
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages in use", engine.pages_in_use / engine.num_pages)


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The app over a started or not yet started ``engine`` (the app's lifespan starts it and,
    at shutdown, lets running requests finish); with ``api_key``, every route but /health needs
    ``Authorization: Bearer <api_key>``."""
    metrics = Metrics(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, drain=True, timeout=60)

    app = FastAPI(title="dflash-jax", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key)
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg')}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if not loc:
            return _error(400, _invalid_body(first, request.headers.get("content-type", "")))
        expected = _expected(bodies.get(request.url.path, _Sampling), loc[0])
        if expected is None:
            where = ".".join(loc)
            return _error(400, f"{where}: {first.get('msg')}", where)
        if loc[0] in _TOKEN_COUNTS:
            expected += f" (with the prompt's tokens, at most {engine.max_model_len})"
        got = "" if first.get("type") == "missing" else f", got {json.dumps(first.get('input'))[:80]}"
        return _error(400, f"{loc[0]} must be {expected}{got}", loc[0])

    @app.exception_handler(APIError)
    async def _api_error(request, error: APIError):
        return _error(error.status, error.message, error.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        """Starlette's own errors (no such route, a route's wrong method) in OpenAI's shape."""
        routes = ", ".join(f"{'/'.join(sorted(route.methods))} {route.path}" for route in app.routes
                           if isinstance(route, APIRoute))
        allowed = {name.lower(): value for name, value in (error.headers or {}).items()}.get("allow")
        message = {404: f"there is no route {request.url.path} (the routes: {routes})",
                   405: f"{request.url.path} does not take {request.method}, only {allowed}"}
        return _error(error.status_code, message.get(error.status_code, str(error.detail)), headers=error.headers)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(prometheus_client.generate_latest(metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "dflash-jax", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_common(body, model_name)
        prompts = _completion_prompts(body.prompt, engine)
        return await _respond(engine, metrics, http, body, prompts, chat=False, model=model_name)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        _check_common(body, model_name)
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: chat completions need one")
        if not engine.tokenizer.chat_template:
            raise APIError(400, f"{model_name} has no chat template, so it takes no chat completions: send the text "
                           "to /v1/completions as its prompt", "messages")
        try:
            text = engine.tokenizer.apply_chat_template(body.messages)
        except ValueError as error:
            raise APIError(400, f"messages: {error}", "messages") from error
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _respond(engine, metrics, http, body, [engine.tokenizer.encode(text)], chat=True,
                              model=model_name)

    return app


def _check_common(body: _Sampling, model_name: str) -> None:
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"The model `{body.model}` does not exist (this server serves `{model_name}`)", "model")
    given = {**body.__dict__, **(body.model_extra or {})}
    for name, neutral in _UNSUPPORTED.items():
        if name in given and given[name] not in (neutral, None):
            raise APIError(400, f"{name} is not supported by this server", name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")


def _completion_prompts(prompt, engine: Engine) -> list[list[int]]:
    """The prompt(s) of a completion request as token ids: text, texts, ids or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: give the prompt as token ids", "prompt")
        return [engine.tokenizer.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def _params(body: _Sampling, engine: Engine, index: int) -> RequestParams:
    """One sample's engine settings (400 naming the parameter for a value the engine refuses)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        sampling = SamplingConfig(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                                  min_p=body.min_p)
    except ValueError as error:
        raise APIError(400, str(error)) from error
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    try:
        grammar = grammar_from_request(body.response_format, body.guided_regex, body.guided_grammar)
    except ValueError as error:
        field = next((f for f in ("response_format", "guided_regex", "guided_grammar") if str(error).startswith(f)),
                     None)
        raise APIError(400, str(error), field) from error
    return RequestParams(max_tokens=body.max_tokens or 16, sampling=sampling, seed=body.seed, sample_index=index,
                         stop=stop, stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
                         logprobs=logprobs, grammar=grammar)


def _logprobs_json(engine: Engine, logprobs, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object of a choice (or of a stream chunk) from ``TokenLogprob``s:
    chat's ``content`` list, or completions' parallel lists (text_offset from ``offset``)."""
    if logprobs is None:
        return None
    text = engine.tokenizer.token_text if engine.tokenizer is not None else str
    if chat:
        entry = lambda token, value: {"token": text(token), "logprob": value,  # noqa: E731
                                      "bytes": list(text(token).encode())}
        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}
    tokens = [text(lp.token_id) for lp in logprobs]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_by_text(text, lp.top) for lp in logprobs], "text_offset": offsets}


def _by_text(text, top) -> dict[str, float]:
    """Completions' {token text: logprob}; tokens that read the same keep the likeliest's."""
    named: dict[str, float] = {}
    for token, value in top:
        named.setdefault(text(token), value)
    return named


async def _respond(engine: Engine, metrics: Metrics, http: Request, body: _Sampling, prompts: list[list[int]], *,
                   chat: bool, model: str):
    """Submit every prompt x n, then answer whole or as a stream."""
    if body.max_tokens is None:
        body.max_tokens = max(1, engine.max_model_len - max(len(p) for p in prompts)) if chat else 16
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    requests = []
    response_id, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    try:
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                choice = p * body.n + i
                params = _params(body, engine, i)
                requests.append(engine.submit(
                    prompt, params,
                    on_output=lambda out, c=choice: loop.call_soon_threadsafe(queue.put_nowait, (c, out))))
    except ValueError as error:
        _cancel(engine, requests, response_id)
        raise APIError(400, str(error)) from error
    except QueueFullError as error:
        _cancel(engine, requests, response_id)
        raise APIError(503, str(error)) from error
    usage = lambda: {"prompt_tokens": sum(len(p) for p in prompts),  # noqa: E731
                     "completion_tokens": sum(len(r.token_ids) for r in requests),
                     "total_tokens": sum(len(p) for p in prompts) + sum(len(r.token_ids) for r in requests)}

    def finished(request, reason: str) -> None:
        metrics.observe(request, reason)
        steps = request.accept_lengths
        log.info("%s %s prompt=%d completion=%d finish=%s e2e=%.3fs%s", response_id, request.id,
                 len(request.prompt_ids), len(request.token_ids), reason, time.monotonic() - request.arrival,
                 f" tau={sum(steps) / len(steps):.2f}" if steps else "")

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(engine, http, queue, requests, finished, chat, response_id, created, model,
                                         include_usage, usage),
                                 media_type="text/event-stream")
    texts, reasons = [""] * len(requests), [None] * len(requests)
    logprobs = [[] if r.params.logprobs is not None else None for r in requests]
    checked = time.monotonic()
    try:
        while any(r is None for r in reasons):
            if time.monotonic() - checked > 0.5:   # a client gone: nobody to answer; cancelled below
                if await http.is_disconnected():
                    return Response(status_code=499)
                checked = time.monotonic()
            try:
                choice, out = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            texts[choice] += out.text
            if out.logprobs is not None:
                logprobs[choice] += out.logprobs
            if out.finished:
                reasons[choice] = out.finish_reason
                finished(requests[choice], out.finish_reason)
    finally:
        _cancel(engine, requests, response_id)
    if any(r.finish_reason == "abort" for r in requests):
        raise APIError(503 if not engine.accepting else 500, "the request was aborted: the server is stopping or "
                       "the engine failed (see the server's log)")
    choices = [({"index": c, "message": {"role": "assistant", "content": texts[c]}} if chat
                else {"index": c, "text": texts[c]})
               | {"logprobs": _logprobs_json(engine, logprobs[c], chat), "finish_reason": reasons[c]}
               for c in range(len(requests))]
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage()}


def _cancel(engine: Engine, requests, response_id: str) -> None:
    """Cancel the requests still running (their client left, or another sample of theirs was
    refused), each with a log line as a finished request has."""
    for request in requests:
        if not request.finished:
            engine.cancel(request)
            log.info("%s %s prompt=%d completion=%d finish=cancelled e2e=%.3fs", response_id, request.id,
                     len(request.prompt_ids), len(request.token_ids), time.monotonic() - request.arrival)


async def _stream(engine: Engine, http: Request, queue: asyncio.Queue, requests, finished, chat: bool,
                  response_id: str, created: int, model: str, include_usage: bool, usage) -> AsyncIterator[str]:
    """Server-sent events: a chunk per output piece, the usage chunk if asked, then [DONE]. A
    disconnected client cancels the requests."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices, **extra) -> str:
        usage = {"usage": None} if include_usage else {}   # OpenAI: null on every chunk but the last
        return "data: " + json.dumps({"id": response_id, "object": kind, "created": created, "model": model,
                                      "choices": choices, **usage, **extra}) + "\n\n"

    offsets = [0] * len(requests)

    def piece(choice: int, out: RequestOutput | None) -> dict:
        reason = out.finish_reason if out is not None and out.finished else None
        text = "" if out is None else out.text
        logprobs = None if out is None else _logprobs_json(engine, out.logprobs, chat, offsets[choice])
        offsets[choice] += len(text)
        if chat:
            delta = {"role": "assistant", "content": ""} if out is None else {"content": text}
            return {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": choice, "text": text, "logprobs": logprobs, "finish_reason": reason}

    open_choices = set(range(len(requests)))
    try:
        if chat:
            yield event([piece(c, None) for c in range(len(requests))])
        while open_choices:
            try:
                choice, out = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            if out.finished:
                open_choices.discard(choice)
                finished(requests[choice], out.finish_reason)
            if out.text or out.finished or out.logprobs:
                yield event([piece(choice, out)])
        if include_usage:
            yield event([], usage=usage())
        yield "data: [DONE]\n\n"
    finally:
        _cancel(engine, requests, response_id)


class BackgroundServer:
    """``create_app(engine, model_name, api_key=api_key)`` served by uvicorn in a thread of this
    process, on ``host`` and a free port (tests, benchmarks, notebooks): ``with
    BackgroundServer(...) as server: server.url``. Leaves Python's logging alone."""

    def __init__(self, engine: Engine, model_name: str, host: str = "127.0.0.1", *, api_key: str | None = None):
        import socket
        import threading

        import uvicorn

        with socket.socket() as probe:
            probe.bind((host, 0))
            self.port = probe.getsockname()[1]
        self.engine, self.url = engine, f"http://{host}:{self.port}"
        app = create_app(engine, model_name, api_key=api_key)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_config=None))
        self._thread = threading.Thread(target=self._server.run, name="dflash-http", daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(120)

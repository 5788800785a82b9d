"""`kie serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one Engine.

The engine is built for single-request latency, so requests decode one at a time: a single worker thread owns the
engine and takes jobs in FIFO order (kie_moe/scheduler.py), and the event loop only moves text between that thread
and the clients, so it is never blocked by decoding. A full queue answers 429; a client that goes away cancels its
job between two tokens, so a dead connection never holds the engine. Every error a client can cause gets an
OpenAI-style body {"error": {"message", "type", "param", "code"}} and never stops the server.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from kie_moe.metrics import ServerMetrics
from kie_moe.models.errors import KieError
from kie_moe.sampling import SamplingParams
from kie_moe.scheduler import Delta, Done, Job, QueueFull, Scheduler, ShuttingDown

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
COMPLETIONS_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions; chat defaults to the context left


# ---------------------------------------------------------------------------------------------- errors

class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# what a field should look like, for validation messages clearer than pydantic's per-union-member list
EXPECTED = {"prompt": "a string or a list of token ids", "stop": "a string or a list of strings",
            "messages": "a list of {role, content} objects", "model": "a string", "stream": "a boolean"}
_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    e = errs[0] if errs else {}
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        msg, param = "the request body is not valid JSON" + (f" ({detail})" if detail else ""), None
    elif not loc:
        msg, param = "the request body must be a JSON object", None
    else:
        param = str(loc[0])
        if e.get("type") == "missing" and len(loc) == 1:
            msg = f"`{param}` is required"
        elif param in EXPECTED and len(loc) <= 3:
            msg = f"`{param}` must be {EXPECTED[param]}"
        else:
            # drop pydantic's union-member tags ("str", "list[int]", ...) from the path: clients never wrote them
            where = ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TAGS)))
            msg = f"`{where}`: {e.get('msg', 'invalid value')}"
    return JSONResponse(error_body(msg, param=param), 400)


# ---------------------------------------------------------------------------------------------- request bodies

class _Body(BaseModel):
    # clients send fields we neither use nor know (user, metadata, ...): ignore them, like OpenAI does
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None            # vLLM extension; -1 or 0 = off
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: dict | None = None
    ignore_eos: StrictBool = False            # vLLM extension
    return_token_ids: StrictBool = False      # vLLM extension: choices carry "token_ids"
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    response_format: dict | None = None


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (finished, client gone, server stopping)."""

    def __init__(self, content, job: Job, sched: Scheduler):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.sched = job, sched

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sched.release(self.job)


async def _watch_disconnect(request: Request, job: Job):
    # the body has been read, so the next ASGI message is the client going away (or the response completing)
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------- the service

class Service:
    def __init__(self, engine, model_name: str, max_queue: int, max_model_len: int | None):
        self.engine, self.name = engine, model_name
        ctx = engine.spec.max_position
        if max_model_len is not None:
            if max_model_len < 1 or max_model_len > ctx:
                raise KieError(f"--max-model-len {max_model_len} must be between 1 and the model's context ({ctx})")
            ctx = max_model_len
        self.ctx = ctx
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name)
        self.sched = Scheduler(engine, self.metrics, max_queue)

    # -- requests -> (prompt ids, sampling params)

    def check_model(self, body: _Body):
        if body.model is not None and body.model != self.name:
            raise ApiError(400, f"the model `{body.model}` does not exist; this server serves `{self.name}`",
                           "model", "model_not_found")

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad(f"batched prompts are not supported ({len(prompt)} prompts): send one per request",
                          "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise bad("this model has no tokenizer: send `prompt` as a list of token ids", "prompt")
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)

    def chat_ids(self, req: ChatRequest) -> list[int]:
        if self.engine.tokenizer is None:
            raise bad("this model has no tokenizer or chat template: use /v1/completions with token ids",
                      "messages")
        if not req.messages:
            raise bad("`messages` must not be empty", "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            d = m.model_dump(exclude_none=True)
            if m.content is None and not (m.role == "assistant" and d.get("tool_calls")):
                # as OpenAI: only an assistant turn that made tool calls may leave content out
                raise bad(f"messages[{i}]: `content` is required for a {m.role!r} message", f"messages.{i}.content")
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise bad(f"messages[{i}]: only text content parts are supported", f"messages.{i}.content")
                d["content"] = "".join(p.text for p in m.content)
            d.setdefault("content", "")
            msgs.append(d)
        try:
            return self.engine.tokenizer.apply_chat_template(msgs)
        except KieError:
            raise bad("this model has no chat template (tokenizer_config.json: chat_template)", "messages") from None
        except Exception as e:  # jinja2 errors, including the template's own raise_exception(...)
            raise bad(f"the chat template rejected these messages: {e}", "messages") from None

    def params(self, body: _Body, n_prompt: int, max_tokens: int | None, default_max: int) -> SamplingParams:
        unsupported = {"n": body.n not in (None, 1), "best_of": getattr(body, "best_of", None) not in (None, 1),
                       "echo": bool(getattr(body, "echo", None)), "suffix": getattr(body, "suffix", None) is not None,
                       "logprobs": getattr(body, "logprobs", None) not in (None, False),
                       "top_logprobs": getattr(body, "top_logprobs", None) not in (None, 0),
                       "presence_penalty": bool(body.presence_penalty), "logit_bias": bool(body.logit_bias),
                       "frequency_penalty": bool(body.frequency_penalty), "tools": bool(getattr(body, "tools", None)),
                       "response_format": (getattr(body, "response_format", None) or {}).get("type", "text") != "text"}
        for k, v in unsupported.items():
            if v:
                raise bad(f"`{k}` is not supported by this server" + (" (only n=1)" if k == "n" else ""), k)
        if n_prompt == 0:
            raise bad("the prompt is empty", "prompt")
        if n_prompt >= self.ctx:
            raise bad(f"the prompt has {n_prompt} tokens; this model's context is {self.ctx} tokens", "prompt",
                      "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max, self.ctx - n_prompt)
        if max_tokens < 1:
            raise bad(f"`max_tokens` must be at least 1, got {max_tokens}", "max_tokens")
        if n_prompt + max_tokens > self.ctx:
            raise bad(f"this model's context is {self.ctx} tokens, but {n_prompt + max_tokens} were requested "
                      f"({n_prompt} in the prompt, {max_tokens} to generate): lower `max_tokens` or shorten the "
                      "prompt", "max_tokens", "context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if not math.isfinite(temperature) or temperature < 0:
            raise bad(f"`temperature` must be >= 0, got {temperature}", "temperature")
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise bad(f"`top_p` must be in (0, 1], got {top_p}", "top_p")
        top_k = body.top_k or 0
        if top_k < -1:
            raise bad(f"`top_k` must be -1, 0 (off) or positive, got {top_k}", "top_k")
        if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
            raise bad("`seed` must fit in 64 bits", "seed")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        stop = tuple(s for s in stop if s)
        if stop and self.engine.tokenizer is None:
            raise bad("`stop` strings need the model's tokenizer, which this model does not have", "stop")
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=max(top_k, 0), seed=body.seed, ignore_eos=body.ignore_eos, stop=stop)

    def admit(self, body: _Body, ids: list[int], max_tokens: int | None, default_max: int, arrival: float) -> Job:
        p = self.params(body, len(ids), max_tokens, default_max)
        try:
            self.engine.check_prompt(ids, p)       # token ids inside the vocabulary, and the model's own limits
        except KieError as e:
            raise bad(str(e), "prompt") from None
        job = Job(ids, p, asyncio.get_running_loop(), arrival)
        try:
            self.sched.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", type="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), type="server_error") from None
        return job

    # -- answers

    async def collect(self, request: Request, job: Job) -> tuple[str, list[int], Done]:
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        parts, ids, done = [], [], None
        try:
            async for ev in job.events():
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    if ev.token_id is not None:
                        ids.append(ev.token_id)
                else:
                    done = ev
        finally:
            watcher.cancel()
            self.sched.release(job)
        if done.error:
            raise ApiError(500, done.error, type="server_error")
        if done.finish_reason == "cancelled" and self.sched.closing:
            raise ApiError(503, "the server shut down before this request finished", type="server_error")
        return "".join(parts), ids, done

    @staticmethod
    def usage(done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    def with_ids(self, body: _Body) -> bool:
        # without a tokenizer the text is always empty, so the ids are the only output worth sending
        return body.return_token_ids or self.engine.tokenizer is None

    async def stream(self, job: Job, body: _Body, chat: bool) -> AsyncIterator[str]:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.name}
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        ids_wanted = self.with_ids(body)

        def chunk(text: str | None, ids: list[int] | None, finish: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if ids_wanted and ids is not None:
                choice["token_ids"] = ids
            return _sse({**head, "choices": [choice]})

        if chat:
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for ev in job.events():
            if isinstance(ev, Delta):
                if ev.text or (ids_wanted and ev.token_id is not None):
                    yield chunk(ev.text, [ev.token_id] if ev.token_id is not None else [], None)
                continue
            if ev.error:
                yield _sse(error_body(ev.error, "server_error"))
            elif ev.finish_reason == "cancelled":
                if self.sched.closing:    # the client is still there: tell it why the text stops short
                    yield _sse(error_body("the server shut down before this request finished", "server_error"))
            else:
                yield chunk(None, None, ev.finish_reason)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": self.usage(ev)})
        yield "data: [DONE]\n\n"


def _gate(app, svc: Service, api_key: str | None):
    """Pure ASGI middleware (BaseHTTPMiddleware would get in the way of streaming and disconnects): checks the
    API key on /v1/* and counts every answer by endpoint and status."""
    want = f"Bearer {api_key}".encode() if api_key else None

    async def gated(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        endpoint = "/v1/models" if path.startswith("/v1/models") else path if path in ENDPOINTS else "other"
        status = [500]

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if want is not None and path.startswith("/v1"):
                got = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(got, want):
                    resp = JSONResponse(error_body("missing or wrong API key: send `Authorization: Bearer <key>`",
                                                   code="invalid_api_key"), 401,
                                        headers={"WWW-Authenticate": "Bearer"})
                    return await resp(scope, receive, send_status)
            await app(scope, receive, send_status)
        finally:
            svc.metrics.requests.inc(endpoint=endpoint, status=str(status[0]))

    return gated


def create_app(engine, model_name: str, *, api_key: str | None = None, max_queue: int = 64,
               max_model_len: int | None = None, on_shutdown=None):
    """The ASGI app for `engine` (already loaded). Start it with uvicorn; its lifespan runs the worker thread.
    `on_shutdown()`: called once the worker thread has stopped (rank 0 of --devices N tells the others)."""
    if max_queue < 0:
        raise KieError(f"--max-queue must be >= 0, got {max_queue}")
    svc = Service(engine, model_name, max_queue, max_model_len)

    @asynccontextmanager
    async def lifespan(_app):
        svc.sched.start()
        try:
            yield
        finally:
            svc.sched.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="KIE-MoE", lifespan=lifespan)
    app.state.service = svc

    @app.exception_handler(ApiError)
    async def _api_error(_req, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        return _validation_response(exc)

    @app.exception_handler(KieError)
    async def _kie_error(_req, exc: KieError):
        return JSONResponse(error_body(str(exc)), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    def model_card() -> dict:
        return {"id": svc.name, "object": "model", "created": svc.created, "owned_by": "kie-moe",
                "root": engine.model_dir, "max_model_len": svc.ctx}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": svc.name, "backend": engine.backend_name,
                "devices": getattr(engine.backend, "world", 1)}

    @app.get("/metrics")
    async def metrics():
        svc.sched.update_gauges()
        return PlainTextResponse(svc.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.name:
            raise ApiError(404, f"the model `{model_id}` does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        svc.check_model(body)
        ids = await asyncio.to_thread(svc.completion_ids, body)
        job = svc.admit(body, ids, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, t0)
        if body.stream:
            return _JobStream(svc.stream(job, body, chat=False), job, svc.sched)
        text, out_ids, done = await svc.collect(request, job)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        if svc.with_ids(body):
            choice["token_ids"] = out_ids
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": svc.name, "choices": [choice], "usage": svc.usage(done)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        t0 = time.perf_counter()
        svc.check_model(body)
        ids = await asyncio.to_thread(svc.chat_ids, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = svc.admit(body, ids, max_tokens, svc.ctx, t0)
        if body.stream:
            return _JobStream(svc.stream(job, body, chat=True), job, svc.sched)
        text, out_ids, done = await svc.collect(request, job)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": done.finish_reason}
        if svc.with_ids(body):
            choice["token_ids"] = out_ids
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": svc.name, "choices": [choice], "usage": svc.usage(done)}

    gated = _gate(app, svc, api_key)
    gated.service = svc           # for tests and embedding: the scheduler, metrics and engine behind the app
    return gated


# ---------------------------------------------------------------------------------------------- entry point

def bind(host: str, port: int) -> socket.socket:
    """Bind before uvicorn does, so a taken port or bad host is one KieError line, and port 0 works."""
    if not 0 <= port <= 65535:
        raise KieError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise KieError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise KieError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, max_queue: int = 64,
          max_model_len: int | None = None, device: str | None = None, backend: str = "auto",
          served_model_name: str | None = None, log_level: str = "info", sock: socket.socket | None = None,
          engine=None, on_shutdown=None, warmup: bool = True):
    """Serve until SIGINT / SIGTERM. `sock`: already bound (else bound here, before the model loads); `engine`:
    already built (rank 0 of `--devices N`, whose backend leads the other ranks; else built here); `on_shutdown`:
    see create_app (uvicorn re-raises the signal once it has shut down, so this is the last word rank 0 gets);
    `warmup`: on a GPU, compile the decode kernels (greedy and top-k variants) before answering (Engine.warmup), so
    no first request waits for a compile."""
    try:
        import uvicorn
    except ImportError:
        if sock is not None:
            sock.close()
        raise KieError("kie serve needs uvicorn and fastapi: pip install 'kie-moe[server]'") from None
    from kie_moe.engine import Engine

    api_key = api_key or os.environ.get("KIE_API_KEY") or None
    if sock is None:
        sock = bind(host, port)   # before loading: a taken port fails at once, not after a long model load
    try:
        if engine is None:
            engine = Engine(model, device=device, backend=backend)
        app = create_app(engine, served_model_name or model, api_key=api_key, max_queue=max_queue,
                         max_model_len=max_model_len, on_shutdown=on_shutdown)
        if warmup and engine.device.type == "cuda":
            print("kie serve: warming up (compiling the decode kernels)", file=sys.stderr, flush=True)
            t = time.perf_counter()
            ran = engine.warmup()
            print(f"kie serve: warm-up done in {time.perf_counter() - t:.1f} s ({', '.join(ran)})", file=sys.stderr,
                  flush=True)
    except BaseException:
        sock.close()
        raise
    h, p = sock.getsockname()[:2]
    url = f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}"
    ndev = f", {engine.devices} devices" if engine.devices > 1 else ""
    print(f"kie serve: {served_model_name or model} on {url} (backend {engine.backend_name}, {engine.device}{ndev}, "
          f"max queue {max_queue}{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    if host not in LOOPBACK and not api_key:
        print("kie serve: warning: listening beyond loopback without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr, flush=True)
    sched = app.service.sched

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # uvicorn waits for open connections before the lifespan shutdown: end the generations first
            sched.close()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])

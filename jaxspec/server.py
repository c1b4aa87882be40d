"""An OpenAI-compatible HTTP server over the continuous-batching engine (`jaxspec.serving`).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``:
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /`` (a small demo page).

Bad input never reaches the engine: malformed JSON or wrong types give 400 with an OpenAI-style
error body, a prompt that does not fit gives 400 naming the limits, a full queue 503 with
``Retry-After``. A client that disconnects frees its slots; an exception while serving one request
fails that request only.

Extensions (ignored by OpenAI clients): every streamed choice carries ``"jaxspec": {"segments":
[[text, from_draft], ...], "n_tokens", "accepted", "proposed"}`` (which text came from accepted
draft tokens); ``"return_token_ids": true`` in a request adds ``"token_ids"`` to each choice.

Run it with ``python scripts/serve.py`` or ``jaxspec serve`` (see `add_arguments`).
"""


import argparse
import asyncio
import json
import logging
import math
import time
import uuid
from importlib import resources
from typing import Any

from jaxspec.args import parse_gamma, parse_tree, window_arg
from jaxspec.serving import (EngineStopped, PromptTooLong, QueueFull, SamplingOptions, Sequence,
                             ServingEngine)

log = logging.getLogger("jaxspec.server")

MAX_STOP = 4


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ----------------------------------------------------------------------------- validation
def _bad(message, param=None, code=None):
    return APIError(400, message, param=param, code=code)


def _opt(body: dict, name: str, kind: str, default=None, *, lo=None, hi=None, lo_open=False):
    """A typed optional field: kind in {"int", "number", "bool", "str"}; null means default."""
    v = body.get(name, None)
    if v is None:
        return default
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str)}[kind]
    if not ok:
        want = {"int": "an integer", "number": "a number", "bool": "a boolean",
                "str": "a string"}[kind]
        raise _bad(f"'{name}' must be {want}, got {json.dumps(v)[:60]}", name, "invalid_type")
    if kind == "number" and not math.isfinite(v):
        raise _bad(f"'{name}' must be finite", name, "invalid_value")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name,
                   "invalid_value")
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v}", name, "invalid_value")
    return v


def _options(body: dict, engine: ServingEngine, *, chat: bool) -> tuple[SamplingOptions, int]:
    max_tokens = _opt(body, "max_tokens", "int", None, lo=1)
    if chat:
        max_tokens = _opt(body, "max_completion_tokens", "int", max_tokens, lo=1)
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's default for completions
    temperature = _opt(body, "temperature", "number", 1.0, lo=0.0, hi=2.0)
    top_p = _opt(body, "top_p", "number", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _opt(body, "top_k", "int", 0, lo=-1)
    seed = _opt(body, "seed", "int", None)
    n = _opt(body, "n", "int", 1, lo=1, hi=engine.B)
    stop = body.get("stop", None)
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if len(stop) > MAX_STOP:
            raise _bad(f"'stop' has {len(stop)} strings; at most {MAX_STOP}", "stop",
                       "invalid_value")
        stop = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(s == "" for s in stop):
        raise _bad("'stop' strings must not be empty", "stop", "invalid_value")
    for name in ("logprobs", "top_logprobs"):
        v = body.get(name)
        if v is True or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
    if body.get("echo"):
        raise _bad("'echo' is not supported by this server", "echo", "unsupported")
    if body.get("best_of") not in (None, 1, n):
        raise _bad("'best_of' is not supported by this server", "best_of", "unsupported")
    opts = SamplingOptions(max_tokens=max_tokens, temperature=float(temperature),
                           top_k=0 if top_k < 0 else int(top_k), top_p=float(top_p),
                           stop=stop, seed=seed)
    return opts, n


def _completion_prompts(body: dict, engine: ServingEngine) -> list[list[int]]:
    p = body.get("prompt", None)
    if p is None:
        raise _bad("'prompt' is required", "prompt", "missing")
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        items = p
    elif isinstance(p, list) and p and all(
            isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            for x in p):
        items = p
    else:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list "
                   "of token-id lists (non-empty)", "prompt", "invalid_type")
    out = []
    for x in items:
        try:
            out.append(engine.encode_prompt(x))
        except ValueError as e:
            raise _bad(str(e), "prompt", "invalid_value") from None
    return out


def _chat_prompt(body: dict, engine: ServingEngine) -> list[int]:
    msgs = body.get("messages", None)
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list of messages", "messages",
                   "invalid_type" if msgs is not None else "missing")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages",
                       "invalid_type")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            parts = []
            for part in c:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _bad(f"messages[{i}].content: only text parts are supported",
                               "messages", "invalid_type")
                parts.append(part["text"])
            c = "".join(parts)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts",
                       "messages", "invalid_type")
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise _bad(f"messages[{i}].role {m['role']!r} is not one of system, user, "
                       f"assistant, developer, tool", "messages", "invalid_value")
        clean.append({"role": m["role"], "content": c})
    try:
        return engine.encode_chat(clean)
    except ValueError as e:
        raise _bad(str(e), "messages", "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - a template that fails on this input
        raise _bad(f"the chat template failed on these messages: {e}", "messages",
                   "invalid_value") from None


# ----------------------------------------------------------------------------- metrics
class HTTPStats:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.streams_disconnected = 0


def prometheus_text(engine: ServingEngine, http: HTTPStats, model_name: str) -> str:
    m = engine.metrics()
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP jaxspec_{name} {help_}")
        lines.append(f"# TYPE jaxspec_{name} {kind}")
        for labels, v in samples:
            lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
            lines.append(f"jaxspec_{name}{{{lab}}} {float(v):.17g}" if lab else
                         f"jaxspec_{name} {float(v):.17g}")

    metric("http_requests_total", "counter", "HTTP requests by path and status code.",
           [({"path": p, "code": str(c)}, n) for (p, c), n in sorted(http.requests.items())])
    metric("http_requests_in_flight", "gauge", "HTTP requests being served.",
           [({}, http.in_flight)])
    metric("sequences_submitted_total", "counter", "Sequences (completions) queued.",
           [({}, m.get("sequences_submitted", 0))])
    metric("sequences_finished_total", "counter", "Sequences finished, by reason.",
           [({"reason": r}, m.get(f"finished_{r}", 0))
            for r in ("stop", "length", "cancelled", "error")])
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.",
           [({}, m.get("prompt_tokens", 0))])
    metric("generation_tokens_total", "counter", "Tokens generated.",
           [({}, m.get("generation_tokens", 0))])
    metric("queue_depth", "gauge", "Sequences waiting for a slot.", [({}, m["waiting"])])
    metric("slots_busy", "gauge", "Slots holding a sequence.", [({}, m["slots_busy"])])
    metric("slots_total", "gauge", "Slots (batch rows of the KV cache).", [({}, m["slots_total"])])
    metric("batch_occupancy", "gauge", "Fraction of slot-rounds that decoded a sequence.",
           [({}, m["batch_occupancy"])])
    metric("decode_rounds_total", "counter", "Target forward passes over the batch.",
           [({}, m.get("rounds", 0))])
    metric("decode_chunks_total", "counter", "Jitted chunk calls.", [({}, m.get("chunks", 0))])
    metric("decode_seconds_total", "counter", "Seconds spent in chunk calls.",
           [({}, m.get("chunk_seconds", 0.0))])
    metric("target_steps_total", "counter", "Per-sequence target steps (rounds a sequence "
           "took part in).", [({}, m.get("target_row_steps", 0))])
    metric("draft_tokens_proposed_total", "counter", "Draft tokens proposed.",
           [({}, m.get("draft_proposed", 0))])
    metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.",
           [({}, m.get("draft_accepted", 0))])
    metric("acceptance_rate", "gauge", "Accepted / proposed draft tokens (since start).",
           [({}, m["acceptance_rate"])])
    metric("tokens_per_target_step", "gauge", "Generated tokens per per-sequence target step.",
           [({}, m["tokens_per_target_step"])])
    metric("queue_full_rejections_total", "counter", "Requests refused with 503.",
           [({}, m.get("rejected_queue_full", 0))])
    lines.append(f'# HELP jaxspec_model_info The served model.\n# TYPE jaxspec_model_info gauge\n'
                 f'jaxspec_model_info{{model="{model_name}",gamma="{engine.gamma}"}} 1')
    return "\n".join(lines) + "\n"


class _CountRequests:
    """ASGI middleware: counts HTTP requests by path and status code."""

    def __init__(self, app, stats: HTTPStats):
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = {"code": 500}

        async def send2(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.stats.in_flight += 1
        try:
            await self.app(scope, receive, send2)
        finally:
            self.stats.in_flight -= 1
            key = (path if path in _KNOWN_PATHS else "other", status["code"])
            self.stats.requests[key] = self.stats.requests.get(key, 0) + 1


_KNOWN_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/completions",
                "/v1/chat/completions"}


# ----------------------------------------------------------------------------- the app
def create_app(engine: ServingEngine, model_name: str = "jaxspec"):
    """The FastAPI app over a started `ServingEngine`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None, openapi_url=None)
    http = HTTPStats()
    app.state.http_stats = http
    app.state.engine = engine

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return error_response(_bad(f"invalid request: {e.errors()[:3]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="internal_error"))

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        if model not in (None, model_name):
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{model_name}'", type="not_found_error", param="model",
                           code="model_not_found")
        return body

    @app.get("/", response_class=HTMLResponse)
    async def index():
        page = resources.files("jaxspec").joinpath("static/index.html").read_text("utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", model_name))

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine is not running", type="unavailable")
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(engine.started_at),
            "owned_by": "jaxspec", "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, http, model_name),
                                 media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool):
        body = await read_json(request)
        stream = _opt(body, "stream", "bool", False)
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = bool(so and so.get("include_usage"))
        return_ids = _opt(body, "return_token_ids", "bool", False)
        opts, n = _options(body, engine, chat=chat)
        prompts = [_chat_prompt(body, engine)] if chat else _completion_prompts(body, engine)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        seqs = [Sequence(ids, opts, index=j, loop=loop, queue=queue, tag=i * n + j)
                for i, ids in enumerate(prompts) for j in range(n)]
        try:
            engine.submit(seqs)
        except PromptTooLong as e:
            raise _bad(str(e), "messages" if chat else "prompt", "context_length_exceeded") \
                from None
        except QueueFull as e:
            raise APIError(503, str(e), type="overloaded", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="unavailable") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        base = {"id": rid, "created": created, "model": model_name}
        if stream:
            return StreamingResponse(
                _stream(engine, seqs, queue, base, chat, include_usage, return_ids),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, request, seqs, queue, base, chat, return_ids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    app.add_middleware(_CountRequests, stats=http)
    return app


def _prompt_tokens(seqs) -> int:
    """Prompt tokens, counted once per prompt (the n samples of a prompt share it)."""
    return sum(len(s.prompt_ids) for s in seqs if s.index == 0)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _collect(engine, request, seqs, queue, base, chat, return_ids):
    from fastapi.responses import JSONResponse
    texts = {s.tag: [] for s in seqs}
    finished: dict[int, dict] = {}
    try:
        while len(finished) < len(seqs):
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if ev["type"] == "delta":
                texts[ev["tag"]].append(ev["text"])
            elif ev["type"] == "error":
                raise APIError(500, f"generation failed: {ev['message']}", type="internal_error")
            else:
                finished[ev["tag"]] = ev
    finally:
        for s in seqs:
            if not s.finished_flag:
                engine.cancel(s)
    choices = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for s in sorted(seqs, key=lambda s: s.tag):
        ev = finished[s.tag]
        text = "".join(texts[s.tag])
        reason = ev["finish_reason"]
        c: dict[str, Any] = {"index": s.tag, "finish_reason": reason, "logprobs": None}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["jaxspec"] = ev["stats"]
        if return_ids:
            c["token_ids"] = ev["token_ids"]
        choices.append(c)
        usage["completion_tokens"] += ev["usage"]["completion_tokens"]
    usage["prompt_tokens"] = _prompt_tokens(seqs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    obj = {**base, "object": "chat.completion" if chat else "text_completion",
           "choices": choices, "usage": usage}
    return JSONResponse(obj)


async def _stream(engine, seqs, queue, base, chat, include_usage, return_ids):
    obj_name = "chat.completion.chunk" if chat else "text_completion"
    n_done = 0
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

    def chunk(choice):
        return _sse({**base, "object": obj_name, "choices": [choice]})

    try:
        if chat:  # the role first, as OpenAI does
            for s in seqs:
                yield chunk({"index": s.tag, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
        while n_done < len(seqs):
            ev = await queue.get()
            tag = ev["tag"]
            if ev["type"] == "delta":
                ext = {k: ev[k] for k in ("segments", "n_tokens", "accepted", "proposed",
                                          "rounds")}
                if chat:
                    c = {"index": tag, "delta": {"content": ev["text"]}, "logprobs": None,
                         "finish_reason": None}
                else:
                    c = {"index": tag, "text": ev["text"], "logprobs": None,
                         "finish_reason": None}
                c["jaxspec"] = ext
                yield chunk(c)
            elif ev["type"] == "error":
                yield _sse({"error": {"message": f"generation failed: {ev['message']}",
                                      "type": "internal_error", "param": None, "code": None}})
                break
            else:
                n_done += 1
                if chat:
                    c = {"index": tag, "delta": {}, "logprobs": None,
                         "finish_reason": ev["finish_reason"]}
                else:
                    c = {"index": tag, "text": "", "logprobs": None,
                         "finish_reason": ev["finish_reason"]}
                c["jaxspec"] = ev["stats"]
                if return_ids:
                    c["token_ids"] = ev["token_ids"]
                yield chunk(c)
                usage["completion_tokens"] += ev["usage"]["completion_tokens"]
        if include_usage:
            usage["prompt_tokens"] = _prompt_tokens(seqs)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield _sse({**base, "object": obj_name, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:  # also on client disconnect (the generator is cancelled/closed)
        for s in seqs:
            if not s.finished_flag:
                engine.cancel(s)


# ----------------------------------------------------------------------------- running it
def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None,
                   help="checkpoint folder (default: fetch and serve smollm2-135m-instruct)")
    p.add_argument("--checkpoints", default="checkpoints", help="where --model=None fetches to")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--draft", default=None, help="'self' or a draft checkpoint path (speculation)")
    p.add_argument("--gamma", type=parse_gamma, default=4, help="drafts per round, or 'auto'")
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=window_arg, default=496,
                   help="draft window (StreamingLLM); 'none': a draft model with a full cache")
    p.add_argument("--tree", default=None, help="token-tree expansion config, e.g. 1,1,3,1")
    p.add_argument("--max-batch", type=int, default=None,
                   help="slots (concurrent sequences); default 64 on GPU/TPU, 4 on CPU")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (prompt + completion), capped by the model's "
                        "context; default 8192 on GPU/TPU, 1024 on CPU")
    p.add_argument("--max-queue", type=int, default=1024, help="waiting sequences before 503")
    p.add_argument("--rounds-per-chunk", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--warmup-prefill", type=int, default=1024,
                   help="compile prefill for prompts up to this many tokens at start-up")
    p.add_argument("--shared-rng", action="store_true",
                   help="one PRNG key for the whole batch (no per-request seeds; no vmap)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    return p


def build_engine(a) -> tuple[ServingEngine, str]:
    import pathlib

    import jaxspec
    path = a.model
    if path is None:
        from jaxspec.fetch import fetch
        path = fetch("smollm2-135m-instruct", a.checkpoints)
    model = jaxspec.load(path, dtype=a.dtype)
    spec = None
    if a.draft is not None:
        draft = a.draft if a.draft == "self" else jaxspec.load(a.draft, dtype=a.dtype)
        spec = jaxspec.Speculation(draft=draft, gamma=a.gamma, sink=a.sink,
                                   window=a.window,
                                   tree=parse_tree(a.tree))
    import jax
    cpu = jax.default_backend() == "cpu"
    max_batch = a.max_batch or (4 if cpu else 64)
    max_len = a.max_len or (1024 if cpu else 8192)
    engine = ServingEngine(model, max_batch=max_batch, max_len=max_len, speculation=spec,
                           rounds_per_chunk=a.rounds_per_chunk, max_queue=a.max_queue,
                           prefill_chunk=a.prefill_chunk, per_row=not a.shared_rng,
                           warmup_prefill=a.warmup_prefill)
    name = a.served_model_name or pathlib.Path(path).name
    return engine, name


class BackgroundServer:
    """uvicorn serving `create_app(engine, name)` from a daemon thread on a socket bound before it
    starts (``port=0``: a free port), for benchmarks and tests. The engine must be started;
    ``close()`` stops the HTTP server only (the caller owns the engine)."""

    def __init__(self, engine: ServingEngine, name: str = "jaxspec", host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning", start_timeout: float = 30.0):
        import socket
        import threading

        import uvicorn
        self.app = create_app(engine, name)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        cfg = uvicorn.Config(self.app, log_level=log_level, access_log=False,
                             timeout_graceful_shutdown=2, backlog=4096)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="jaxspec-http", daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                self.close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def run_from_args(a):
    import uvicorn
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    engine, name = build_engine(a)
    log.info("compiling (warm-up) ...")
    engine.start()
    app = create_app(engine, name)
    log.info("serving %s on http://%s:%d (slots=%d, max_len=%d, gamma=%d)", name, a.host,
             a.port, engine.B, engine.max_len, engine.gamma)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    finally:
        engine.stop()


def main(argv=None):
    p = add_arguments(argparse.ArgumentParser(prog="jaxspec serve", description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    main()

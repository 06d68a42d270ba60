"""The HTTP side: Starlette routes in OpenAI's shapes over one :class:`EngineThread`.

Starlette (with uvicorn) parses HTTP; nothing here does. Each request passes the guard (Host,
Origin, CORS, key, body size and time), becomes a checked :class:`GenerationRequest`, takes its
place in the engine's FIFO, is tokenized on the tokenizer thread (never the engine's), and is
answered by a :class:`JobResponse`, which listens for the client hanging up the whole time
(also while the prompt is processed, when nothing is written) and cancels the run at once.
Every error is OpenAI's error JSON; one log line per request, its path shown printable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine import (
    ContextFullError,
    GrammarError,
    PotluckError,
    Prompt,
    call_grammar,
    check_grammar,
    is_harmony,
    printable,
    thinks,
    tool_format,
)
from ..config import SamplingSettings, ServerSettings
from .engine_thread import Delta, EngineThread, Job, Outcome, QueueFull
from .guard import Guard
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import MAX_INT_DIGITS, ApiError, GenerationRequest, HugeInteger, parse_request, sampling_fields

log = logging.getLogger("potluck.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class ServeState:
    """What the routes share: the engine thread, the model's description and the settings."""

    def __init__(self, engine: EngineThread, model_id: str, n_ctx: int, sampling: SamplingSettings,
                 server: ServerSettings) -> None:
        self.engine = engine
        self.model_id = model_id
        self.n_ctx = n_ctx
        self.sampling = sampling
        self.server = server
        self.created = int(time.time())
        # One thread tokenizes requests, in arrival order: never the engine's, and never more
        # than one core taken from decoding however many requests arrive.
        self.tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="potluck-tokenize")

    async def prepare(self, job: Job) -> Prompt:
        """``job``'s prompt, rendered and tokenized on the tokenizer thread, and the grammar that
        forces a tool call where the request requires one (its format is the template's)."""
        session = self.engine.session
        assert session is not None
        req = job.request

        def tokenize() -> Prompt:
            template = session.format.source
            job.template = template
            job.harmony = req.kind == "chat" and is_harmony(template)
            job.split_thinking = self.server.reasoning and req.kind == "chat" and (thinks(template) or job.harmony)
            if req.tools:
                job.tool_format = tool_format(template)
                if req.tool_choice == "required":
                    try:
                        job.grammar = call_grammar(job.tool_format, req.tools, req.parallel_tool_calls)
                    except GrammarError as e:
                        raise ApiError(400, str(e), param="tools") from None
            if job.grammar is not None:  # the model's vocabulary decides what llama.cpp can parse
                field = req.grammar_field or "tools"
                try:
                    check_grammar(session.model, job.grammar, field)
                except GrammarError as e:
                    raise ApiError(400, str(e), param=field.split(".")[0]) from None
            if req.kind == "chat":
                return session.prompt_for(req.messages, variables=dict(req.variables), tools=req.tools)
            return session.raw_prompt(req.prompt)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer, tokenize)
        except ContextFullError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        except PotluckError as e:  # the chat template refused the conversation
            raise ApiError(400, str(e), code="invalid_prompt") from None


class JobResponse:
    """Streams (SSE) or returns (JSON) one job's reply while watching for the client hanging up."""

    def __init__(self, state: ServeState, job: Job) -> None:
        self.state = state
        self.job = job
        self.gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job, engine = self.job, self.state.engine
        watcher = asyncio.create_task(self._watch(receive))
        # one timer a request, not one a token (asyncio.wait_for wraps each wait in a task)
        timer = asyncio.get_running_loop().call_later(self.state.server.request_timeout_s, self._time_out)
        try:
            if job.request.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the connection broke while writing
            self.gone = True
        finally:
            timer.cancel()
            watcher.cancel()
            if not job.finished.is_set():
                engine.cancel(job)

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self.state.engine.cancel(self.job)
                self.job.events.put_nowait(("gone", None))
                return

    def _time_out(self) -> None:
        """The request ran past ``request_timeout_s``: cancelled, and told so ahead of whatever
        the engine still sends."""
        self.job.timed_out = True
        self.state.engine.cancel(self.job)
        events = self.job.events
        while not events.empty():  # what it sent is dropped: the error is the answer's end
            events.get_nowait()
        events.put_nowait(("error", ApiError(504, f"the request ran past request_timeout_s "
                                                  f"({self.state.server.request_timeout_s:g} s) and was cancelled")))

    async def _next(self) -> tuple[str, object]:
        return await self.job.events.get()

    async def _whole(self, send: Send) -> None:
        replies = [Reply() for _ in range(self.job.request.n)]
        while True:
            kind, item = await self._next()
            if kind == "text":
                assert isinstance(item, Delta)
                replies[item.choice].add(item)
            elif kind == "gone":
                return
            elif kind == "error":
                assert isinstance(item, ApiError)
                await self._send_json(send, item.status, item.body(), item.headers)
                return
            else:
                assert isinstance(item, Outcome)
                self._note(item)
                body = completion_object(self.state, self.job.request, replies, item)
                await self._send_json(send, 200, body)
                return

    async def _send_json(self, send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
                         ) -> None:
        raw = json.dumps(body, ensure_ascii=False).encode()
        extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()), *extra]})
        await send({"type": "http.response.body", "body": raw})

    async def _stream(self, send: Send) -> None:
        req = self.job.request
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def event(data: dict[str, Any] | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True})

        if req.kind == "chat":
            for c in range(req.n):
                await event(chunk_object(self.state, req, c, {"role": "assistant", "content": ""}))
        while True:
            kind, item = await self._next()
            if kind == "gone":
                return
            if kind == "text":
                assert isinstance(item, Delta)
                if item.reasoning:
                    await event(chunk_object(self.state, req, item.choice, {"reasoning_content": item.reasoning}))
                if item.text or item.logprobs:
                    await event(chunk_object(self.state, req, item.choice, item.text, logprobs=item.logprobs))
                if item.tool_calls:
                    await event(chunk_object(self.state, req, item.choice, {"tool_calls": tool_calls_object(item)}))
                if item.call_parts:
                    await event(chunk_object(self.state, req, item.choice, {"tool_calls": call_parts_object(item)}))
                continue
            if kind == "error":
                assert isinstance(item, ApiError)
                await event(item.body())
            else:
                assert isinstance(item, Outcome)
                self._note(item)
                for c in range(req.n):
                    await event(chunk_object(self.state, req, c, None, item))
                if req.include_usage:
                    await event(chunk_object(self.state, req, 0, None, item, usage_only=True))
            await event("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

    def _note(self, outcome: Outcome) -> None:
        self.job.outcome = outcome  # type: ignore[attr-defined]  # read by the log line


def usage(o: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.reused_tokens}}


def potluck_figures(o: Outcome) -> dict[str, Any]:
    """potluck's own figures, in one field that OpenAI clients ignore."""
    return {"strategy": o.strategy, "drafted": o.drafted, "accepted": o.accepted,
            "tokens_per_s": round(o.tokens_per_s, 2), "ttft_s": round(o.ttft_s, 4),
            "reused_tokens": o.reused_tokens}


def _finish(o: Outcome, choice: int = 0) -> str:
    reason = o.finish_reasons[choice] if choice < len(o.finish_reasons) else o.finish_reason
    return "stop" if reason == "cancelled" else reason


class Reply:
    """One choice's text and log-probabilities, gathered for a whole (not streamed) answer."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.reasoning: list[str] = []

    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        self.reasoning.append(delta.reasoning)
        self.logprobs.extend(delta.logprobs)
        self.tool_calls.extend(tool_calls_object(delta))

    @property
    def text(self) -> str:
        return "".join(self.parts)


def call_parts_object(delta: Delta) -> list[dict[str, Any]]:
    """Streamed pieces of calls as OpenAI streams them: id, type and name on a call's first
    piece only, then its arguments' text piece by piece."""
    out: list[dict[str, Any]] = []
    for p in delta.call_parts:
        if out and out[-1]["index"] == p.index and not p.id:  # pieces of one call in one chunk
            out[-1]["function"]["arguments"] += p.arguments
            continue
        head = {"id": p.id, "type": "function"} if p.id else {}
        function = {"name": p.name, "arguments": p.arguments} if p.id else {"arguments": p.arguments}
        out.append({"index": p.index, **head, "function": function})
    return out


def tool_calls_object(delta: Delta) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries of a delta (``index`` is for streamed chunks)."""
    return [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(delta.tool_calls)]


def logprobs_object(req: GenerationRequest, entries: Sequence[dict[str, Any]], offset: int = 0
                    ) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice (or a chunk of one): chat's ``content`` entries, or
    the completions API's four lists (``offset``: where the entries' text starts)."""
    if req.logprobs is None:
        return None
    if req.kind == "chat":
        return {"content": list(entries), "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def completion_object(state: ServeState, req: GenerationRequest, replies: Sequence[Reply], o: Outcome
                      ) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, r in enumerate(replies):
        lp = logprobs_object(req, r.logprobs)
        if req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            if any(r.reasoning):
                message["reasoning_content"] = "".join(r.reasoning)
            if r.tool_calls:
                message.update(content=r.text or None, tool_calls=[{k: v for k, v in c.items() if k != "index"}
                                                                   for c in r.tool_calls])
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": _finish(o, i)})
        else:
            choices.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": _finish(o, i)})
    kind, prefix = ("chat.completion", "chatcmpl-") if req.kind == "chat" else ("text_completion", "cmpl-")
    return {"id": prefix + req.id, "object": kind, "created": req.created, "model": state.model_id,
            "choices": choices, "usage": usage(o), "system_fingerprint": None, "potluck": potluck_figures(o)}


def chunk_object(state: ServeState, req: GenerationRequest, choice: int, text: str | dict[str, Any] | None,
                 o: Outcome | None = None, *, usage_only: bool = False,
                 logprobs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A stream chunk of ``choice``: text (or the first delta), the last one (``o``), or the usage chunk."""
    chat = req.kind == "chat"
    out: dict[str, Any] = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
                           "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": req.created, "model": state.model_id, "system_fingerprint": None}
    if usage_only:
        assert o is not None
        out.update(choices=[], usage=usage(o))
        return out
    finish = None if o is None else _finish(o, choice)
    lp = logprobs_object(req, logprobs) if logprobs else None
    if chat:
        delta = text if isinstance(text, dict) else ({} if text is None else {"content": text})
        out["choices"] = [{"index": choice, "delta": delta, "logprobs": lp, "finish_reason": finish}]
    else:
        out["choices"] = [{"index": choice, "text": text or "", "logprobs": lp, "finish_reason": finish}]
    if req.include_usage:
        out["usage"] = None
    if o is not None:
        out["potluck"] = potluck_figures(o)
    return out


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused past ``limit`` bytes (413) or ``timeout_s`` seconds (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is over the {limit // 1024} KiB limit (max_body_kb)")

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the {limit // 1024} KiB limit (max_body_kb)")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body took longer than {timeout_s:g} s (body_timeout_s)") from None


def parse_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_int=_integer)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                       ) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


def _refuse_constant(name: str) -> object:
    raise ApiError(400, f"the request body is not valid JSON ({name} is not a JSON number)")


def _integer(digits: str) -> int | HugeInteger:
    """Python refuses to read integers past 4,300 digits: a longer one stays a :class:`HugeInteger`,
    which the field's own check refuses by name."""
    return HugeInteger(len(digits.lstrip("-"))) if len(digits) > MAX_INT_DIGITS else int(digits)


def build_app(state: ServeState, guard: Guard) -> Starlette:
    """The ASGI app: routes, the guard, OpenAI-shaped errors and the per-request log line."""
    server = state.server

    async def generation(request: Request, kind: str) -> Response | JobResponse:
        if state.engine.state != "ready":
            raise ApiError(503, f"the model is {state.engine.state}" +
                           (f": {state.engine.error}" if state.engine.error and state.engine.state == "failed" else ""),
                           headers={"Retry-After": "5"} if state.engine.state == "loading" else None)
        try:
            raw = await read_body(request, server.max_body_kb * 1024, server.body_timeout_s)
        except ClientDisconnect:
            raise ApiError(400, "the client hung up while sending the body") from None
        req = parse_request(kind, parse_json(raw), state.sampling, server.max_tokens)
        job = Job(req, asyncio.get_running_loop(), owner=request.scope.get("potluck.key") or "")
        try:
            state.engine.submit(job)  # its place in line, taken before it is tokenized
        except QueueFull as e:
            raise ApiError(429, "the server is busy: every queue place is taken; retry later",
                           kind="rate_limit_error", headers={"Retry-After": str(e.retry_after_s)}) from None
        request.scope["potluck.job"] = job
        try:
            prompt = await state.prepare(job)
        except BaseException:
            state.engine.withdraw(job)
            raise
        state.engine.ready(job, prompt)
        return JobResponse(state, job)

    async def chat(request: Request) -> Response | JobResponse:
        return await generation(request, "chat")

    async def completions(request: Request) -> Response | JobResponse:
        return await generation(request, "completion")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.created, "owned_by": "potluck",
            "context_length": state.n_ctx}]})

    async def health(request: Request) -> Response:
        engine = state.engine
        status = 200 if engine.state in ("ready", "loading") else 503
        if request.scope.get("potluck.key") is None:  # no valid key: ready or not, nothing more
            return JSONResponse({"status": engine.state}, status_code=status)
        running, waiting = engine.waiting()
        body: dict[str, Any] = {
            "status": engine.state, "model": state.model_id, "context_length": state.n_ctx,
            "queue": {"running": running, "waiting": waiting, "max": engine.max_queue},
            "counters": dict(engine.counters),
            # what a request's omitted options take (llama-server's defaults unless config.toml says otherwise)
            "sampling_defaults": asdict(state.sampling),
        }
        cache = engine.prompt_cache
        body["prompt_cache"] = asdict(cache.stats()) if cache is not None else None  # None: loading
        body["lanes"] = engine.n_lanes  # conversations decoded together
        body["batching"] = engine.batching()
        if engine.error:
            body["error"] = printable(engine.error)  # may quote a worker's words
        view = None
        try:
            view = engine.cluster_view()
        except Exception:  # a chain being rebuilt: show the rest
            log.debug("cluster view failed", exc_info=True)
        if view is not None:
            nodes = engine.nodes
            # node ids, addresses and details come from other machines: shown printable
            body["cluster"] = {
                "stages": [{"node": printable(s.node), "address": printable(s.address), "layers": list(s.layers),
                            "state": nodes[s.node].state if s.node in nodes else "ok",
                            "detail": printable(nodes[s.node].detail) if s.node in nodes else ""}
                           for s in view.stages],
                "head_layers": list(view.head_layers),
                "lost": [{"node": printable(n.node), "state": n.state, "detail": printable(n.detail)}
                         for n in nodes.values() if n.state != "ok" and n.node not in {s.node for s in view.stages}],
            }
            if engine.notice:
                body["cluster_notice"] = printable(engine.notice)
        return JSONResponse(body, status_code=status)

    metrics = ServeMetrics(state.engine)

    async def embeddings(request: Request) -> Response:
        raise ApiError(404, "potluck serve has no /v1/embeddings: it serves a chat model, whose embeddings are "
                            "not a retrieval model's; run an embedding model for them", code="not_supported")

    async def prometheus(request: Request) -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=None,
                                       headers=dict(exc.headers or {})))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(ApiError(500, f"internal error ({type(exc).__name__}); see the server's log"))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
    )
    # outermost first: Host and Origin (403), CORS (preflights answered without a key, headers
    # on every answer to an allowed page, errors included), then the key (401, 429)
    app.add_middleware(KeyMiddleware, guard=guard)
    app.add_middleware(GuardCORSMiddleware, guard=guard, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], expose_headers=["Retry-After"], allow_private_network=True,
                       max_age=600)
    app.add_middleware(OriginMiddleware, guard=guard)
    return LogMiddleware(app)  # type: ignore[return-value]


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class GuardStep(ABC):
    """A middleware that answers a request itself with :meth:`check`'s error, or passes it on."""

    def __init__(self, app: Callable[..., Awaitable[None]], guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.check(scope) if scope["type"] == "http" else None
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @abstractmethod
    def check(self, scope: Scope) -> ApiError | None:
        """The error that answers this request, or None to pass it on."""


class OriginMiddleware(GuardStep):
    """Host and Origin (the DNS-rebinding guard), before anything else reads the request."""

    def check(self, scope: Scope) -> ApiError | None:
        headers = _headers(scope)
        if not self.guard.host_allowed(headers.get("host")):
            return ApiError(403, "this Host is not allowed (a DNS-rebinding guard); add it to [server] allowed_hosts",
                            kind="permission_error")
        if not self.guard.origin_allowed(headers.get("origin")):
            return ApiError(403, "requests from this web origin are not allowed; add it to [server] allowed_origins",
                            kind="permission_error")
        return None


class GuardCORSMiddleware(CORSMiddleware):
    """Starlette's CORS handling for the origins the guard allows (loopback pages and
    ``[server] allowed_origins``): one list for both."""

    def __init__(self, app: Callable[..., Awaitable[None]], guard: Guard, **options: Any) -> None:
        super().__init__(app, **options)  # type: ignore[arg-type]
        self.guard = guard

    def is_allowed_origin(self, origin: str) -> bool:
        return self.guard.origin_allowed(origin)


class KeyMiddleware(GuardStep):
    """The API key: its name goes into the scope (``potluck.key``; "" without keys, None for a
    missing or wrong one, which only /health answers, saying ready or not). An address that
    keeps sending wrong keys waits a second a try, its keys not even compared meanwhile."""

    def check(self, scope: Scope) -> ApiError | None:
        address = (scope.get("client") or ("",))[0]
        authorization = _headers(scope).get("authorization")
        keyed = bool(self.guard.api_keys and authorization)
        wait_s = self.guard.throttle.wait_s(address) if keyed else 0.0
        name = self.guard.key_name(authorization) if wait_s == 0 else None
        if name is None and keyed and wait_s == 0:
            self.guard.throttle.failed(address)
        scope["potluck.key"] = name
        if wait_s > 0:
            return ApiError(429, "too many wrong API keys from this address; wait and retry",
                            kind="rate_limit_error", headers={"Retry-After": str(max(1, round(wait_s)))})
        if name is None and scope["path"] != "/health":
            return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                            kind="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None


class LogMiddleware:
    """One line per request: method, path, status, tokens, tokens/s, seconds."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        started = time.monotonic()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            job = scope.get("potluck.job")
            outcome: Outcome | None = getattr(job, "outcome", None)
            tokens = f"{outcome.prompt_tokens}+{outcome.completion_tokens} tokens " \
                     f"{outcome.tokens_per_s:.1f} tok/s" if outcome else "- tokens - tok/s"
            end = "" if job is None or not job.cancelled.is_set() else \
                " (timed out)" if job.timed_out else " (client gone)"
            if job is not None:  # the sampling it ran with, the client's options and the defaults
                end = " " + " ".join(f"{k}={v:g}" for k, v in sampling_fields(job.request.sampling).items()) + end
            log.info("%s %s %s %s %.2fs%s", scope["method"], printable(scope["path"]), status, tokens,
                     time.monotonic() - started, end)

"""HTTP endpoints: OpenAI `/v1/chat/completions` and `/v1/models`, Ollama's `/api/*` (ollama.py), plus
`/health`, `/metrics` (Prometheus text) and the web chat page at `/`.

Every error, unknown routes included, is in the shape of the API its path belongs to (errors.py):
OpenAI's error object on `/v1/*` (and elsewhere), Ollama's error string on `/api/*`.

Nothing heavy runs on the event loop: large bodies are parsed on a worker thread, images and
tokenisation are the engine's `prepare` stage (worker thread). A client that goes away stops its
generation wherever it is: waiting for its turn (the waiting task is cancelled), streaming (the
response's end cancels the job) or waiting for a non-streamed answer (a disconnect watcher races it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import ollama
from .access import AccessLog
from .engine import Engine, Job, Usage
from .errors import ApiError, http_error
from .guard import BODY_TIMEOUT, Guard
from .inputs import Limits, parse_chat, parse_json
from .tool_calls import Call, split

T = TypeVar("T")
THREAD_PARSE_BYTES = 256 * 2**10  # bodies above this are parsed off the event loop
CLIENT_GONE = 499                 # nginx's "client closed request", for the metrics only


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends: sent, failed or disconnected.

    `on_close` must be synchronous: after a disconnect Starlette cancels the streaming task group,
    and any await in cleanup code there would be cancelled again."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it and raise ClientGone if the client disconnects first."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


def create_app(engine: Engine, limits: Limits | None = None, api_key: str | None = None,
               allowed_hosts: list[str] | None = None, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """`allowed_hosts`: Host header names to answer (None: any; the CLI passes loopback names for a loopback bind);
    `body_timeout`: seconds a request body may stall before 408 (guard.py)."""
    app = FastAPI(title="vismmoe-kt", docs_url=None, redoc_url=None)
    app.state.engine = engine  # the command's shutdown asks it to leave a data-parallel group
    limits = limits or engine.limits
    engine.limits = limits
    page = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=limits.body_limit,
                       body_timeout=body_timeout)
    # added last, so outermost: it sees the guard's refusals too; it alone counts requests (access.py)
    app.add_middleware(AccessLog, count=engine.metrics.count)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(request.url.path), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException):  # Starlette's 404/405: not its {"detail": ...}
        error = http_error(exc.status_code, request.method, request.url.path)
        return JSONResponse(error.body(request.url.path), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # still the error contract, never a text/plain 500
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error")
        return JSONResponse(error.body(request.url.path), status_code=500)

    async def body_of(request: Request) -> Any:
        try:
            raw = await request.body()
        except ClientDisconnect:  # left while sending the body: nobody to answer, counted as such
            raise ApiError(CLIENT_GONE, "the client disconnected while sending the request") from None
        return await asyncio.to_thread(parse_json, raw) if len(raw) > THREAD_PARSE_BYTES else parse_json(raw)

    async def run(request: Request, chat, usage: Usage, respond: Callable[[str], Any],
                  stream: Callable[..., Any], media_type: str):
        """Start the job; answer whole or streamed; a client that left before its answer gets nothing."""
        try:
            job = await until_disconnected(request, engine.submit(chat, usage))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        streaming = False
        try:
            if not chat.stream:
                text = await until_disconnected(request, job.text())
                return respond(text)
            pieces = job.pieces()
            first = await until_disconnected(request, anext(pieces, None))
            streaming = True

            def closed() -> None:  # the stream began with 200; its books record how it ended (access.py)
                if job.error is not None:  # it ended with an error chunk: a 500, as a failed whole answer is
                    request.state.outcome = 500
                elif not job.finished.is_set():  # the client left mid-stream
                    request.state.outcome = CLIENT_GONE
                job.cancel()
            return ClosingStreamingResponse(stream(first, job, pieces), on_close=closed, media_type=media_type)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        finally:
            if not streaming:
                job.cancel()  # a no-op for a finished job; stops one whose client left or failed

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name}

    def usage_of(usage: Usage) -> dict[str, int]:
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens}

    served = {"id": engine.name, "object": "model", "created": 0, "owned_by": "vismmoe-kt"}

    def check_model(name: Any) -> None:
        if name is not None and name != engine.name:
            raise ApiError(404, f"the model '{name}' does not exist; this server has '{engine.name}'",
                           param="model", type_="not_found_error", code="model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return served

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        if isinstance(body, dict):
            check_model(body.get("model"))
        chat = parse_chat(body, limits)
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True  # checked by parse_chat
        usage, created, rid = Usage(), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        request.state.usage = usage  # for the access log
        reader = engine.tool_reader(chat)  # None: no tools offered, the text is the answer

        def respond(text: str) -> dict:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reader is not None:
                content, found = split(reader.read(text))
                if found:  # OpenAI's content is null beside calls when the model wrote nothing else
                    message = {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in found]}
            return {"id": rid, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish()}],
                    "usage": usage_of(usage)}

        def finish() -> str:
            return "tool_calls" if reader is not None and reader.calls else usage.finish_reason

        def deltas(events: list, index: int) -> list[dict]:
            """The stream's deltas for a reader's events: text as content; a call as its id, type and name,
            then its arguments (OpenAI's clients join a call's pieces by its index)."""
            out = []
            for event in events:
                if isinstance(event, Call):
                    out += [{"tool_calls": [{"index": index, "id": event.id, "type": "function",
                                             "function": {"name": event.name, "arguments": ""}}]},
                            {"tool_calls": [{"index": index, "function": {"arguments": event.arguments}}]}]
                    index += 1
                else:
                    out.append({"content": event.text})
            return out

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": engine.name,
                                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def events(first: str | None, job: Job, pieces):
            yield chunk({"role": "assistant", "content": ""})

            def read(piece: str | None, final: bool = False) -> list[dict]:
                if reader is None:
                    return [{"content": piece}] if piece is not None else []
                calls = reader.calls
                return deltas(reader.finish() if final else reader.feed(piece or ""), calls)
            for delta in read(first):
                yield chunk(delta)
            async for piece in pieces:
                for delta in read(piece):
                    yield chunk(delta)
            await job.finished.wait()
            if job.error is not None:  # the stream has begun: the error goes in it, as vLLM does
                yield "data: " + json.dumps(ApiError(500, f"generation failed: {job.error}", type_="internal_error").body()) + "\n\n"
            else:
                for delta in read(None, final=True):  # what the reader held back: an unclosed call, a tail
                    yield chunk(delta)
                yield chunk({}, finish())
                if include_usage:  # OpenAI's stream_options.include_usage: one last chunk, no choices, the usage
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                 "model": engine.name, "choices": [], "usage": usage_of(usage)}) + "\n\n"
            yield "data: [DONE]\n\n"
        return await run(request, chat, usage, respond, events, "text/event-stream")

    ollama.add_routes(app, engine, body_of, run)

    @app.get("/metrics")
    async def metrics():
        # on a worker thread: a real model's operator counters make ~130 KB of text, tens of ms to render,
        # a stall of every stream if done on the loop (prometheus_client's registry is thread-safe)
        text = await asyncio.to_thread(engine.metrics.text)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app

"""HTTP endpoints: OpenAI `/v1/chat/completions` and `/v1/models`, Ollama `/api/chat`, `/api/generate`,
`/api/tags`, plus `/health`, `/metrics` (Prometheus text) and the web chat page at `/`."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from .engine import Engine, Usage
from .inputs import ApiError, Limits, parse_chat, parse_ollama


def create_app(engine: Engine, limits: Limits | None = None, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="vismmoe-kt", docs_url=None, redoc_url=None)
    limits = limits or Limits()
    page = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")

    def count(endpoint: str, status: int) -> None:
        key = f'{endpoint} {status}'
        engine.metrics.requests[key] = engine.metrics.requests.get(key, 0) + 1

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        count(request.url.path, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def body_of(request: Request) -> Any:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", type_="authentication_error")
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0, "owned_by": "vismmoe-kt"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        if isinstance(body, dict) and body.get("model") not in (None, engine.name):
            raise ApiError(404, f"the model '{body['model']}' does not exist; this server has '{engine.name}'",
                           param="model", type_="not_found_error", code="model_not_found")
        chat = parse_chat(body, limits)
        usage, created, rid = Usage(), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        pieces = engine.stream(chat, usage)
        if not chat.stream:
            text = "".join([piece async for piece in pieces])
            count(request.url.path, 200)
            return {"id": rid, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": usage.finish_reason}],
                    "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                              "total_tokens": usage.prompt_tokens + usage.completion_tokens}}
        first = await _first(pieces)  # errors (bad prompt, queue full) become a JSON error, not a broken stream

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": engine.name,
                                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def events():
            try:
                yield chunk({"role": "assistant", "content": ""})
                if first is not None:
                    yield chunk({"content": first})
                async for piece in pieces:
                    if await request.is_disconnected():
                        break
                    yield chunk({"content": piece})
                yield chunk({}, usage.finish_reason)
                yield "data: [DONE]\n\n"
            finally:
                await pieces.aclose()
                count(request.url.path, 200)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def ollama(request: Request, generate: bool):
        chat = parse_ollama(await body_of(request), limits, generate)
        usage = Usage()
        pieces = engine.stream(chat, usage)

        def line(piece: str, done: bool) -> dict:
            out: dict[str, Any] = {"model": engine.name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "done": done}
            if generate:
                out["response"] = piece
            else:
                out["message"] = {"role": "assistant", "content": piece}
            if done:
                out.update(prompt_eval_count=usage.prompt_tokens, eval_count=usage.completion_tokens,
                           prompt_eval_duration=int(usage.prefill_seconds * 1e9),
                           eval_duration=int((usage.total_seconds - usage.prefill_seconds) * 1e9),
                           total_duration=int(usage.total_seconds * 1e9), done_reason=usage.finish_reason)
            return out

        if not chat.stream:
            text = "".join([piece async for piece in pieces])
            count(request.url.path, 200)
            return line(text, True)
        first = await _first(pieces)

        async def lines():
            try:
                if first is not None:
                    yield json.dumps(line(first, False)) + "\n"
                async for piece in pieces:
                    if await request.is_disconnected():
                        break
                    yield json.dumps(line(piece, False)) + "\n"
                yield json.dumps(line("", True)) + "\n"
            finally:
                await pieces.aclose()
                count(request.url.path, 200)
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/api/chat")
    async def ollama_chat(request: Request):
        return await ollama(request, generate=False)

    @app.post("/api/generate")
    async def ollama_generate(request: Request):
        return await ollama(request, generate=True)

    @app.get("/api/tags")
    async def tags():
        return {"models": [{"name": engine.name, "model": engine.name, "modified_at": "1970-01-01T00:00:00Z", "size": 0}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return prometheus_text(engine)

    return app


async def _first(pieces) -> str | None:
    """Start the generation (so its errors surface as JSON errors) and return the first piece."""
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


def prometheus_text(engine: Engine) -> str:
    from ..stats import collect_stats

    m = engine.metrics
    lines = ["# TYPE vismmoe_requests_total counter"]
    for key, value in sorted(m.requests.items()):
        endpoint, status = key.rsplit(" ", 1)
        lines.append(f'vismmoe_requests_total{{endpoint="{endpoint}",status="{status}"}} {value}')
    lines += [
        f"vismmoe_prompt_tokens_total {m.prompt_tokens}",
        f"vismmoe_generation_tokens_total {m.generation_tokens}",
        f"vismmoe_time_to_first_token_seconds_sum {m.ttft_seconds_sum:.6f}",
        f"vismmoe_time_to_first_token_seconds_count {m.ttft_count}",
        f"vismmoe_num_requests_waiting {m.waiting}",
        f"vismmoe_num_requests_running {m.running}",
        f"vismmoe_requests_rejected_total {m.rejected}",
    ]
    for operator, values in collect_stats(engine.model)["operators"].items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines.append(f'vismmoe_runtime{{operator="{operator}",stat="{key}"}} {value}')
    return "\n".join(lines) + "\n"

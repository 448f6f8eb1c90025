"""Ollama's endpoints: `/api/chat`, `/api/generate` (NDJSON streams), and the model routes its clients
call before a chat (`/api/tags`, `/api/show`, `/api/ps`, `/api/version`), with the fields they read.

Errors here are Ollama's `{"error": "..."}` (errors.py picks the shape from the path), and a request
for another model is a 404, as Ollama answers for a model it does not have.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from fastapi import FastAPI, Request

from .engine import Engine, Job, Usage
from .errors import ApiError
from .inputs import parse_ollama
from .tool_calls import Call, split

# The Ollama release whose API these routes follow; clients compare it with the version a feature needs.
OLLAMA_API_VERSION = "0.6.0"
NEVER = "9999-12-31T23:59:59Z"  # `expires_at` of a model that is never unloaded


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def human_count(n: int) -> str:
    """Ollama's `parameter_size` style: 2.9M, 30.5B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class ModelCard:
    """What Ollama's model routes say about the one loaded model, worked out once at start-up."""

    def __init__(self, engine: Engine):
        model, info = engine.model, getattr(engine.model, "vismmoe", None)
        self.name = engine.name
        self.family = getattr(model.config, "model_type", "unknown")
        # parameters only: operators may hold (compressed) expert copies besides them; those are in the sizes below
        self.parameters = sum(p.numel() for p in model.parameters())
        dtype = next(model.parameters()).dtype
        self.quantization = str(dtype).removeprefix("torch.").replace("float", "F").replace("bF", "BF").upper()
        by_device = dict(getattr(info, "bytes_by_device", {}) or {})
        self.size = sum(by_device.values())
        self.size_vram = sum(n for device, n in by_device.items() if device.startswith("cuda"))
        self.source = str(getattr(info, "model_dir", "") or "")
        self.format = "gguf" if self.source.endswith(".gguf") else "safetensors"
        self.context = engine.context
        self.loaded_at = time.time()
        # an identifier of this model as served, not a file digest (there is no single blob to hash)
        self.digest = hashlib.sha256(f"{self.name}\0{self.source}".encode()).hexdigest()
        self.defaults = {"num_predict": engine.max_new_tokens, "temperature": engine.temperature, "top_p": engine.top_p}

    def names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}:latest")  # Ollama's clients add the default tag

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": human_count(self.parameters), "quantization_level": self.quantization}

    def listed(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": iso(self.loaded_at), "size": self.size,
                "digest": self.digest, "details": self.details()}

    def show(self) -> dict[str, Any]:
        parameters = "\n".join(f"{key} {value}" for key, value in self.defaults.items() if value is not None)
        return {"modelfile": f"FROM {self.source}\n", "parameters": parameters, "template": "", "license": "",
                "details": self.details(), "modified_at": iso(self.loaded_at),
                "model_info": {"general.architecture": self.family, "general.parameter_count": self.parameters,
                               f"{self.family}.context_length": self.context},
                "capabilities": ["completion", "vision", "tools"]}

    def running(self) -> dict[str, Any]:
        return {**self.listed(), "expires_at": NEVER, "size_vram": self.size_vram, "context_length": self.context}


def check_model(body: Any, card: ModelCard) -> None:
    """404 for a model this server does not have; no `model` at all means the loaded one."""
    name = body.get("model", body.get("name")) if isinstance(body, dict) else None
    if name is not None and name not in card.names():
        raise ApiError(404, f"model '{name}' not found; this server has '{card.name}'", param="model",
                       type_="not_found_error", code="model_not_found")


def add_routes(app: FastAPI, engine: Engine, body_of: Callable, run: Callable) -> None:
    card = ModelCard(engine)

    async def answer(request: Request, generate: bool):
        body = await body_of(request)
        check_model(body, card)
        chat = parse_ollama(body, engine.limits, generate)
        usage = Usage()
        request.state.usage = usage  # for the access log
        reader = engine.tool_reader(chat)  # None: no tools offered, the text is the answer

        def line(piece: str, done: bool, calls: list[Call] = ()) -> dict:
            out: dict[str, Any] = {"model": engine.name, "created_at": iso(time.time()), "done": done}
            if generate:
                out["response"] = piece
            else:
                out["message"] = {"role": "assistant", "content": piece}
                if calls:  # Ollama's calls: the function's name and its arguments as an object
                    out["message"]["tool_calls"] = [c.ollama() for c in calls]
            if done:
                # load_duration: the model was loaded at start-up, so no request waits for a load
                out.update(prompt_eval_count=usage.prompt_tokens, eval_count=usage.completion_tokens,
                           prompt_eval_duration=int(usage.prefill_seconds * 1e9),
                           eval_duration=int((usage.total_seconds - usage.prefill_seconds) * 1e9),
                           total_duration=int(usage.total_seconds * 1e9), load_duration=0,
                           done_reason=usage.finish_reason)
            return out

        def whole(text: str) -> dict:
            if reader is None:
                return line(text, True)
            content, calls = split(reader.read(text))
            return line(content, True, calls)

        def read(piece: str | None, final: bool = False) -> list[str]:
            """NDJSON lines for a piece of text: itself, or what the tool-call reader makes of it (a call has a
            line of its own, as Ollama streams them)."""
            if reader is None:
                return [json.dumps(line(piece, False)) + "\n"] if piece is not None else []
            events = reader.finish() if final else reader.feed(piece or "")
            return [json.dumps(line("", False, [e]) if isinstance(e, Call) else line(e.text, False)) + "\n"
                    for e in events]

        async def lines(first: str | None, job: Job, pieces):
            for out in read(first):
                yield out
            async for piece in pieces:
                for out in read(piece):
                    yield out
            await job.finished.wait()
            if job.error is not None:
                yield json.dumps({"error": f"generation failed: {job.error}"}) + "\n"
            else:
                for out in read(None, final=True):
                    yield out
                yield json.dumps(line("", True)) + "\n"
        return await run(request, chat, usage, whole, lines, "application/x-ndjson")

    @app.post("/api/chat")
    async def ollama_chat(request: Request):
        return await answer(request, generate=False)

    @app.post("/api/generate")
    async def ollama_generate(request: Request):
        return await answer(request, generate=True)

    @app.get("/api/tags")
    async def tags():
        return {"models": [card.listed()]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("model", body.get("name")), str):
            raise ApiError(400, "'model' must be the name of a model", param="model")
        check_model(body, card)
        return card.show()

    @app.get("/api/ps")
    async def ps():
        return {"models": [card.running()]}

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_API_VERSION}

"""One model, one generation at a time, a bounded wait queue, streamed text, cancellation.

`Engine.stream(request)` is an async generator of text pieces; it waits its turn (or raises a 429
ApiError when `max_queue` requests already wait), runs `model.generate` on a worker thread with a
TextIteratorStreamer, stops at `stop` strings, and stops generating as soon as the consumer goes away
(closing the generator sets the cancel flag the stopping criterion reads), so a disconnected client
frees the slot. Requests run one after another, as in the ktransformers server: its users saw
answers mixed between clients without that serialisation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from ..decode.generation import generate
from .inputs import ApiError, ChatRequest


class _Cancelled(StoppingCriteria):
    def __init__(self, flag: threading.Event):
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = "stop"


@dataclass
class Metrics:
    requests: dict[str, int] = field(default_factory=dict)  # "endpoint status" -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0
    waiting: int = 0
    running: int = 0
    rejected: int = 0


class Engine:
    def __init__(self, model: Any, processor: Any, name: str, max_new_tokens: int = 1000,
                 temperature: float | None = None, top_p: float | None = None, max_queue: int = 8):
        self.model, self.processor, self.name = model, processor, name
        self.max_new_tokens, self.temperature, self.top_p, self.max_queue = max_new_tokens, temperature, top_p, max_queue
        self.context = model.config.get_text_config().max_position_embeddings
        self.metrics = Metrics()
        self._turn: asyncio.Lock | None = None

    def _inputs(self, request: ChatRequest):
        prompt = self.processor.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[prompt], images=request.images or None, return_tensors="pt")
        length = int(inputs["input_ids"].shape[1])
        if length + 1 > self.context:
            raise ApiError(400, f"the prompt is {length} tokens, over this model's context of {self.context}",
                           param="messages", code="context_length_exceeded")
        return inputs.to(self.model.get_input_embeddings().weight.device), length

    def _sampling(self, request: ChatRequest) -> dict:
        temperature = request.temperature if request.temperature is not None else self.temperature
        top_p = request.top_p if request.top_p is not None else self.top_p
        if not temperature:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": temperature, "top_p": top_p if top_p is not None else 1.0}

    async def stream(self, request: ChatRequest, usage: Usage) -> AsyncIterator[str]:
        if self._turn is None:
            self._turn = asyncio.Lock()
        inputs, usage.prompt_tokens = self._inputs(request)  # bad input fails before queueing
        m = self.metrics
        if m.waiting >= self.max_queue:
            m.rejected += 1
            raise ApiError(429, f"the server is busy: {m.waiting} requests are waiting", type_="server_busy",
                           code="queue_full")
        m.waiting += 1
        try:
            await self._turn.acquire()
        finally:
            m.waiting -= 1
        cancel = threading.Event()
        streamer = TextIteratorStreamer(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, Any] = {}
        limit = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens, self.context - usage.prompt_tokens)

        def work() -> None:
            try:
                with torch.inference_mode():
                    result["ids"] = generate(self.model, inputs, limit, streamer=streamer,
                                             stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                                             **self._sampling(request))
            except Exception as exc:  # reported to the client below; the server keeps serving
                result["error"] = exc
                streamer.end()

        m.running = 1
        start = time.perf_counter()
        thread = threading.Thread(target=work, name="vismmoe-generate", daemon=True)
        thread.start()
        text, first, hit_stop = "", None, False
        try:
            pieces = iter(streamer)
            while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                if first is None:
                    first = time.perf_counter()
                text += piece
                cut = min((text.find(s) for s in request.stop if s in text), default=-1)
                if cut >= 0:
                    yield piece[: len(piece) - (len(text) - cut)]
                    cancel.set()
                    hit_stop = True
                    break
                if piece:
                    yield piece
        finally:
            cancel.set()
            await asyncio.to_thread(thread.join)
            m.running = 0
            self._turn.release()
            end = time.perf_counter()
            usage.prefill_seconds = (first or end) - start
            usage.total_seconds = end - start
            if "ids" in result:
                usage.completion_tokens = int(result["ids"].shape[1]) - usage.prompt_tokens
                usage.finish_reason = "length" if usage.completion_tokens >= limit and not hit_stop else "stop"
            m.prompt_tokens += usage.prompt_tokens
            m.generation_tokens += usage.completion_tokens
            if first is not None:
                m.ttft_seconds_sum += first - start
                m.ttft_count += 1
        if "error" in result:
            raise ApiError(500, f"generation failed: {result['error']}", type_="internal_error")


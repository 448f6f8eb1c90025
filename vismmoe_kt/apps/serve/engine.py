"""One model, one generation at a time, a bounded wait queue, streamed text, cancellation.

A request goes through four stages:

    admit (on the loop, instant)  ->  prepare (worker thread)  ->  wait for the turn  ->  generate (worker thread)

- `admit` takes a place in the queue or refuses at once with 429: nothing is decoded or tokenised for
  a request that will be refused. `max_queue` counts the requests that may wait while one runs, so
  `max_queue 0` still serves one request at a time.
- `prepare` decodes the images and tokenises the prompt on a worker thread (at most `PREPARE_SLOTS`
  at a time, so a burst of large images cannot take all memory), after checks from the text length
  alone: a prompt whose characters cannot fit the context is refused before it is tokenised.
- The turn is an asyncio.Lock (FIFO). Requests run one after another, as in the ktransformers server:
  its users saw answers mixed between clients without that serialisation.
- `generate` runs on its own thread and releases the turn itself when it ends
  (`loop.call_soon_threadsafe`), so no await in a consumer's cleanup is needed for the slot to come
  back. (The first version released it after `await thread.join` in a `finally`; a client that
  disconnected made Starlette cancel that await too, and the slot was never released.) Consumers
  only set the job's cancel flag, which is synchronous; the stopping criterion reads it at the next
  decode step.

Stop strings are matched across streamed pieces (`stops.StopMatcher`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import torch
from transformers import AsyncTextIteratorStreamer, StoppingCriteria, StoppingCriteriaList

from ...engine.generation import generate
from ...engine.inputs import build_inputs, model_device
from .errors import ApiError
from .inputs import ChatRequest, ImageRef, Limits, decode_image
from .metrics import ServerMetrics
from .stops import StopMatcher

PREPARE_SLOTS = 2  # requests decoding images / tokenising at once (memory bound: images are decoded whole)


class _Cancelled(StoppingCriteria):
    def __init__(self, flag: threading.Event):
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


class TimedStreamer(AsyncTextIteratorStreamer):
    """The request's text streamer, timing the gap between its consecutive tokens for the inter-token
    latency histogram. `put` runs on the generating thread: once with the prompt (which the streamer
    skips), then once per token, in the transformers loop, the lean loop and the batching thread alike."""

    def __init__(self, tokenizer: Any, gaps: Any):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.gaps, self.puts, self.last = gaps, 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:  # a token, not the prompt
            now = time.perf_counter()
            if self.last is not None:
                self.gaps.observe(now - self.last)
            self.last = now
        super().put(value)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = "stop"
    arrived: float = 0.0  # perf_counter when the request was admitted: its TTFT and latency count the queue too


@dataclass
class Prepared:
    inputs: Any            # the processor's output, on the model's device
    prompt_tokens: int


class Ticket:
    """A place in the engine: waiting, then running (until the generation thread ends)."""

    def __init__(self, engine: "Engine"):
        self.engine, self.state = engine, "waiting"

    def leave(self) -> None:
        """Give up a place that is still waiting; once running, the job's end frees it (idempotent)."""
        if self.state == "waiting":
            self.engine._waiting -= 1
            self.state = "gone"
            self.engine.metrics.set_queue(self.engine._waiting, self.engine._running)

    def _run(self) -> None:
        self.engine._waiting -= 1
        self.engine._running += 1
        self.state = "running"
        self.engine.metrics.set_queue(self.engine._waiting, self.engine._running)

    def _done(self) -> None:
        self.engine._running -= 1
        self.state = "gone"
        self.engine.metrics.set_queue(self.engine._waiting, self.engine._running)


class Job:
    """One generation on its worker thread. `cancel()` is safe from anywhere, any number of times."""

    def __init__(self, streamer: AsyncTextIteratorStreamer, stops: list[str], limit: int):
        self.streamer, self.limit = streamer, limit
        self.matcher = StopMatcher(stops)
        self.cancel_flag = threading.Event()
        self.finished = asyncio.Event()  # set on the loop after the thread ended and the turn was released
        self.ids: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.first_piece: float | None = None

    def cancel(self) -> None:
        self.cancel_flag.set()

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it is generated, up to a stop string; the held-back tail at the end."""
        async for piece in self.streamer:
            if self.first_piece is None:
                self.first_piece = time.perf_counter()
            if out := self.matcher.feed(piece):
                yield out
            if self.matcher.stopped:
                self.cancel()
                break
        if tail := self.matcher.flush():
            yield tail

    async def text(self) -> str:
        """The whole answer, once the generation ended."""
        parts = [piece async for piece in self.pieces()]
        await self.finished.wait()  # the thread ends within a step once cancelled or done
        self.raise_error()
        return "".join(parts)

    def raise_error(self) -> None:
        if self.error is not None:
            raise ApiError(500, f"generation failed: {self.error}", type_="internal_error")


class Engine:
    def __init__(self, model: Any, processor: Any, name: str, max_new_tokens: int = 1000,
                 temperature: float | None = None, top_p: float | None = None, max_queue: int = 8,
                 limits: Limits | None = None, generate_fn: Callable[..., torch.Tensor] = generate):
        self.model, self.processor, self.name = model, processor, name
        self.max_new_tokens, self.temperature, self.top_p, self.max_queue = max_new_tokens, temperature, top_p, max_queue
        self.limits = limits or Limits()
        self.generate_fn = generate_fn  # tests hand in a stand-in to control timing; the server uses ours
        self.context = model.vismmoe.adapter.context_length(model.config)
        tokenizer = processor.tokenizer
        self.special_tokens = sorted(set(tokenizer.all_special_tokens) | {
            str(token) for token in tokenizer.added_tokens_decoder.values() if token.special}, key=len, reverse=True)
        # Every token covers at most this many characters of text, so a text longer than
        # context * longest cannot fit the context whatever the tokenizer does with it.
        self.chars_per_token = max((len(t) for t in tokenizer.get_vocab() if t not in self.special_tokens), default=1)
        self.metrics = ServerMetrics(model)
        self._waiting = self._running = 0
        self._turn: asyncio.Lock | None = None
        self._prepare_slots: asyncio.Semaphore | None = None

    # -- stages -------------------------------------------------------------------------------
    def admit(self) -> Ticket:
        """A place in the queue, or 429 at once when `max_queue` requests already wait behind a running one."""
        if self._waiting + self._running > self.max_queue:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {self._waiting} requests are waiting", type_="server_busy",
                           code="queue_full")
        self._waiting += 1
        self.metrics.set_queue(self._waiting, self._running)
        return Ticket(self)

    def check_text(self, request: ChatRequest) -> None:
        """Checks from the text alone, cheap enough for the event loop."""
        total = 0
        for where, text in request.texts():
            total += len(text)
            for token in self.special_tokens:
                if token in text:
                    raise ApiError(400, f"{where}: the text contains the model's special token {token!r}; "
                                        f"images go in image_url parts, not as tokens in text", param=where)
        if total > (self.context - 1) * self.chars_per_token:
            raise ApiError(400, f"the prompt has {total:,} characters, which cannot fit this model's context of "
                                f"{self.context} tokens", param="messages", code="context_length_exceeded")

    async def prepare(self, request: ChatRequest) -> Prepared:
        """Decode images and tokenise on a worker thread; errors are 400s naming the problem."""
        self.check_text(request)
        if self._prepare_slots is None:
            self._prepare_slots = asyncio.Semaphore(PREPARE_SLOTS)
        slots = self._prepare_slots
        await slots.acquire()
        work = asyncio.ensure_future(asyncio.to_thread(self._prepare, request))

        def done(future: asyncio.Future) -> None:
            slots.release()  # when the thread ends, not when a cancelled request stops waiting for it
            if not future.cancelled():
                future.exception()  # retrieved: an abandoned request's error is not logged as unhandled
        work.add_done_callback(done)
        return await asyncio.shield(work)

    def _prepare(self, request: ChatRequest) -> Prepared:
        images = [decode_image(i, self.limits) if isinstance(i, ImageRef) else i for i in request.images]
        try:
            inputs = build_inputs(self.processor, request.messages, images)
        except (ValueError, TypeError, StopIteration) as exc:  # the processor's own checks (e.g. aspect ratio)
            raise ApiError(400, f"the model's processor refused the input: {exc or type(exc).__name__}") from None
        length = int(inputs["input_ids"].shape[1])
        if length + 1 > self.context:
            raise ApiError(400, f"the prompt is {length} tokens, over this model's context of {self.context}",
                           param="messages", code="context_length_exceeded")
        return Prepared(inputs.to(model_device(self.model)), length)

    async def start(self, request: ChatRequest, prepared: Prepared, ticket: Ticket, usage: Usage) -> Job:
        """Wait for the turn, then start generating on a worker thread."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        await self._turn.acquire()
        # From here to the thread's start there is no await: the turn cannot be lost to a cancellation.
        try:
            return self._launch(request, prepared, ticket, usage)
        except BaseException:
            self._turn.release()
            raise

    def _launch(self, request: ChatRequest, prepared: Prepared, ticket: Ticket, usage: Usage) -> Job:
        ticket._run()
        usage.prompt_tokens = prepared.prompt_tokens
        limit = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens, self.context - prepared.prompt_tokens)
        streamer = TimedStreamer(self.processor.tokenizer, self.metrics.inter_token)
        job = Job(streamer, request.stop, limit)
        loop, start = asyncio.get_running_loop(), time.perf_counter()

        def work() -> None:
            try:
                with torch.inference_mode():
                    job.ids = self.generate_fn(self.model, prepared.inputs, limit, streamer=streamer,
                                               stopping_criteria=StoppingCriteriaList([_Cancelled(job.cancel_flag)]),
                                               **self._sampling(request))
            except BaseException as exc:  # reported to the client; the server keeps serving
                job.error = exc
                streamer.end()
            finally:
                try:
                    loop.call_soon_threadsafe(self._finish, job, ticket, usage, start)
                except RuntimeError:  # the loop is closed: the server is shutting down
                    pass

        threading.Thread(target=work, name="vismmoe-generate", daemon=True).start()
        return job

    def _finish(self, job: Job, ticket: Ticket, usage: Usage, start: float) -> None:
        """On the loop, after the generation thread ended: free the turn, account the request."""
        ticket._done()
        self._turn.release()
        end = time.perf_counter()
        usage.prefill_seconds = (job.first_piece or end) - start
        usage.total_seconds = end - start
        if job.ids is not None:
            usage.completion_tokens = int(job.ids.shape[1]) - usage.prompt_tokens
            usage.finish_reason = "length" if usage.completion_tokens >= job.limit and not job.matcher.stopped else "stop"
        self.metrics.finished(usage, job.first_piece, end, cancelled=job.cancel_flag.is_set() and not job.matcher.stopped)
        job.finished.set()

    def _sampling(self, request: ChatRequest) -> dict:
        temperature = request.temperature if request.temperature is not None else self.temperature
        top_p = request.top_p if request.top_p is not None else self.top_p
        if not temperature:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": temperature, "top_p": top_p if top_p is not None else 1.0}

    # -- the whole request ----------------------------------------------------------------------
    async def submit(self, request: ChatRequest, usage: Usage) -> Job:
        """Admit, prepare and start one request; a failure or cancellation before the start frees its place."""
        ticket = self.admit()
        usage.arrived = time.perf_counter()
        try:
            prepared = await self.prepare(request)
            return await self.start(request, prepared, ticket, usage)
        finally:
            ticket.leave()  # a no-op once the job runs: its end frees the place

    async def stream(self, request: ChatRequest, usage: Usage) -> AsyncIterator[str]:
        """Text pieces of one request; closing or cancelling the consumer cancels the generation."""
        job = await self.submit(request, usage)
        try:
            async for piece in job.pieces():
                yield piece
            await job.finished.wait()
        finally:
            job.cancel()  # synchronous: a cancelled consumer cannot lose the turn here
        job.raise_error()

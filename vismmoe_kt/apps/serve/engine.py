"""The server's one engine: admission, a bounded wait queue, continuous batching, streamed text, cancellation.

A request goes through four stages:

    admit (on the loop, instant)  ->  prepare (worker thread)  ->  wait for a slot  ->  run (batching thread)

- `admit` takes a place or refuses at once with 429: nothing is decoded or tokenised for a request
  that will be refused. The rule: the server holds at most `max_batch + max_queue` requests, admitted
  and not yet ended. Up to `max_batch` run (each in a slot of the runner); the others wait (being
  prepared, or queued for a slot). So `max_queue 0` still serves `max_batch` requests at a time, and
  `--max_batch 1` is the serial server: one runs, `max_queue` may wait behind it.
- `prepare` decodes the images and tokenises the prompt on a worker thread (at most `PREPARE_SLOTS`
  at a time, so a burst of large images cannot take all memory), after checks from the text length
  alone: a prompt whose characters cannot fit the context is refused before it is tokenised.
- `start` hands the request to the batching thread (batching.py), which owns the model and a runner
  (runners.py: a ModelRunner where the model has our lean decode path, else a SerialRunner around
  transformers' loop, one request at a time), chosen once when the engine is made. Requests get a
  slot in the order they were started (FIFO), as in the ktransformers server, whose users saw answers
  mixed between clients without an order kept. Each sampled id goes to the request's streamer.
- Consumers only cancel the job, which is synchronous: a queued request leaves the queue at once, a
  running one ends at the runner's next step (the SerialRunner's stopping criterion reads it within
  a token). Its end is accounted on the event loop.

A generation that fails is a 500 for its requests (in the stream, once it began); the server serves on.
Stop strings are matched across streamed pieces (`stops.StopMatcher`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch
from jinja2 import TemplateError
from transformers import AsyncTextIteratorStreamer

from ...engine.runner import PREFILL_BUDGET, Sampling
from ...engine.inputs import build_inputs, model_device
from .batching import BatchingThread, Entry
from .errors import ApiError
from .inputs import ChatRequest, ImageRef, Limits, decode_image
from .metrics import ServerMetrics
from .runners import ServedRequest, make_runner
from .stops import StopMatcher
from .tool_calls import ToolCallReader, syntax_for
from .tools import ToolPrompt

PREPARE_SLOTS = 2  # requests decoding images / tokenising at once (memory bound: images are decoded whole)


class TimedStreamer(AsyncTextIteratorStreamer):
    """The request's text streamer, timing the gap between its consecutive tokens for the inter-token
    latency histogram. `put` runs on the batching thread: once with the prompt (which the streamer
    skips), then once per token."""

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
    """A place in the engine: waiting (prepared, then queued for a slot), then running (in the runner)."""

    def __init__(self, engine: "Engine"):
        self.engine, self.state = engine, "waiting"

    def leave(self) -> None:
        """Give up a place before it was started; once started, the request's end frees it (idempotent)."""
        if self.state == "waiting":
            self.engine._waiting -= 1
            self.state = "gone"
            self.engine._show_queue()

    def _queued(self) -> None:
        self.state = "queued"  # still waiting: counted so until it gets a slot

    def _run(self) -> None:
        if self.state == "queued":
            self.engine._waiting -= 1
            self.engine._running += 1
            self.state = "running"
            self.engine._show_queue()

    def _done(self) -> None:
        if self.state == "running":
            self.engine._running -= 1
        elif self.state == "queued":
            self.engine._waiting -= 1
        self.state = "gone"
        self.engine._show_queue()


class Job:
    """One request's generation as its consumers see it. `cancel()` is safe on the loop, any number of times."""

    def __init__(self, streamer: AsyncTextIteratorStreamer, stops: list[str], limit: int, request: ServedRequest):
        self.streamer, self.limit = streamer, limit
        self.matcher = StopMatcher(stops)
        self.cancel_flag = request.cancel_flag  # read by the batching thread and the SerialRunner
        self.finished = asyncio.Event()  # set on the loop after the request ended and its place was freed
        self.ids: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.first_piece: float | None = None
        self.withdraw = lambda: None  # leaves the batching thread's queue (set when started)

    def cancel(self) -> None:
        self.cancel_flag.set()
        self.withdraw()

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
        await self.finished.wait()  # the request ends within a step once cancelled or done
        self.raise_error()
        return "".join(parts)

    def raise_error(self) -> None:
        if self.error is not None:
            raise ApiError(500, f"generation failed: {self.error}", type_="internal_error")


class Engine:
    """`runner`: what the batching thread steps (tests hand in a scripted one); by default `make_runner`'s
    choice for the model, with `max_batch` slots of `slot_tokens` (the model's context at most).
    `group`: data parallel over an expert-parallel group (serve --data_parallel)."""

    def __init__(self, model: Any, processor: Any, name: str, max_new_tokens: int = 1000,
                 temperature: float | None = None, top_p: float | None = None, max_queue: int = 8,
                 limits: Limits | None = None, *, max_batch: int = 1, slot_tokens: int = 4096,
                 prefill_chunk: int | None = None, prefill_budget: int = PREFILL_BUDGET, group: Any = None,
                 runner: Any = None):
        self.model, self.processor, self.name = model, processor, name
        self.max_new_tokens, self.temperature, self.top_p, self.max_queue = max_new_tokens, temperature, top_p, max_queue
        self.max_batch = max_batch
        self.limits = limits or Limits()
        self.context = model.vismmoe.adapter.context_length(model.config)
        tokenizer = processor.tokenizer
        self.special_tokens = sorted(set(tokenizer.all_special_tokens) | {
            str(token) for token in tokenizer.added_tokens_decoder.values() if token.special}, key=len, reverse=True)
        # Every token covers at most this many characters of text, so a text longer than
        # context * longest cannot fit the context whatever the tokenizer does with it.
        self.chars_per_token = max((len(t) for t in tokenizer.get_vocab() if t not in self.special_tokens), default=1)
        self.metrics = ServerMetrics(model)
        # the family's tool-call syntax and how its prompts carry tools, chosen once (tools.py, tool_calls.py)
        self.tool_syntax, native_tools = syntax_for(getattr(model.config, "model_type", ""))
        self.tool_prompt = ToolPrompt(processor, native_tools)
        self._waiting = self._running = 0
        self._prepare_slots: asyncio.Semaphore | None = None
        self.slot_tokens: int | None = None  # the tokens a request may hold, when less than the context
        if runner is None:  # made here, on the thread that loads: an unsuitable model fails at start-up
            runner, self.slot_tokens = make_runner(model, max_batch, min(slot_tokens, self.context), prefill_chunk,
                                                   prefill_budget, "--data_parallel" if group is not None else None)
        self.runner = runner
        lockstep = None
        if group is not None:  # this rank's passes in step with the others'; idle, it serves theirs
            from ...parallel.lockstep import Lockstep

            lockstep = Lockstep(model, group)
        self._batching = BatchingThread(runner, max_batch, ran=lambda entry: entry.ticket._run(), ended=self._finish,
                                        lockstep=lockstep, observe=self.metrics.batch_size.observe)

    # -- stages -------------------------------------------------------------------------------
    def admit(self) -> Ticket:
        """A place, or 429 at once when `max_batch + max_queue` requests are already in the server."""
        if self._waiting + self._running >= self.max_batch + self.max_queue:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {self._running} requests are running and {self._waiting} "
                                "waiting", type_="server_busy", code="queue_full")
        self._waiting += 1
        self._show_queue()
        return Ticket(self)

    def _show_queue(self) -> None:
        self.metrics.set_queue(self._waiting, self._running)

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
        messages, tools = self.tool_prompt.render(request.messages, request.tools)
        try:
            inputs = build_inputs(self.processor, messages, images, tools=tools)
        except (ValueError, TypeError, StopIteration, TemplateError) as exc:  # the processor's and template's checks
            raise ApiError(400, f"the model's processor refused the input: {exc or type(exc).__name__}") from None
        length = int(inputs["input_ids"].shape[1])
        if length + 1 > self.context:
            raise ApiError(400, f"the prompt is {length} tokens, over this model's context of {self.context}",
                           param="messages", code="context_length_exceeded")
        return Prepared(inputs.to(model_device(self.model)), length)

    def start(self, request: ChatRequest, prepared: Prepared, ticket: Ticket, usage: Usage) -> Job:
        """Hand the request to the batching thread, which runs it when a slot is free (FIFO)."""
        slot = self.slot_tokens or self.context
        limit = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens, slot - prepared.prompt_tokens)
        if limit < 1:  # only with slots smaller than the context: `prepare` checked the context
            raise ApiError(400, f"the prompt is {prepared.prompt_tokens} tokens: a request's slot holds "
                                f"{slot} (--slot_tokens) with the answer", param="messages",
                           code="context_length_exceeded")
        usage.prompt_tokens = prepared.prompt_tokens
        streamer = TimedStreamer(self.processor.tokenizer, self.metrics.inter_token)
        streamer.put(prepared.inputs["input_ids"].cpu())  # the prompt, which the streamer skips
        served = ServedRequest(prepared.inputs, limit, self._sampling(request),
                               on_token=lambda token: streamer.put(torch.tensor([token])))
        job = Job(streamer, request.stop, limit, served)
        entry = Entry(job, served, ticket, usage, asyncio.get_running_loop())
        job.withdraw = lambda: self._batching.withdraw(entry)
        ticket._queued()
        self._batching.put(entry)
        return job

    def _finish(self, entry: Entry) -> None:
        """On the loop, after the request ended (run, cancelled or failed): free its place, account it."""
        job, usage = entry.job, entry.usage
        entry.ticket._done()
        job.error = entry.error
        sequence = entry.request.sequence
        job.ids = None if entry.error is not None else torch.tensor([sequence.generated if sequence else []])
        job.streamer.end()
        end = time.perf_counter()
        start = entry.started or end
        usage.prefill_seconds = max((job.first_piece or end) - start, 0.0)
        usage.total_seconds = end - start
        if job.ids is not None:
            usage.completion_tokens = int(job.ids.shape[1])
            usage.finish_reason = "length" if usage.completion_tokens >= job.limit and not job.matcher.stopped else "stop"
        self.metrics.finished(usage, job.first_piece, end, cancelled=job.cancel_flag.is_set() and not job.matcher.stopped)
        job.finished.set()

    def tool_reader(self, request: ChatRequest) -> ToolCallReader | None:
        """What reads the request's answer for tool calls; None when it offered no tools."""
        if not request.tools:
            return None
        return ToolCallReader(self.tool_syntax, {t["function"]["name"] for t in request.tools}, request.max_tool_calls)

    def _sampling(self, request: ChatRequest) -> Sampling:
        temperature = request.temperature if request.temperature is not None else self.temperature
        top_p = request.top_p if request.top_p is not None else self.top_p
        return Sampling.of(temperature, top_p)  # greedy below MIN_TEMPERATURE, in either runner

    def leave_group(self, timeout_s: float = 60.0) -> None:
        """At shutdown, data parallel: every rank leaves at one round of the group (BatchingThread)."""
        self._batching.leave_group(timeout_s)

    # -- the whole request ----------------------------------------------------------------------
    async def submit(self, request: ChatRequest, usage: Usage) -> Job:
        """Admit, prepare and start one request; a failure or cancellation before the start frees its place."""
        ticket = self.admit()
        usage.arrived = time.perf_counter()
        try:
            prepared = await self.prepare(request)
            return self.start(request, prepared, ticket, usage)
        finally:
            ticket.leave()  # a no-op once started: the request's end frees the place

    async def stream(self, request: ChatRequest, usage: Usage) -> AsyncIterator[str]:
        """Text pieces of one request; closing or cancelling the consumer cancels the generation."""
        job = await self.submit(request, usage)
        try:
            async for piece in job.pieces():
                yield piece
            await job.finished.wait()
        finally:
            job.cancel()  # synchronous: a cancelled consumer cannot keep its place here
        job.raise_error()

"""The server's engine with continuous batching (`vismmoe-kt serve --max_batch N`, N > 1).

Admission, preparation (images, tokens) and the streamed, stop-matched text are the serial Engine's
(engine.py). What changes is the turn: instead of one generation thread per request behind a lock,
one batching thread owns the model and a ModelRunner (engine/runner.py). Started jobs go into its
inbox; at every step it takes them in, drops the cancelled ones (a client that left, or a stop
string matched), runs the scheduler's next plan (a chunk of one prompt prefilled, `--prefill_chunk`
tokens, and a token for every running request, all rows in one forward) and hands each sampled id to its request's streamer. A request
that ends is finished on the event loop, as in the serial engine.

Slots hold `slot_tokens` tokens (prompt and answer): a request that would not fit gets 400 before it
waits. `max_batch` requests run at once, `max_queue` more may wait. A step that fails fails the
requests it ran (500 in their streams), and the server keeps serving.

Data parallel under torchrun (`serve --data_parallel`): every rank runs this engine behind a server of
its own (port + rank), its passes in step with the other ranks' (parallel/lockstep.py). While it has no
requests, it joins a round with the group every IDLE_ROUND_S and serves the passes another rank runs.
A rank that shuts down stops the group at the next round: every rank ends its requests and stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import torch

from ...engine.runner import PREFILL_BUDGET, BatchRequest, ModelRunner, Sampling
from .engine import Engine, Job, Prepared, Ticket, TimedStreamer, Usage
from .errors import ApiError
from .inputs import ChatRequest

IDLE_ROUND_S = 0.005  # data parallel, no requests: a round with the group this often (others' passes wait for it)


class BatchedEngine(Engine):
    def __init__(self, *args: Any, max_batch: int, slot_tokens: int, prefill_chunk: int | None = None,
                 prefill_budget: int = PREFILL_BUDGET, group: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_batch = max_batch
        self.slot_tokens = min(slot_tokens, self.context)
        # made here, on the thread that loads: an unsuitable model (no lean decode path) fails at start-up
        self.runner = ModelRunner(self.model, max_batch, self.slot_tokens, max_queue=max_batch + self.max_queue,
                                  prefill_chunk=prefill_chunk, prefill_budget=prefill_budget)
        # data parallel over an expert-parallel group (serve --data_parallel): this rank's passes in step
        # with the others', and while it waits for requests it serves theirs (parallel/lockstep.py)
        self.lockstep = None
        if group is not None:
            from ...parallel.lockstep import Lockstep

            self.lockstep = Lockstep(self.model, group)
        self._inbox: list[tuple[Job, BatchRequest, Ticket, Usage, float, asyncio.AbstractEventLoop]] = []
        self._active: dict[int, tuple[Job, BatchRequest, Ticket, Usage, float, asyncio.AbstractEventLoop]] = {}
        self._wake = threading.Condition()
        self._leaving = False
        self._thread = threading.Thread(target=self._loop, name="vismmoe-batch", daemon=True)
        self._thread.start()

    def admit(self) -> Ticket:
        """As the serial engine, with `max_batch` requests running beside the `max_queue` that wait."""
        if self._waiting + self._running >= self.max_queue + self.max_batch:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy: {self._running} requests are running and {self._waiting} "
                                "waiting", type_="server_busy", code="queue_full")
        self._waiting += 1
        self.metrics.set_queue(self._waiting, self._running)
        return Ticket(self)

    async def start(self, request: ChatRequest, prepared: Prepared, ticket: Ticket, usage: Usage) -> Job:
        limit = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens,
                    self.slot_tokens - prepared.prompt_tokens)
        if limit < 1:
            raise ApiError(400, f"the prompt is {prepared.prompt_tokens} tokens: a request's slot holds "
                                f"{self.slot_tokens} (--slot_tokens) with the answer", param="messages",
                           code="context_length_exceeded")
        ticket._run()
        usage.prompt_tokens = prepared.prompt_tokens
        streamer = TimedStreamer(self.processor.tokenizer, self.metrics.inter_token)
        streamer.put(prepared.inputs["input_ids"].cpu())  # the prompt, which the streamer skips
        job = Job(streamer, request.stop, limit)
        sampling = self._sampling(request)
        chosen = Sampling(sampling["do_sample"], sampling.get("temperature", 1.0), sampling.get("top_p", 1.0))
        batch_request = BatchRequest(prepared.inputs, limit, chosen,
                                     on_token=lambda token: streamer.put(torch.tensor([token])))
        with self._wake:
            self._inbox.append((job, batch_request, ticket, usage, time.perf_counter(), asyncio.get_running_loop()))
            self._wake.notify()
        return job

    # -- the batching thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        from ...parallel.lockstep import GroupStopped

        try:
            self._serve_steps()
        except GroupStopped as exc:  # a rank stopped, so does this one: its requests end, its server stops
            self._fail_all(exc, step=False)
            if not self._leaving:
                os.kill(os.getpid(), signal.SIGINT)  # uvicorn's own shutdown

    def _serve_steps(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and self.runner.idle:
                    if self.lockstep is None:
                        self._wake.wait()
                        continue
                    self._wake.wait(timeout=IDLE_ROUND_S)  # then one round with the group: serve its passes
                    if not self._inbox:
                        break
                arrived, self._inbox = self._inbox, []
            if self.lockstep is not None and not arrived and self.runner.idle:
                self.lockstep.tick()
                continue
            for entry in arrived:
                try:
                    self.runner.add(entry[1])
                except Exception as exc:  # cannot happen after `start`'s checks; reported, not lost
                    self._end(entry, exc)
                    continue
                self._active[entry[1].sequence.id] = entry
            for entry in self._active.values():
                if entry[0].cancel_flag.is_set():
                    self.runner.cancel(entry[1])
            try:
                with torch.inference_mode():
                    size, ended = self.runner.step()
            except GroupStopped:
                raise
            except Exception as exc:  # the step's requests fail; the server goes on
                self._fail_all(exc)
                continue
            if size:
                self.metrics.batch_size.observe(size)
            for request in ended:
                self._end(self._active.pop(request.sequence.id), None)

    def leave_group(self, timeout_s: float = 60.0) -> None:
        """At shutdown, data parallel: stop the group at its next round and wait for this rank's batching
        thread to see it (every rank then leaves together, before the group is torn down)."""
        if self.lockstep is None:
            return
        self._leaving = True
        self.lockstep.ask_to_stop()
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout_s)

    def _fail_all(self, error: BaseException, step: bool = True) -> None:
        """After a step failed half-way: every request in the runner ends with the error, and the runner's
        next plan drops them all (their slots come back). `step`: run that plan (not once the group
        stopped: it would need a round)."""
        for entry in self._active.values():
            self.runner.cancel(entry[1])
            self._end(entry, error)
        self._active.clear()
        if not step:  # the group stopped: nothing more runs here, so the waiting requests end too
            with self._wake:
                waiting, self._inbox = self._inbox, []
            for entry in waiting:
                self._end(entry, error)
            return
        try:
            with torch.inference_mode():
                self.runner.step()  # only cancelled requests: the plan drops them and runs nothing
        except Exception:  # nothing is left to tell
            pass

    def _end(self, entry, error: BaseException | None) -> None:
        job, request, ticket, usage, start, loop = entry
        if error is not None:
            job.error = error
        job.ids = None if error is not None else torch.tensor([request.sequence.generated if request.sequence else []])
        job.streamer.end()
        try:
            loop.call_soon_threadsafe(self._finish_batched, job, ticket, usage, start)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _finish_batched(self, job: Job, ticket: Ticket, usage: Usage, start: float) -> None:
        ticket._done()
        end = time.perf_counter()
        usage.prefill_seconds = (job.first_piece or end) - start
        usage.total_seconds = end - start
        if job.ids is not None:
            usage.completion_tokens = int(job.ids.shape[1])
            usage.finish_reason = "length" if usage.completion_tokens >= job.limit and not job.matcher.stopped else "stop"
        self.metrics.finished(usage, job.first_piece, end, cancelled=job.cancel_flag.is_set() and not job.matcher.stopped)
        job.finished.set()

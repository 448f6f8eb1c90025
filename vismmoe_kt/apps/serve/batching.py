"""The server engine's batching thread: the one thread that owns the model and its runner.

Started requests (`Entry`) go into its queue, in the order they were started (FIFO). At every step it
moves queued requests into the runner while fewer than `max_batch` run there, tells the runner of the
running ones that were cancelled (a client that left, a stop string matched), runs the runner's next
step and ends the requests that finished in it: their end is accounted on the event loop
(`call_soon_threadsafe`), so no await in a consumer's cleanup is needed for a slot to come back. (A
serial first version released its turn after `await thread.join` in a `finally`; a client that
disconnected made Starlette cancel that await too, and the turn was never released.)

A request cancelled while queued leaves the queue at once (`withdraw`, from the event loop), whatever
the runner is doing. A step that fails fails the requests it ran (500 in their streams); the runner's
next step drops them, and the server keeps serving.

Data parallel under torchrun (`serve --data_parallel`): every rank runs this thread behind a server of
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
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .runners import ServedRequest

IDLE_ROUND_S = 0.005  # data parallel, no requests: a round with the group this often (others' passes wait for it)


@dataclass(eq=False)
class Entry:
    """A started request: its job and place on the event loop's side, what the runner runs."""
    job: Any
    request: ServedRequest
    ticket: Any
    usage: Any
    loop: asyncio.AbstractEventLoop
    started: float = 0.0  # perf_counter when it went into the runner (its prefill starts)
    error: BaseException | None = None


class BatchingThread:
    """Owns `runner`; `put` an Entry to run it. `ran(entry)` and `ended(entry)` are called on the entry's
    event loop when it goes into the runner and when it ended (`entry.error`: why it failed)."""

    def __init__(self, runner: Any, max_batch: int, ran: Callable[[Entry], None], ended: Callable[[Entry], None],
                 lockstep: Any = None, observe: Callable[[int], None] | None = None):
        self.runner, self.max_batch, self.lockstep = runner, max_batch, lockstep
        self._ran, self._ended, self._observe = ran, ended, observe
        self._queue: deque[Entry] = deque()   # started, not yet in the runner (guarded by _wake)
        self._active: dict[ServedRequest, Entry] = {}  # in the runner (this thread's alone)
        self._wake = threading.Condition()
        self._leaving = False
        self._thread = threading.Thread(target=self._loop, name="vismmoe-batch", daemon=True)
        self._thread.start()

    def put(self, entry: Entry) -> None:
        with self._wake:
            self._queue.append(entry)
            self._wake.notify()

    def withdraw(self, entry: Entry) -> None:
        """A queued request whose client left or was answered: it leaves the queue now and ends, never run.
        A no-op once it is in the runner (the next step cancels it there)."""
        with self._wake:
            try:
                self._queue.remove(entry)
            except ValueError:
                return
        self._end(entry, None)

    # -- the thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        from ...parallel.lockstep import GroupStopped

        try:
            self._serve_steps()
        except GroupStopped as exc:  # a rank stopped, so does this one: its requests end, its server stops
            self._fail_all(exc, step=False)
            if not self._leaving:
                os.kill(os.getpid(), signal.SIGINT)  # uvicorn's own shutdown

    def _serve_steps(self) -> None:
        from ...parallel.lockstep import GroupStopped

        while True:
            with self._wake:
                while not self._queue and self.runner.idle:
                    if self.lockstep is None:
                        self._wake.wait()
                        continue
                    self._wake.wait(timeout=IDLE_ROUND_S)  # then one round with the group: serve its passes
                    if not self._queue:
                        break
                arrived = []
                while self._queue and len(self._active) + len(arrived) < self.max_batch:
                    arrived.append(self._queue.popleft())
            if self.lockstep is not None and not arrived and self.runner.idle:
                self.lockstep.tick()
                continue
            for entry in arrived:
                try:
                    self.runner.add(entry.request)
                except Exception as exc:  # cannot happen after the engine's checks; reported, not lost
                    self._end(entry, exc)
                    continue
                entry.started = time.perf_counter()
                self._active[entry.request] = entry
                self._call(entry, self._ran)
            for entry in self._active.values():
                if entry.job.cancel_flag.is_set():
                    self.runner.cancel(entry.request)
            try:
                with torch.inference_mode():
                    size, ended = self.runner.step()
            except GroupStopped:
                raise
            except Exception as exc:  # the step's requests fail; the server goes on
                self._fail_all(exc)
                continue
            if size and self._observe is not None:
                self._observe(size)
            for request in ended:
                self._end(self._active.pop(request), None)

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
        next step drops them all (their slots come back). `step`: run that step (not once the group
        stopped: it would need a round)."""
        for entry in self._active.values():
            self.runner.cancel(entry.request)
            self._end(entry, error)
        self._active.clear()
        if not step:  # the group stopped: nothing more runs here, so the queued requests end too
            with self._wake:
                waiting, self._queue = list(self._queue), deque()
            for entry in waiting:
                self._end(entry, error)
            return
        try:
            with torch.inference_mode():
                self.runner.step()  # only cancelled requests: the runner drops them and runs nothing
        except Exception:  # nothing is left to tell
            pass

    def _end(self, entry: Entry, error: BaseException | None) -> None:
        entry.error = error
        self._call(entry, self._ended)

    @staticmethod
    def _call(entry: Entry, callback: Callable[[Entry], None]) -> None:
        try:
            entry.loop.call_soon_threadsafe(callback, entry)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

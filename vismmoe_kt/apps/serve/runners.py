"""What the server's engine steps: a ModelRunner (engine/runner.py), or for a model without our
decode path a SerialRunner with the same interface, chosen once at start-up (`make_runner`).

The interface the engine's batching thread uses: `add(request)` (a ServedRequest; sets
`request.sequence`, whose `generated` lists the sampled ids), `step() -> (decode batch size, ended
requests)`, `cancel(request)` (the request ends at the next step), `idle`, `stats()`. Every call comes
from that one thread. Tests hand the engine a scripted runner of this interface instead.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ...engine.runner import PREFILL_BUDGET, BatchRequest, ModelRunner
from ...engine.generation import generate


@dataclass(eq=False)
class ServedRequest(BatchRequest):
    """A BatchRequest with its client's cancel state, which the event loop sets at any moment (a client
    that left, a stop string matched): the SerialRunner reads it inside its generation, where the
    batching thread cannot call `cancel` (it waits in `step`)."""
    cancel_flag: threading.Event = field(default_factory=threading.Event)


class Run:
    """A SerialRunner request's state: the ids it generated (as a ModelRunner's Sequence has them)."""

    def __init__(self) -> None:
        self.generated: list[int] = []


class _Cancelled(StoppingCriteria):
    def __init__(self, flag: threading.Event):
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


class _TokenBridge:
    """The streamer `generate` feeds: the prompt first (skipped), then each new token, handed on to the
    request's `on_token` as the ModelRunner hands on its sampled ids."""

    def __init__(self, request: ServedRequest):
        self.request, self.prompt_seen = request, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.request.sequence.generated.append(int(token))
            if self.request.on_token is not None:
                self.request.on_token(int(token))

    def end(self) -> None:
        pass


class SerialRunner:
    """One request per `step()`, run whole through `engine.generation.generate` (transformers' loop for a
    model without our decode path), in the order added. Its generation stops within a token once the
    request's cancel flag is set. The decode batch size it reports is 0: no batched step ran."""

    max_batch = 1

    def __init__(self, model: Any):
        self.model = model
        self.queue: deque[ServedRequest] = deque()
        self.generations = 0

    @property
    def idle(self) -> bool:
        return not self.queue

    def stats(self) -> dict[str, Any]:
        return {"generations": self.generations}

    def add(self, request: ServedRequest) -> Run:
        request.sequence = Run()
        self.queue.append(request)
        return request.sequence

    def cancel(self, request: ServedRequest) -> None:
        request.cancel_flag.set()

    def step(self) -> tuple[int, list[ServedRequest]]:
        if not self.queue:
            return 0, []
        request = self.queue.popleft()  # gone from the queue whatever happens: a failure is not retried
        if request.cancel_flag.is_set():
            return 0, [request]
        sampling = request.sampling
        chosen = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p} \
            if sampling.do_sample else {"do_sample": False}
        self.generations += 1
        ids = generate(self.model, request.inputs, request.max_new_tokens, streamer=_TokenBridge(request),
                       stopping_criteria=StoppingCriteriaList([_Cancelled(request.cancel_flag)]),
                       min_new_tokens=request.min_new_tokens, **chosen)
        request.sequence.generated = ids[0, request.inputs["input_ids"].shape[1]:].tolist()
        return 0, [request]


def make_runner(model: Any, max_batch: int, slot_tokens: int, prefill_chunk: int | None = None,
                prefill_budget: int = PREFILL_BUDGET, batched_only: str | None = None) -> tuple[Any, int | None]:
    """(the runner for this model, the tokens a request may hold: None for the model's context).

    A ModelRunner of `max_batch` slots of `slot_tokens` where the model has our lean decode path; a
    SerialRunner otherwise, which serves one request at a time: asking it for more (`max_batch` > 1),
    or for what only the batched runner does (`batched_only` names it), is a ValueError saying why."""
    try:
        # the engine hands it at most max_batch requests: its own queue never holds more than that
        runner = ModelRunner(model, max_batch, slot_tokens, max_queue=max_batch, prefill_chunk=prefill_chunk,
                             prefill_budget=prefill_budget)
        return runner, slot_tokens
    except ValueError as exc:  # no lean decode engine (decode: hf, or stock modules)
        if max_batch > 1 or batched_only:
            raise ValueError(f"{exc}; without it the server runs transformers' generation loop, one request at a "
                             f"time (--max_batch 1){f', without {batched_only}' if batched_only else ''}") from None
        return SerialRunner(model), None

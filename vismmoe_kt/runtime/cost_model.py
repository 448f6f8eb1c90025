"""When a needed expert is missing from the GPU: fetch it and wait, or compute its tokens on the CPU?

VisMMOE's hybrid mode sends some of a layer's missing experts to the CPU. The copies of the others
and the CPU's work run at the same time (one on the PCIe link, one on the host's cores), beside the
GPU's hits, so the layer waits for the slower of the two. `split` therefore chooses the CPU set that
minimises max(copy time of the fetched experts, CPU time of the rest), taking the experts with the
fewest tokens to the CPU first, and fetching on a tie (a fetched expert stays cached for the next
tokens). Comparing one copy with one CPU call, as this model once did, never chose the CPU: a copy on
an idle link (0.2 ms) always beat a CPU call (1 ms), although four misses need 0.8 ms of copies.

Rates: one expert block's copy, and the CPU backend's fixed cost per expert plus a cost per token,
measured at start-up on this machine (`calibrate`), then followed online (`observe_copy`,
`observe_cpu`: moving averages of what the layers measured), or given in the rule (`cost_model:`)
to pin the decision, e.g. in tests. A layer that sends anything to the CPU also pays once for the
call itself (`cpu_seconds_call`): in a CUDA decode step, two host functions and the copies of the
token, its routing and the output (on an H200 host, 0.2 ms per layer in the compute stream: 9.4 ms
added to a 48-layer step with no CPU pair at all; one BF16 expert crosses the link in 0.17 ms), so a
layer with one or two misses keeps them on the GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CostModel:
    fetch_seconds: float          # one expert block, host -> GPU
    cpu_seconds_fixed: float      # one expert on the CPU backend, per call
    cpu_seconds_per_token: float  # ... and per token routed to it
    cpu_seconds_call: float = 0.0  # once per layer that calls the CPU at all

    def cpu_seconds(self, tokens: int) -> float:
        return self.cpu_seconds_fixed + tokens * self.cpu_seconds_per_token

    def split(self, tokens_of: dict[int, int]) -> set[int]:
        """The missing experts (expert -> its tokens in this layer) to compute on the CPU."""
        order = sorted(tokens_of, key=lambda e: (tokens_of[e], e))  # cheapest on the CPU first
        best_time, best_k, cpu = self.fetch_seconds * len(order), 0, self.cpu_seconds_call
        for k, expert in enumerate(order, 1):
            cpu += self.cpu_seconds(tokens_of[expert])
            time_k = max(self.fetch_seconds * (len(order) - k), cpu)
            if time_k < best_time:  # strictly: a tie keeps the fetch
                best_time, best_k = time_k, k
        return set(order[:best_k])

    def layer_seconds(self, tokens_of: dict[int, int], on_cpu: set[int]) -> float:
        """How long a layer waits for its misses under a split (the link and the CPU overlap)."""
        fetched = sum(1 for e in tokens_of if e not in on_cpu)
        cpu = self.cpu_seconds_call + sum(self.cpu_seconds(tokens_of[e]) for e in on_cpu) if on_cpu else 0.0
        return max(self.fetch_seconds * fetched, cpu)

    @classmethod
    def from_kwargs(cls, values: dict) -> "CostModel":
        try:
            return cls(float(values["fetch_seconds"]), float(values["cpu_seconds_fixed"]),
                       float(values["cpu_seconds_per_token"]), float(values.get("cpu_seconds_call", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError("cost_model needs numbers fetch_seconds, cpu_seconds_fixed, cpu_seconds_per_token "
                             "(and optionally cpu_seconds_call)") from None


TRACK = 0.1  # weight of each new observation in the online averages


class CostTracker:
    """The cost model in use: the start-up one, moved by what the layers measure as they run."""

    def __init__(self, model: CostModel, pinned: bool = False):
        self.model, self.pinned = model, pinned  # pinned: the rule's numbers, never moved

    def observe_copy(self, seconds_per_expert: float) -> None:
        if not self.pinned and seconds_per_expert > 0:
            m = self.model
            self.model = CostModel((1 - TRACK) * m.fetch_seconds + TRACK * seconds_per_expert, m.cpu_seconds_fixed,
                                   m.cpu_seconds_per_token, m.cpu_seconds_call)

    def observe_cpu(self, experts: int, tokens: int, seconds: float) -> None:
        """A CPU call of `experts` experts and `tokens` token-expert pairs took `seconds`: the model's
        prediction for it is scaled towards that (both cost terms by the same factor)."""
        m = self.model
        predicted = experts * m.cpu_seconds_fixed + tokens * m.cpu_seconds_per_token
        if self.pinned or experts <= 0 or predicted <= 0 or seconds <= 0:
            return
        scale = (1 - TRACK) + TRACK * seconds / predicted
        self.model = CostModel(m.fetch_seconds, m.cpu_seconds_fixed * scale, m.cpu_seconds_per_token * scale,
                               m.cpu_seconds_call)


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(store, layer: int, backend, device: torch.device, top_k: int) -> CostModel:
    """Time one block copy and the CPU backend on one expert with 1 and 16 tokens, on this machine;
    with a backend whose calls go in a CUDA stream, also such a call with no expert (what a decode
    step's layer pays for calling the CPU at all)."""
    block = store.block(layer, 0)
    target = torch.empty_like(block, device=device)

    def copy() -> None:
        target.copy_(block, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    copy()
    fetch = _median_seconds(copy)

    def cpu(tokens: int) -> float:
        hidden = torch.randn(tokens, store.hidden, dtype=store.dtype)
        ids = torch.full((tokens, top_k), -1, dtype=torch.int64)
        ids[:, 0] = 0
        weights = torch.ones(tokens, top_k)
        backend.submit(layer, hidden, ids, weights).wait()  # warm
        return _median_seconds(lambda: backend.submit(layer, hidden, ids, weights).wait())

    one, many = cpu(1), cpu(16)
    per_token = max((many - one) / 15, 0.0)
    call = 0.0
    if device.type == "cuda" and getattr(backend, "streams", False):
        hidden = torch.randn(1, store.hidden, dtype=store.dtype, device=device)
        ids = torch.full((1, top_k), -1, dtype=torch.int64, device=device)
        weights = torch.ones(1, top_k, device=device)

        def empty_call() -> None:
            backend.begin_on_stream(layer, hidden, ids, weights)
            backend.end_on_stream(device, hidden.dtype)
            torch.cuda.synchronize(device)

        empty_call()
        call = _median_seconds(empty_call)
    return CostModel(fetch, max(one - per_token, 0.0), per_token, call)

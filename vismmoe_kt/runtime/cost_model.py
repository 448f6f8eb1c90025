"""When a needed expert is missing from the GPU: fetch it and wait, or compute its tokens on the CPU?

VisMMOE's hybrid mode sends a missing expert's activations to the CPU when that is cheaper than the
copy. The cost model compares, per expert, the time to copy one expert block to the GPU with the
CPU backend's time for that expert's tokens (a fixed cost per call plus a cost per token). It is
measured once at start-up on this machine (`calibrate`), or given in the rule (`cost_model:`) to
pin the decision, e.g. in tests.
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

    def prefers_cpu(self, tokens: int) -> bool:
        return self.cpu_seconds_fixed + tokens * self.cpu_seconds_per_token < self.fetch_seconds

    @classmethod
    def from_kwargs(cls, values: dict) -> "CostModel":
        try:
            return cls(float(values["fetch_seconds"]), float(values["cpu_seconds_fixed"]),
                       float(values["cpu_seconds_per_token"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError("cost_model needs numbers fetch_seconds, cpu_seconds_fixed, cpu_seconds_per_token") from None


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(store, layer: int, backend, device: torch.device, top_k: int) -> CostModel:
    """Time one block copy and the CPU backend on one expert with 1 and 16 tokens, on this machine."""
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
    return CostModel(fetch, max(one - per_token, 0.0), per_token)

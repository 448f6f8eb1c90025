"""EPLB-style baseline: history-based expert replication and placement (DeepSeek's EPLB, greedy).

Glossary: a *logical* expert is one of the layer's E experts; a *physical* expert is a copy of one
placed on a rank (E + `redundant` physical experts, the same number per rank); *redundant* experts
are the extra copies, given to the most loaded logical experts.

Every `period` steps the placement is recomputed from the loads of the last `window` steps:
  1. replicate: repeatedly give one more copy to the logical expert with the highest load per copy;
  2. pack: place copies heaviest first, each on the rank with the least load that has a free slot.
A step's tokens of an expert are split evenly over its copies. Unlike ReaLB this only reacts to past
loads (the placement lags a changing batch) and moves weights when it changes; it never changes
precision. Pure tensor functions, apart from the small state of `EPLBPlacement`.
"""

from __future__ import annotations

from collections import deque

import torch


def replicate(load: torch.Tensor, physical: int) -> torch.Tensor:
    """Copies per logical expert (>= 1 each, `physical` in all), greedy on load per copy."""
    if physical < load.numel():
        raise ValueError(f"{physical} physical experts cannot hold {load.numel()} logical ones")
    copies = torch.ones(load.numel(), dtype=torch.long, device=load.device)
    for _ in range(physical - load.numel()):
        copies[torch.argmax(load.double() / copies)] += 1
    return copies


def pack(load: torch.Tensor, copies: torch.Tensor, num_ranks: int) -> list[tuple[int, int]]:
    """(logical expert, rank) for every copy; ranks get equal slot counts, loads as even as greedy gets."""
    total = int(copies.sum())
    if total % num_ranks:
        raise ValueError(f"{total} physical experts do not split evenly over {num_ranks} ranks")
    slots = [total // num_ranks] * num_ranks
    rank_load = [0.0] * num_ranks
    replicas = sorted(((float(load[e]) / int(copies[e]), e) for e in range(load.numel()) for _ in range(int(copies[e]))),
                      reverse=True)
    placement = []
    for share, expert in replicas:
        rank = min((r for r in range(num_ranks) if slots[r] > 0), key=lambda r: rank_load[r])
        slots[rank] -= 1
        rank_load[rank] += share
        placement.append((expert, rank))
    return placement


def rank_loads(load: torch.Tensor, placement: list[tuple[int, int]], copies: torch.Tensor, num_ranks: int) -> torch.Tensor:
    out = torch.zeros(num_ranks, dtype=torch.float64)
    for expert, rank in placement:
        out[rank] += float(load[expert]) / int(copies[expert])
    return out


class EPLBPlacement:
    def __init__(self, num_experts: int, num_ranks: int, redundant: int, window: int = 16, period: int = 8):
        if (num_experts + redundant) % num_ranks:
            raise ValueError(f"experts + redundant ({num_experts} + {redundant}) must split evenly over {num_ranks} ranks")
        self.num_experts, self.num_ranks, self.redundant = num_experts, num_ranks, redundant
        self.history: deque[torch.Tensor] = deque(maxlen=window)
        self.period, self.steps, self.rebalances = period, 0, 0
        self._place(torch.ones(num_experts, device="cpu"))

    def _place(self, load: torch.Tensor) -> None:
        self.copies = replicate(load, self.num_experts + self.redundant)
        self.placement = pack(load, self.copies, self.num_ranks)

    def observe(self, load: torch.Tensor) -> torch.Tensor:
        """Rank loads of this step under the current placement; then record it and rebalance when due."""
        loads = rank_loads(load, self.placement, self.copies, self.num_ranks)
        self.history.append(load.double())
        self.steps += 1
        if self.steps % self.period == 0:
            self._place(torch.stack(list(self.history)).mean(dim=0))
            self.rebalances += 1
        return loads

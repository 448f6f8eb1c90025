"""The per-step precision plan of ReaLB (docs/design.md "ReaLB": the paper's 4.2 lost its equations).

Inputs come from the current routing only, and are per-expert so that an all-gather of per-rank
statistics can supply them under expert parallelism:
    expert_load[E]    token-expert pairs routed to each expert this step
    expert_vision[E]  how many of those pairs come from image tokens
    expert_rank[E]    which rank holds each expert
Estimated rank time = sum of its experts' pairs, a switched expert's low-precision pairs counting
`lowprec_cost` (< 1) each. Policy:
  0. LB gate: below `gate_tokens` tokens in the step, nothing switches;
  1. overloaded ranks: estimated time > (1 + eps) * mean;
  2. of those, vision-dominant ranks: vision fraction >= M_d;
  3. on each, switch the vision-heaviest experts greedily until the rank's time falls to the target
     (the mean, or the next-highest rank's time if that is higher).
With `scope="vision_tokens"` only a switched expert's image-token rows go low precision (text rows
stay BF16); with `scope="expert"` the whole expert does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrecisionPlan:
    lowprec: torch.Tensor        # bool (E,): expert switched
    rank_time_before: torch.Tensor
    rank_time_after: torch.Tensor
    gated: bool                  # True: below the LB gate, nothing considered

    def imbalance(self, after: bool = True) -> float:
        t = self.rank_time_after if after else self.rank_time_before
        return float(t.max() / t.mean()) if t.mean() > 0 else 1.0

    def lowprec_share(self, expert_load: torch.Tensor) -> float:
        total = expert_load.sum()
        return float(expert_load[self.lowprec].sum() / total) if total > 0 else 0.0


def rank_totals(values: torch.Tensor, expert_rank: torch.Tensor, num_ranks: int) -> torch.Tensor:
    return torch.zeros(num_ranks, dtype=torch.float64).index_add_(0, expert_rank, values.double())


def plan_precision(expert_load: torch.Tensor, expert_vision: torch.Tensor, expert_rank: torch.Tensor, num_ranks: int,
                   tokens: int, gate_tokens: int = 2048, eps: float = 0.05, vision_threshold: float = 0.9,
                   lowprec_cost: float = 0.5, scope: str = "vision_tokens") -> PrecisionPlan:
    if scope not in ("vision_tokens", "expert"):
        raise ValueError(f"fp4_scope {scope!r} is not one of: vision_tokens, expert")
    load, vision = expert_load.double(), expert_vision.double()
    switched = torch.zeros(load.shape[0], dtype=torch.bool)
    before = rank_totals(load, expert_rank, num_ranks)
    if tokens < gate_tokens:
        return PrecisionPlan(switched, before, before.clone(), gated=True)
    saving = (vision if scope == "vision_tokens" else load) * (1 - lowprec_cost)  # time saved by switching
    times = before.clone()
    mean = float(before.mean())
    fraction = rank_totals(vision, expert_rank, num_ranks) / before.clamp(min=1)
    for rank in torch.argsort(before, descending=True).tolist():
        if times[rank] <= (1 + eps) * mean or fraction[rank] < vision_threshold:
            continue
        others = torch.cat([times[:rank], times[rank + 1:]])
        target = max(mean, float(others.max()) if len(others) else mean)
        for expert in torch.argsort(vision, descending=True).tolist():
            if times[rank] <= target:
                break
            if expert_rank[expert] != rank or vision[expert] <= 0 or switched[expert]:
                continue
            switched[expert] = True
            times[rank] -= saving[expert]
    return PrecisionPlan(switched, before, times, gated=False)

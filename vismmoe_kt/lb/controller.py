"""RealbController: one layer's precision decision per step, shared by the single-process operator
(virtual ranks) and the expert-parallel one (real ranks, fed by the group's summed loads).

Modes: bf16 (never switch), all (FP4-All: every expert), realb / realb-seq (the policy with M_d under
AIMD control; on real ranks realb-seq exchanges the routing metadata before the token dispatch
instead of beside it: parallel/expert_parallel.py), fixed (the policy with a fixed M_d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aimd import AIMDController
from .policy import PrecisionPlan, plan_precision

MODES = ("bf16", "all", "realb", "realb-seq", "fixed")


@dataclass
class RealbController:
    mode: str = "realb"
    fixed_threshold: float = 0.7
    gate_tokens: int = 2048
    eps: float = 0.05
    lowprec_cost: float = 0.5
    scope: str = "vision_tokens"
    md_start: float = 0.9
    md_min: float = 0.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of: {', '.join(MODES)}")
        if self.scope not in ("vision_tokens", "expert"):
            raise ValueError(f"fp4_scope {self.scope!r} is not one of: vision_tokens, expert")
        self.aimd = AIMDController(threshold=float(self.md_start), minimum=float(self.md_min))

    def decide(self, load: torch.Tensor, vision: torch.Tensor, expert_rank: torch.Tensor, ranks: int,
               tokens: int) -> tuple[torch.Tensor, PrecisionPlan | None]:
        """(switched experts (E,) bool, the plan when the policy ran)."""
        if self.mode == "bf16":
            return torch.zeros(load.numel(), dtype=torch.bool), None
        if self.mode == "all":
            return torch.ones(load.numel(), dtype=torch.bool), None
        threshold = self.fixed_threshold if self.mode == "fixed" else self.aimd.threshold
        plan = plan_precision(load, vision, expert_rank, ranks, tokens, self.gate_tokens, self.eps, threshold,
                              self.lowprec_cost, self.scope)
        if self.mode in ("realb", "realb-seq") and not plan.gated:
            self.aimd.update(plan.imbalance(), plan.lowprec_share(load))
        return plan.lowprec, plan


@dataclass
class RealbStats:
    """An operator's ReaLB counters, summed over its calls (and, by collect_stats, over layers)."""
    calls: int = 0
    gated_calls: int = 0
    pairs: int = 0
    lowprec_pairs: int = 0
    switched_experts: int = 0
    imbalance_before: float = 0.0  # summed over ungated calls; divide by calls - gated_calls
    imbalance_after: float = 0.0

    def observe_plan(self, plan: PrecisionPlan | None) -> None:
        """The LB gate's verdict and, when the policy ran, the ranks' imbalance before and after it."""
        if plan is not None and plan.gated:
            self.gated_calls += 1
        elif plan is not None:
            self.imbalance_before += plan.imbalance(after=False)
            self.imbalance_after += plan.imbalance()

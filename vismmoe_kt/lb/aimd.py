"""AIMD control of M_d, the vision-fraction threshold of ReaLB's policy (docs/design.md "ReaLB").

While the measured imbalance (max/mean rank time) stays above its target and the low-precision
share is within budget, M_d drops by `step` (additive: more ranks qualify, more experts switch).
When balanced, or when the low-precision share exceeds its budget, M_d moves back toward 1
multiplicatively: the gap to 1 shrinks by `backoff` (fast retreat, as in TCP's AIMD).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AIMDController:
    threshold: float = 0.9          # M_d
    minimum: float = 0.0            # M_min
    step: float = 0.05              # additive decrease
    backoff: float = 0.5            # multiplicative: gap to 1 is multiplied by this
    target_imbalance: float = 1.05  # max/mean rank time considered balanced
    lowprec_budget: float = 0.5     # largest acceptable share of pairs in low precision

    def __post_init__(self):
        if not 0 <= self.minimum <= self.threshold <= 1:
            raise ValueError(f"need 0 <= M_min <= M_d <= 1, got M_min={self.minimum}, M_d={self.threshold}")
        if not 0 < self.backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {self.backoff}")

    def update(self, imbalance: float, lowprec_share: float) -> float:
        if imbalance > self.target_imbalance and lowprec_share <= self.lowprec_budget:
            self.threshold = max(self.minimum, self.threshold - self.step)
        else:
            self.threshold = min(1.0, 1.0 - (1.0 - self.threshold) * self.backoff)
        return self.threshold

"""QuotaTrial: keep the hybrid mode's CPU share in table decode only where it measurably pays.

The cost model (cost_model.py) predicts a layer's wait from rates measured outside the decode step;
inside a captured step the CPU's calls also cost host functions, small copies and the workers'
wake-up, and they share the host's memory bandwidth with the GPU's reads of the misses. On an H200
host (PCIe 5 at about 55 GB/s beside about 70 GB/s of host memory) the model's split made steps
slower than sending no miss to the CPU. So the boundary asks this trial once per decode step: a
StepTrial (step_trial.py) of runs with the cost model's quota against runs with none (both are
captured graphs: `OffloadRuntime.graph_variant`), whose faster arm is kept for `hold` steps, then
tried again. A tie sends no miss to the CPU.

A rule's pinned `cost_model` skips the trial (its numbers decide), and so does a quota with nothing
for the CPU (both arms would be the same step).
"""

from __future__ import annotations

import time
from typing import Callable

from .step_trial import SAMPLES, StepTrial

WITH_CPU, WITHOUT_CPU = 0, 1
HOLD = 512     # steps the winner is kept before the next trial


class QuotaTrial(StepTrial):
    def __init__(self, samples: int = SAMPLES, hold: int = HOLD, clock: Callable[[], float] = time.perf_counter):
        super().__init__(WITHOUT_CPU, samples, hold, clock)

    def choose(self, quota: list[int]) -> list[int]:
        """The quota for the step about to run, given the cost model's (called once per step)."""
        if not any(quota):  # nothing to try: both arms are the same step
            self.skip()
            return quota
        return list(quota) if self.arm() == WITH_CPU else [0] * len(quota)

    def describe(self) -> str | None:
        """The last decision, for reports: which arm was kept and the two medians."""
        if not self.decisions:
            return None
        with_cpu, without, arm = self.decisions[-1]
        kept = "kept the CPU's share" if arm == WITH_CPU else "sent no miss to the CPU"
        return (f"{kept}: {1e3 * with_cpu:.2f} ms per step with it, {1e3 * without:.2f} without "
                f"({len(self.decisions)} trial(s))")

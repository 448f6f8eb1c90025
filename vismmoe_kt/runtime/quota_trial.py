"""QuotaTrial: keep the hybrid mode's CPU share in table decode only where it measurably pays.

The cost model (cost_model.py) predicts a layer's wait from rates measured outside the decode step;
inside a captured step the CPU's calls also cost host functions, small copies and the workers'
wake-up, and they share the host's memory bandwidth with the GPU's reads of the misses. On an H200
host (PCIe 5 at about 55 GB/s beside about 70 GB/s of host memory) the model's split made steps
slower than sending no miss to the CPU. So the boundary asks this trial once per decode step: it
alternates runs of RUN steps with the cost model's quota and runs with none (both are captured
graphs: `OffloadRuntime.graph_variant`), times each step to the next one's start (every token is
read back on the host, so a step has finished by then), and after `samples` timed steps of each
keeps the arm with the lower median for `hold` steps, then tries again (the routing and the cache
move). The first step of a run is not timed: a step without the CPU lands its misses in the cache,
which the next step would otherwise enjoy whatever its arm (and a first step may capture its graph).

A rule's pinned `cost_model` skips the trial (its numbers decide), and so does a quota with nothing
for the CPU (both arms would be the same step).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

WITH_CPU, WITHOUT_CPU = 0, 1
SAMPLES = 8    # timed steps per arm in a trial
RUN = 2        # steps per run of one arm; the first of each is not timed
HOLD = 512     # steps the winner is kept before the next trial


class QuotaTrial:
    def __init__(self, samples: int = SAMPLES, hold: int = HOLD, clock: Callable[[], float] = time.perf_counter):
        if samples < 1 or hold < 1:
            raise ValueError(f"a quota trial needs samples >= 1 and hold >= 1, got {samples} and {hold}")
        self.samples, self.hold, self.clock = samples, hold, clock
        self.times: tuple[list[float], list[float]] = ([], [])
        self.last: tuple[float, int, bool] | None = None  # (when the previous step started, its arm, timed)
        self.run = 0                                # steps of the current run so far
        self.choice: int | None = None              # the arm held, None while trying
        self.held = 0
        self.decisions: list[tuple[float, float, int]] = []  # (median with, median without, arm kept)

    def interrupt(self) -> None:
        """Decode stopped (a prefill, an eager step, a reset): the time to the next step is not a step's."""
        self.last = None

    def choose(self, quota: list[int]) -> list[int]:
        """The quota for the step about to run, given the cost model's (called once per step)."""
        now = self.clock()
        if self.last is not None and self.choice is None:
            started, arm, timed = self.last
            if timed:
                self.times[arm].append(now - started)
        if not any(quota):  # nothing to try: both arms are the same step
            self.last, self.run = None, 0
            return quota
        if self.choice is None and min(len(t) for t in self.times) >= self.samples:
            with_cpu, without = (statistics.median(t) for t in self.times)
            self.choice = WITH_CPU if with_cpu < without else WITHOUT_CPU  # a tie: no CPU calls
            self.decisions.append((with_cpu, without, self.choice))
            self.times, self.held = ([], []), 0
        if self.choice is not None:
            self.held += 1
            if self.held > self.hold:  # try again: the routing and the cache have moved
                self.choice = None
        if self.choice is None:
            previous = self.last[1] if self.last is not None else None
            if previous is not None and 0 < self.run < RUN:  # the run goes on
                arm, self.run = previous, self.run + 1
            else:  # a new run, of the arm with fewer timings
                arm = WITH_CPU if len(self.times[WITH_CPU]) <= len(self.times[WITHOUT_CPU]) else WITHOUT_CPU
                self.run = 1
            self.last = (now, arm, self.run > 1)
        else:
            arm, self.last, self.run = self.choice, None, 0
        return list(quota) if arm == WITH_CPU else [0] * len(quota)

    def describe(self) -> str | None:
        """The last decision, for reports: which arm was kept and the two medians."""
        if not self.decisions:
            return None
        with_cpu, without, arm = self.decisions[-1]
        kept = "kept the CPU's share" if arm == WITH_CPU else "sent no miss to the CPU"
        return (f"{kept}: {1e3 * with_cpu:.2f} ms per step with it, {1e3 * without:.2f} without "
                f"({len(self.decisions)} trial(s))")

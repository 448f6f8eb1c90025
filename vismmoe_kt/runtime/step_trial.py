"""StepTrial: of two ways to run a decode step, keep the one whose steps measure faster.

The trial behind QuotaTrial (the hybrid's CPU share), EvictionTrial (VisMMOE's ranking against
recency) and ReservationsTrial (landing slabs reserved before each step or a step ahead). Called once
at the start of every decode step, it alternates runs of `run` steps (RUN) of each arm, times a run's
last step to the next step's start (start to start: in a steady run that is a step's throughput,
whichever of the device and the host's work between steps paces it), and after `samples` timed steps
of each keeps the arm with the lower median: for `hold` steps, then it tries again (the routing and the
cache move), or for good (`hold=None`). A run's earlier steps are not timed: the first inherits the
cache the other arm left (a step without the CPU lands its misses, an eviction order fills the cache
its own way), which would credit or charge the wrong arm, and it may capture a graph; where changing
arms drains the queue of steps launched ahead, the second refills it (ReservationsTrial: runs of 3). A
tie keeps `simpler`, the arm with less machinery: medians within `tie` (a share of the slower) of each
other. The clock is injected, so tests feed the steps' times.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

SAMPLES = 8  # timed steps per arm in a trial
RUN = 2      # steps per run of one arm; only the last of each is timed


class StepTrial:
    def __init__(self, simpler: int, samples: int = SAMPLES, hold: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, tie: float = 0.0, run: int = RUN):
        if samples < 1 or (hold is not None and hold < 1) or run < 2:
            raise ValueError(f"a step trial needs samples >= 1, hold >= 1 (or None) and runs of 2 steps or more, "
                             f"got {samples}, {hold} and {run}")
        if simpler not in (0, 1):
            raise ValueError(f"a step trial has arms 0 and 1, not {simpler}")
        self.simpler, self.samples, self.hold, self.clock, self.tie = simpler, samples, hold, clock, tie
        self.run_length = run
        self.times: tuple[list[float], list[float]] = ([], [])
        self.last: tuple[float, int, bool] | None = None  # (when the previous step started, its arm, timed)
        self.run = 0                                # steps of the current run so far
        self.choice: int | None = None              # the arm held, None while trying
        self.held = 0
        self.decisions: list[tuple[float, float, int]] = []  # (median of arm 0, median of arm 1, arm kept)

    @property
    def settled(self) -> bool:
        """The choice is final (`hold=None`): the trial will never time a step again."""
        return self.choice is not None and self.hold is None

    @property
    def timed(self) -> int:
        """Steps timed so far in the trial under way (both arms)."""
        return sum(len(t) for t in self.times)

    def outcome(self) -> tuple[float, float, int, str] | None:
        """The last decision (None before the first): both arms' medians, the arm kept, and why in words."""
        if not self.decisions:
            return None
        first, second, kept = self.decisions[-1]
        tied = abs(first - second) <= self.tie * max(first, second)
        return first, second, kept, f"within {self.tie:.0%}: a tie keeps the simpler" if tied else "faster"

    def interrupt(self) -> None:
        """Decode stopped (a prefill, an eager step, a reset): the time to the next step is not a step's."""
        self.last = None

    def skip(self) -> None:
        """This step offers nothing to try (both arms would be the same step): time the last one, not this."""
        self._time_last(self.clock())
        self.last, self.run = None, 0

    def arm(self) -> int:
        """The arm for the step about to run (called once per step, at its start)."""
        if self.settled:
            return self.choice
        now = self.clock()
        self._time_last(now)
        if self.choice is None and min(len(t) for t in self.times) >= self.samples:
            first, second = (statistics.median(t) for t in self.times)
            if abs(first - second) <= self.tie * max(first, second):
                faster = self.simpler
            else:
                faster = 0 if first < second else 1
            self.choice = faster
            self.decisions.append((first, second, faster))
            self.times, self.held = ([], []), 0
        if self.choice is not None and self.hold is not None:
            self.held += 1
            if self.held > self.hold:  # try again: the routing and the cache have moved
                self.choice = None
        if self.choice is not None:
            self.last, self.run = None, 0
            return self.choice
        previous = self.last[1] if self.last is not None else None
        if previous is not None and 0 < self.run < self.run_length:  # the run goes on
            arm, self.run = previous, self.run + 1
        else:  # a new run, of the arm with fewer timings
            arm = 0 if len(self.times[0]) <= len(self.times[1]) else 1
            self.run = 1
        self.last = (now, arm, self.run == self.run_length)  # a run's last step is the one timed
        return arm

    def _time_last(self, now: float) -> None:
        if self.last is not None and self.choice is None:
            started, arm, timed = self.last
            if timed:
                self.times[arm].append(now - started)

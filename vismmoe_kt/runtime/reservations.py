"""When table decode reserves each step's landing slabs, and the choice of one for decode.

- before-step: the host waits for step t's records, accounts them and reserves step t + 1's landing slabs, then
  queues t + 1: one landing set held, the newest recency, and the device idle while the host works (about 1.4 ms
  a step on the 48 x 128 CPU proxy of Qwen3-VL-30B-A3B at 2427 slabs, `benchmarks/boundary_upkeep.py`).
- ahead: while step t runs, the host accounts t - 1 and reserves t + 1 (decode_boundary.py): t + 1 is queued
  without waiting; the price is a second landing set held (about one decode hit in a hundred on that proxy).

Which one wins depends on a miss's bytes against the host's upkeep, which only the machine can tell, so the
plan's `auto` (where ahead can run and can differ: an accelerator, offloaded experts without a slab each) is
decided by timing both: a ReservationsTrial alternates runs of steps each way (step_trial.py's mechanism) and
keeps the faster for good; a tie keeps before-step, the one with a single landing set. It runs first, and
`eviction: auto`'s trial waits for it (eviction.py): two trials alternating at once would time each other's arms,
and the ranking's host work weighs on a step only where it sits between steps (before-step), so the ranking is
timed in the way decode keeps. Changing ways mid-decode gives the landing reservations back and rebuilds the table
(the boundary's `leave`, then `_enter` resuming: the router averages and the request's state stay), which drains
the steps launched ahead: a run is three steps, the first rebuilding, the second refilling the queue, the third
timed. The way decides only when slabs are reserved, never what a layer computes: tokens are the same either way.
"""

from __future__ import annotations

import time
from typing import Callable

from .step_trial import SAMPLES, StepTrial

RESERVATIONS = ("auto", "before-step", "ahead")
BEFORE_STEP, AHEAD = 0, 1  # the trial's arms; BEFORE_STEP is the simpler
TIE = 0.01  # medians within this share of the slower keep before-step (within a step's jitter, as eviction.py's)
RUN = 3  # steps a run: the change of way's rebuild, the queue of launched steps refilled, the step timed


class FixedReservations:
    """One way for every step (the rule's, or what the plan decided)."""

    def __init__(self, ahead: bool, reason: str):
        self.ahead, self.reason = ahead, reason
        self.reservations = "ahead" if ahead else "before-step"  # the plan's value this was made for

    @property
    def settled(self) -> bool:
        """The way will not change again (what the eviction's trial waits for)."""
        return True

    def for_step(self) -> bool:
        return self.ahead

    def interrupt(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.reservations} ({self.reason})"


class ReservationsTrial:
    """`auto`: the faster way over decode's first steps, then that way for good."""

    def __init__(self, samples: int = SAMPLES, clock: Callable[[], float] = time.perf_counter):
        self.trial = StepTrial(BEFORE_STEP, samples, hold=None, clock=clock, tie=TIE, run=RUN)
        self.reservations = "auto"
        self.ahead = False  # until the trial's first step: before-step, the rule files' way

    @property
    def settled(self) -> bool:
        """The trial has kept one way for good."""
        return self.trial.settled

    def for_step(self) -> bool:
        """Whether the step about to run reserves ahead (called once per unsettled table step that is not a
        graph's self-check, at its start, before its upkeep)."""
        self.ahead = self.trial.arm() == AHEAD
        return self.ahead

    def interrupt(self) -> None:
        self.trial.interrupt()

    def describe(self) -> str:
        outcome = self.trial.outcome()
        if outcome is None:
            return f"auto: timing before-step against ahead over decode's first steps ({self.trial.timed} timed so far)"
        before, ahead, kept, why = outcome
        return (f"auto: kept {'ahead' if kept == AHEAD else 'before-step'} ({why}): {1e3 * before:.2f} ms per "
                f"decode step before-step, {1e3 * ahead:.2f} ahead (median of {self.trial.samples} timed steps each)")


def reservations_choice(reservations: str, reason: str, clock: Callable[[], float] | None = None):
    """The plan's resolved `reservations` (before-step | ahead | auto: a trial) as the boundary's per-step source."""
    if reservations == "auto":
        return ReservationsTrial(clock=clock or time.perf_counter)
    return FixedReservations(reservations == "ahead", reason)

"""Eviction rankings, the slab cache's swappable strategy, and the choice of one for decode.

A ranking orders the cache's evictable slabs (slab_cache.py holds the state and the orders):
- `RecencyRanking` ("lru"): the least recently used first, whatever its class.
- `RouterRanking` ("vismmoe", VisMMOE 3.4.2): Expired slabs first, by the router's averaged
  probability once table decode gives it (else by recency), then Speculative ones by priority.
- `CycleRanking`: the slab whose layer runs again last first; only for a long prompt's streamed layers
  (Transfers.stream_layer), whatever ranking decode runs.
The cache holds one ranking object and asks it for victims; choosing another is assigning another
(`cache.ranking = ...`), never a mode flag tested per layer.

Which one decode runs is chosen once (`eviction_choice`, from the plan's `eviction`): a fixed ranking,
or for `auto` an EvictionTrial: over the first decode steps a StepTrial (step_trial.py, the hybrid's
quota trial's mechanism) alternates runs of steps under each ranking, times them step start to step
start (the boundary's ranking work between steps included: VisMMOE's costs about 2 ms a step on
thousands of slabs), and keeps the faster for good; a tie (medians within TIE) keeps `lru`, the
simpler. Where the reservations are `auto` too, their trial runs first and this one waits for it
(reservations.py), so the ranking is timed in the way decode keeps. The ranking only decides which
experts stay cached, never what a layer computes, so tokens are the same whichever runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from .step_trial import SAMPLES, StepTrial

EVICTIONS = ("auto", "lru", "vismmoe")


class RecencyRanking:
    name = "lru"

    def victims(self, cache: Any) -> Iterator[int]:
        return cache.victims_by_recency(speculative_last=False)


class RouterRanking:
    name = "vismmoe"

    def victims(self, cache: Any) -> Iterator[int]:
        if cache.usage is not None:  # table decode's router averages (set once a step)
            return cache.victims_by_usage()
        return cache.victims_by_recency(speculative_last=True)


class CycleRanking:
    """A long prompt's streamed layers (Transfers.stream_layer): the slab whose layer runs again last goes first.
    A prompt runs the layers in a fixed cycle, one after another, and the next prompt in the same order, so
    the layer that has just run is the one needed furthest ahead: Belady's choice. By recency the cache would
    instead evict the layer the next prompt needs first, and a budget of n layers' slabs would copy every
    layer in again at every prompt; this way it keeps a fixed set and cycles the rest through the remaining
    slabs, as a static split by layer does."""
    name = "cycle"

    def victims(self, cache: Any) -> Iterator[int]:
        return cache.victims_by_cycle()


# steps whose medians differ by at most this share of the slower are a tie, which keeps lru: a smaller gap is
# within the jitter of a step's host work (and VisMMOE's ranking must pay for its machinery)
TIE = 0.01

RANKINGS: dict[str, Callable[[], Any]] = {"lru": RecencyRanking, "vismmoe": RouterRanking}
LRU, VISMMOE = 0, 1  # the trial's arms; LRU is the simpler


class FixedEviction:
    """One ranking for every step (the rule's, or `auto` decided at load)."""

    def __init__(self, name: str, reason: str):
        self.ranking, self.reason = RANKINGS[name](), reason
        self.eviction = name  # the plan's value this was made for

    @property
    def reads_usage(self) -> bool:
        """Whether a ranking may still order victims by the router's averages (else decode need not keep them)."""
        return isinstance(self.ranking, RouterRanking)

    @property
    def current(self) -> Any:
        """The ranking outside decode steps (prefill, the placement path)."""
        return self.ranking

    def for_step(self, ready: bool = True) -> Any:
        return self.ranking

    def interrupt(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.ranking.name} ({self.reason})"


class EvictionTrial:
    """`auto` in table decode: the faster ranking over the first decode steps, then that one for good."""

    def __init__(self, samples: int = SAMPLES, clock: Callable[[], float] = time.perf_counter):
        self.arms = (RecencyRanking(), RouterRanking())
        self.trial = StepTrial(LRU, samples, hold=None, clock=clock, tie=TIE)
        self.eviction = "auto"
        self.current = self.arms[VISMMOE]  # until the trial's first step: the ranking outside decode steps

    @property
    def reads_usage(self) -> bool:
        """Until the trial keeps lru: VisMMOE's arm ranks by the router's averages, which every step must keep
        up (its runs alternate with lru's), and after a decision for it, for good."""
        return not (self.trial.settled and self.trial.choice == LRU)  # read per layer in eager steps: no outcome()

    def for_step(self, ready: bool = True) -> Any:
        """The ranking for the step about to run (called once per decode step, before its reservations). Not
        `ready` (the reservations' own trial is under way: reservations.py): VisMMOE's, untimed, the trial waiting."""
        if not ready:
            self.trial.interrupt()  # the steps meanwhile are no run of this trial's
            return self.current
        self.current = self.arms[self.trial.arm()]
        return self.current

    def interrupt(self) -> None:
        self.trial.interrupt()

    def describe(self) -> str:
        outcome = self.trial.outcome()
        if outcome is None:
            return f"auto: trying lru against vismmoe over the first decode steps ({self.trial.timed} timed so far)"
        lru, vismmoe, kept, why = outcome
        return (f"auto: kept {self.arms[kept].name} ({why}): {1e3 * lru:.2f} ms per decode step with lru, "
                f"{1e3 * vismmoe:.2f} with vismmoe's ranking (median of {self.trial.samples} timed steps each)")


def eviction_choice(eviction: str, reason: str, clock: Callable[[], float] | None = None) -> Any:
    """The plan's resolved `eviction` (lru | vismmoe | auto: a trial) as the boundary's per-step source."""
    if eviction == "auto":
        return EvictionTrial(clock=clock or time.perf_counter)
    return FixedEviction(eviction, reason)

"""When table decode reserves its landing slabs: `reservations: auto` times before-step against ahead over decode's
first steps (before the eviction's own trial, which waits for it) and keeps the faster for good (a tie:
before-step); the plan says when auto cannot be. A fake clock stands in for the steps (no timing of this machine). The runtime under the trial, switching
ways mid-decode: tests/runtime/test_decode_table.py."""

import pytest
import torch

from vismmoe_kt.runtime.budget import BudgetError
from vismmoe_kt.runtime.offload_plan import PlanFacts, resolve_plan
from vismmoe_kt.runtime.offload_settings import OffloadSettings
from vismmoe_kt.runtime.reservations import AHEAD, BEFORE_STEP, FixedReservations, ReservationsTrial, \
    reservations_choice


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_trial(before_s: float, ahead_s: float, steps: int, samples: int = 3):
    """`steps` steps: each step's way, and the trial."""
    clock = Clock()
    trial = ReservationsTrial(samples=samples, clock=clock)
    ways = []
    for _ in range(steps):
        ahead = trial.for_step()
        ways.append("ahead" if ahead else "before")
        clock.now += ahead_s if ahead else before_s
    return trial, ways


@pytest.mark.parametrize("before_s,ahead_s,kept", [(0.0080, 0.0070, "ahead"), (0.0070, 0.0075, "before"),
                                                   (0.0070, 0.0070, "before"), (0.00705, 0.0070, "before")])
def test_the_faster_way_is_kept_for_good_and_a_tie_keeps_before_step(before_s, ahead_s, kept):
    trial, ways = run_trial(before_s, ahead_s, steps=100)
    # runs of three steps (a change of way's rebuild, the launched steps' queue refilled), the third timed:
    # three runs per way, then the decision
    assert ways[:18] == ["before"] * 3 + ["ahead"] * 3 + ["before"] * 3 + ["ahead"] * 3 + ["before"] * 3 + ["ahead"] * 3
    assert set(ways[18:]) == {kept} and len(trial.trial.decisions) == 1 and trial.settled
    before, ahead, arm = trial.trial.decisions[0]
    assert (before, ahead) == pytest.approx((before_s, ahead_s)) and arm == (AHEAD if kept == "ahead" else BEFORE_STEP)
    text = trial.describe()
    assert f"kept {'ahead' if kept == 'ahead' else 'before-step'}" in text
    assert ("a tie keeps the simpler" in text) == (abs(before_s - ahead_s) < 0.0001)


def test_only_a_runs_last_step_is_timed():
    """The first two steps of a run pay for the change of way (a rebuild, the queue of launched steps drained and
    refilled): charged to either arm they would decide nothing about the ways themselves."""
    clock = Clock()
    trial = ReservationsTrial(samples=2, clock=clock)
    for _ in range(16):  # two runs of three a way, then the decision
        ahead = trial.for_step()
        run_step = trial.trial.run
        # a run's first two steps cost 50 ms whichever way; its third is the way's own time
        clock.now += 0.050 if run_step < 3 else (0.006 if ahead else 0.008)
    assert trial.trial.decisions[0] == pytest.approx((0.008, 0.006, AHEAD))
    assert "timing before-step against ahead" in ReservationsTrial().describe()


def test_an_interruption_is_not_timed():
    clock = Clock()
    trial = ReservationsTrial(samples=2, clock=clock)
    for step in range(20):
        ahead = trial.for_step()
        clock.now += 0.010 if ahead else 0.020
        if step == 2:  # a prompt between two steps: seconds that are no step's
            clock.now += 30.0
            trial.interrupt()
    assert trial.trial.decisions and max(trial.trial.decisions[0][:2]) < 1.0


def test_the_eviction_trial_waits_untimed_until_told_ready():
    """The eviction's trial runs after the reservations' (the ranking timed in the way decode keeps): not ready,
    it gives VisMMOE's ranking and times nothing, not even across the wait."""
    from vismmoe_kt.runtime.eviction import EvictionTrial

    clock = Clock()
    trial = EvictionTrial(samples=2, clock=clock)
    for _ in range(20):
        assert trial.for_step(ready=False).name == "vismmoe"
        clock.now += 1.0  # a waiting step's time must not reach either arm
    names = []
    for _ in range(12):
        names.append(trial.for_step().name)
        clock.now += 0.010 if names[-1] == "lru" else 0.020
    assert names[:8] == ["lru", "lru", "vismmoe", "vismmoe"] * 2 and trial.trial.decisions
    assert max(trial.trial.decisions[0][:2]) < 0.05


def test_a_fixed_way_is_the_rules_and_the_choice_builds_the_plans():
    fixed = reservations_choice("ahead", "given")
    assert isinstance(fixed, FixedReservations) and fixed.for_step() and fixed.settled
    assert fixed.describe() == "ahead (given)" and not reservations_choice("before-step", "given").for_step()
    assert isinstance(reservations_choice("auto", "why"), ReservationsTrial)


def test_the_plan_keeps_auto_only_where_ahead_could_run():
    E, H, I, K, layers = 8, 16, 8, 2, 4
    facts = PlanFacts(layers, E, H, I, K, torch.float32, table_kernels=True)
    block = 3 * I * H * 4

    def plan(facts=facts, device="cuda", slabs=2 * E, **kwargs):
        return resolve_plan(OffloadSettings(expert_budget=(E + slabs) * block, pinned_layers=1, **kwargs), facts,
                            device)

    auto = plan(reservations="auto")  # what a GPU plans (planning touches no device)
    assert auto.reservations == "auto" and any(line.startswith("reservations: auto (decode's steps time")
                                               for line in auto.describe())
    on_cpu = plan(device="cpu", reservations="auto")
    assert on_cpu.reservations == "before-step" and "no accelerator" in on_cpu.why["reservations"]
    every = plan(slabs=3 * E, reservations="auto")  # a slab for every offloaded expert: a settled table
    assert plan(slabs=10 * E, reservations="auto").reservations == "before-step"  # every layer pinned
    assert every.reservations == "before-step" and "nothing to reserve" in every.why["reservations"]
    hybrid = plan(device="cpu", miss_policy="cpu", reservations="auto")  # on the CPU device decode has a CPU share
    assert hybrid.reservations == "before-step" and hybrid.why["reservations"].startswith("auto, but decode has")
    from dataclasses import replace
    lookahead = plan(replace(facts, lookahead=True), reservations="auto")
    assert lookahead.reservations == "before-step" and "lookahead" in lookahead.why["reservations"]
    with pytest.raises(BudgetError, match="reservations 'later' is not one of: auto, before-step, ahead"):
        OffloadSettings(expert_budget="1GiB", reservations="later")

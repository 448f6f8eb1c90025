"""When table decode reserves its landing slabs: `reservations: auto` times before-step against ahead over decode's
steps once the eviction has settled, and keeps the faster for good (a tie: before-step); the plan says when auto
cannot be. A fake clock stands in for the steps (no timing of this machine). The runtime under the trial, switching
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


def run_trial(before_s: float, ahead_s: float, steps: int, settled_from: int = 0, samples: int = 3):
    """`steps` steps, the eviction settled from step `settled_from` on: each step's way, and the trial."""
    clock = Clock()
    trial = ReservationsTrial(samples=samples, clock=clock)
    ways = []
    for step in range(steps):
        ahead = trial.for_step(eviction_settled=step >= settled_from)
        ways.append("ahead" if ahead else "before")
        clock.now += ahead_s if ahead else before_s
    return trial, ways


@pytest.mark.parametrize("before_s,ahead_s,kept", [(0.0080, 0.0070, "ahead"), (0.0070, 0.0075, "before"),
                                                   (0.0070, 0.0070, "before"), (0.00705, 0.0070, "before")])
def test_the_faster_way_is_kept_for_good_and_a_tie_keeps_before_step(before_s, ahead_s, kept):
    trial, ways = run_trial(before_s, ahead_s, steps=100)
    # runs of two steps, the second of each timed: three runs per way, then the decision
    assert ways[:12] == ["before", "before", "ahead", "ahead"] * 3
    assert set(ways[12:]) == {kept} and len(trial.trial.decisions) == 1
    before, ahead, arm = trial.trial.decisions[0]
    assert (before, ahead) == pytest.approx((before_s, ahead_s)) and arm == (AHEAD if kept == "ahead" else BEFORE_STEP)
    text = trial.describe()
    assert f"kept {'ahead' if kept == 'ahead' else 'before-step'}" in text
    assert ("a tie keeps the simpler" in text) == (abs(before_s - ahead_s) < 0.0001)


def test_the_trial_waits_for_the_eviction_to_settle():
    """Two trials alternating at once would time each other's arms: until the eviction settles every step runs
    before-step and nothing is timed; the steps then decide as they would from a fresh start."""
    trial, ways = run_trial(0.0080, 0.0070, steps=60, settled_from=20)
    assert ways[:20] == ["before"] * 20
    assert ways[20:32] == ["before", "before", "ahead", "ahead"] * 3 and set(ways[32:]) == {"ahead"}
    # the first timed before-step sample is the second step after the wait, not the wait's last step
    assert trial.trial.decisions[0][:2] == pytest.approx((0.0080, 0.0070))
    assert "timing before-step against ahead" in ReservationsTrial().describe()


def test_an_interruption_is_not_timed():
    clock = Clock()
    trial = ReservationsTrial(samples=2, clock=clock)
    for step in range(12):
        ahead = trial.for_step(True)
        clock.now += 0.010 if ahead else 0.020
        if step == 2:  # a prompt between two steps: seconds that are no step's
            clock.now += 30.0
            trial.interrupt()
    assert trial.trial.decisions and max(trial.trial.decisions[0][:2]) < 1.0


def test_a_fixed_way_is_the_rules_and_the_choice_builds_the_plans():
    fixed = reservations_choice("ahead", "given")
    assert isinstance(fixed, FixedReservations) and fixed.for_step(False) and fixed.describe() == "ahead (given)"
    assert not reservations_choice("before-step", "given").for_step(True)
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

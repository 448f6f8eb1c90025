"""QuotaTrial: the hybrid's CPU quota in table decode is kept only while steps measure faster with it.
A fake clock stands in for the decode steps (no timing of this machine)."""

import pytest

from vismmoe_kt.runtime.quota_trial import WITH_CPU, WITHOUT_CPU, QuotaTrial

QUOTA = [0, 0, 1, 1, 2]  # the cost model's: of m misses, how many the CPU computes


class Steps:
    """Runs decode steps against a trial: each step lasts what `seconds(quota)` says."""

    def __init__(self, trial_kwargs: dict, with_cpu: float, without: float):
        self.now = 0.0
        self.trial = QuotaTrial(clock=lambda: self.now, **trial_kwargs)
        self.with_cpu, self.without = with_cpu, without
        self.arms: list[int] = []

    def run(self, n: int, quota=QUOTA) -> list[int]:
        for _ in range(n):
            chosen = self.trial.choose(list(quota))
            cpu = any(chosen)
            assert chosen in (list(quota), [0] * len(quota))
            self.arms.append(WITH_CPU if cpu else WITHOUT_CPU)
            self.now += self.with_cpu if cpu else self.without
        return self.arms


def test_the_step_after_a_switch_of_arms_is_not_timed():
    """A step without the CPU lands its misses, which speeds up whatever step comes next: only the
    second step of each run counts, so that benefit is not credited to the other arm."""
    steps = Steps({"samples": 3, "hold": 100}, with_cpu=0.020, without=0.020)
    trial, durations = steps.trial, []
    for _ in range(13):
        chosen = trial.choose(list(QUOTA))
        first_of_run = trial.run == 1
        # a step right after a switch is fast (it reads what the step before landed); the rest take 20 ms
        duration = 0.001 if first_of_run else 0.020
        durations.append(duration)
        steps.now += duration
    assert trial.decisions and trial.decisions[-1][:2] == pytest.approx((0.020, 0.020))


@pytest.mark.parametrize("with_cpu,without,kept", [(0.030, 0.026, WITHOUT_CPU), (0.022, 0.026, WITH_CPU),
                                                   (0.026, 0.026, WITHOUT_CPU)])
def test_the_faster_arm_is_kept_after_the_trial(with_cpu, without, kept):
    steps = Steps({"samples": 4, "hold": 100}, with_cpu, without)
    arms = steps.run(60)
    # runs of two steps, the second of each timed (at the next one's start): four runs per arm
    assert arms[:16] == [WITH_CPU, WITH_CPU, WITHOUT_CPU, WITHOUT_CPU] * 4
    assert set(arms[16:]) == {kept}
    with_median, without_median, arm = steps.trial.decisions[-1]
    assert (with_median, without_median, arm) == pytest.approx((with_cpu, without, kept))
    assert ("kept the CPU's share" if kept == WITH_CPU else "sent no miss to the CPU") in steps.trial.describe()


def test_the_trial_is_repeated_after_the_hold_and_follows_a_change():
    steps = Steps({"samples": 2, "hold": 20}, with_cpu=0.030, without=0.020)
    arms = steps.run(12)  # a trial of 8 steps, the decision at the 9th, then held
    assert [d[2] for d in steps.trial.decisions] == [WITHOUT_CPU] and arms[8:] == [WITHOUT_CPU] * 4
    steps.with_cpu = 0.010  # the CPU got faster (say, the link is now busy with another model's copies)
    arms = steps.run(40)  # held for 20 steps (to step 28), a trial from step 29, the decision at step 37
    assert [d[2] for d in steps.trial.decisions] == [WITHOUT_CPU, WITH_CPU]
    assert arms[12:28] == [WITHOUT_CPU] * 16 and arms[36:] == [WITH_CPU] * 16


def test_an_interruption_is_not_timed_and_a_quota_without_cpu_is_not_tried():
    steps = Steps({"samples": 2, "hold": 50}, with_cpu=0.010, without=0.020)
    steps.run(2)
    steps.now += 100.0  # a prefill between two steps
    steps.trial.interrupt()
    steps.run(12)
    assert steps.trial.decisions and steps.trial.decisions[-1][0] == pytest.approx(0.010)
    assert max(max(d[0], d[1]) for d in steps.trial.decisions) < 1.0  # the prefill never counted
    fresh = Steps({"samples": 2}, with_cpu=0.010, without=0.020)
    arms = fresh.run(10, quota=[0] * 5)
    assert arms == [WITHOUT_CPU] * 10 and not fresh.trial.decisions


def test_bad_trial_settings_are_refused():
    with pytest.raises(ValueError, match="samples >= 1"):
        QuotaTrial(samples=0)

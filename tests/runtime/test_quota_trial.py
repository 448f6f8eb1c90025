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


@pytest.mark.parametrize("with_cpu,without,kept", [(0.030, 0.026, WITHOUT_CPU), (0.022, 0.026, WITH_CPU),
                                                   (0.026, 0.026, WITHOUT_CPU)])
def test_the_faster_arm_is_kept_after_the_trial(with_cpu, without, kept):
    steps = Steps({"samples": 4, "hold": 100}, with_cpu, without)
    arms = steps.run(60)
    trial_steps = 9  # four timed steps per arm: each is timed at the next one's start
    assert sorted(arms[:trial_steps - 1]) == [WITH_CPU] * 4 + [WITHOUT_CPU] * 4  # alternating, balanced
    assert set(arms[trial_steps - 1:]) == {kept}
    with_median, without_median, arm = steps.trial.decisions[-1]
    assert (with_median, without_median, arm) == pytest.approx((with_cpu, without, kept))
    assert ("kept the CPU's share" if kept == WITH_CPU else "sent no miss to the CPU") in steps.trial.describe()


def test_the_trial_is_repeated_after_the_hold_and_follows_a_change():
    steps = Steps({"samples": 2, "hold": 10}, with_cpu=0.030, without=0.020)
    steps.run(12)  # a trial of 5 steps, then held
    assert [d[2] for d in steps.trial.decisions] == [WITHOUT_CPU]
    steps.with_cpu = 0.010  # the CPU got faster (say, the link is now busy with another model's copies)
    arms = steps.run(30)
    assert [d[2] for d in steps.trial.decisions][-1] == WITH_CPU
    assert arms[-5:] == [WITH_CPU] * 5


def test_an_interruption_is_not_timed_and_a_quota_without_cpu_is_not_tried():
    steps = Steps({"samples": 2, "hold": 50}, with_cpu=0.010, without=0.020)
    steps.run(2)
    steps.now += 100.0  # a prefill between two steps
    steps.trial.interrupt()
    steps.run(4)
    assert steps.trial.decisions and steps.trial.decisions[-1][0] == pytest.approx(0.010)
    assert max(max(d[0], d[1]) for d in steps.trial.decisions) < 1.0  # the prefill never counted
    fresh = Steps({"samples": 2}, with_cpu=0.010, without=0.020)
    arms = fresh.run(10, quota=[0] * 5)
    assert arms == [WITHOUT_CPU] * 10 and not fresh.trial.decisions


def test_bad_trial_settings_are_refused():
    with pytest.raises(ValueError, match="samples >= 1"):
        QuotaTrial(samples=0)

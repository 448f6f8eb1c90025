"""ReaLB's straggler figures from each rank's own expert compute (parallel/compute_timer.py)."""

import time

from vismmoe_kt.parallel.compute_timer import ComputeTimer, straggler_seconds


def test_the_timer_records_only_while_enabled_and_forgets_what_it_gave():
    timer = ComputeTimer("cpu")
    with timer():
        time.sleep(0.001)
    assert timer.take() == []  # off by default: nothing kept
    timer.enabled = True
    for pause in (0.002, 0.0):
        with timer():
            time.sleep(pause)
    first, second = timer.take()  # in call order
    assert first >= 0.002 and second >= 0  # (no upper bound: a loaded machine may stretch either)
    assert timer.take() == []


def test_straggler_time_is_the_slowest_ranks_excess_over_the_mean_call_by_call():
    # two ranks, two layers; layer 0: calls (1, 3) and (2, 2); layer 1: one call (5, 1)
    per_rank = [[[1.0, 2.0], [5.0]], [[3.0, 2.0], [1.0]]]
    out = straggler_seconds(per_rank)
    assert out["moe_compute_s_per_rank"] == [8.0, 6.0]
    assert out["straggler_s"] == (3 - 2) + 0 + (5 - 3)  # per call: max minus mean
    assert out["straggler_share"] == 3 / 7
    balanced = straggler_seconds([[[2.0, 2.0]], [[2.0, 2.0]]])
    assert balanced["straggler_s"] == 0 and balanced["straggler_share"] == 0

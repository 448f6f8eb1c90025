"""The hybrid split: which missing experts go to the CPU so that the copies of the others and the
CPU's work, running at once, finish first; and the online rates that move it."""

import pytest

from vismmoe_kt.runtime.cost_model import CostModel, CostTracker

MISSES = {3: 1, 7: 1, 9: 1, 12: 1}  # a decode token's four misses, one token each


def test_a_slow_link_sends_misses_to_the_cpu_and_a_fast_one_fetches_them():
    slow_link = CostModel(fetch_seconds=5e-3, cpu_seconds_fixed=0.5e-3, cpu_seconds_per_token=0.1e-3)
    assert slow_link.split(MISSES) == set(MISSES)  # 4 x 0.6 ms on the CPU beats even one 5 ms copy
    medium = CostModel(fetch_seconds=2e-3, cpu_seconds_fixed=0.5e-3, cpu_seconds_per_token=0.1e-3)
    assert len(medium.split(MISSES)) == 3  # 3 x 0.6 ms beside one 2 ms copy: 2 ms, against 2.4 ms all on the CPU
    fast_link = CostModel(fetch_seconds=0.05e-3, cpu_seconds_fixed=1e-3, cpu_seconds_per_token=0.1e-3)
    assert fast_link.split(MISSES) == set()


def test_comparable_rates_split_the_misses_and_beat_either_extreme():
    # the old per-expert rule (one copy 0.2 ms < one CPU call 1 ms) never chose the CPU; four copies
    # take 0.8 ms, so one expert on the CPU (1 ms) is no better, but eight misses are worth splitting
    model = CostModel(fetch_seconds=0.2e-3, cpu_seconds_fixed=0.9e-3, cpu_seconds_per_token=0.1e-3)
    assert model.split(MISSES) == set()  # a tie or worse keeps the fetches (they stay cached)
    eight = {e: 1 for e in range(8)}
    chosen = model.split(eight)
    assert len(chosen) == 1
    split = model.layer_seconds(eight, chosen)
    assert split < model.layer_seconds(eight, set()) and split < model.layer_seconds(eight, set(eight))


def test_experts_with_few_tokens_go_to_the_cpu_first():
    model = CostModel(fetch_seconds=1.0, cpu_seconds_fixed=0.0, cpu_seconds_per_token=0.3)
    tokens = {1: 10, 2: 1, 3: 2, 4: 1}
    chosen = model.split(tokens)
    assert chosen and all(tokens[e] <= min(tokens[o] for o in tokens if o not in chosen) for e in chosen)
    assert 1 not in chosen  # ten tokens cost 3 s on the CPU against one 1 s copy


def test_online_rates_follow_what_the_layers_measure():
    tracker = CostTracker(CostModel(fetch_seconds=1e-3, cpu_seconds_fixed=1e-3, cpu_seconds_per_token=0.0))
    for _ in range(60):  # the link turns out ten times slower than at start-up
        tracker.observe_copy(10e-3)
    assert tracker.model.fetch_seconds == pytest.approx(10e-3, rel=0.01)
    assert tracker.model.split(MISSES) == set(MISSES)
    for _ in range(60):  # and a CPU call of 2 experts takes 8 ms: 4 ms each
        tracker.observe_cpu(experts=2, tokens=2, seconds=8e-3)
    assert tracker.model.cpu_seconds(1) == pytest.approx(4e-3, rel=0.01)
    pinned = CostTracker(CostModel(1e-3, 1e-3, 0.0), pinned=True)
    pinned.observe_copy(10e-3)
    pinned.observe_cpu(1, 1, 1.0)
    assert pinned.model == CostModel(1e-3, 1e-3, 0.0)  # the rule's numbers stay


def test_the_per_call_cost_keeps_few_misses_on_the_gpu_and_splits_many():
    """H200-like rates: a BF16 expert crosses the link in 0.17 ms, an INT8 one takes the CPU 0.1 ms,
    and calling the CPU at all from a decode step costs 0.3 ms. One or two misses stay on the GPU
    (the call alone outweighs what it saves); eight are split, and the split's layer time counts
    the call once."""
    model = CostModel(fetch_seconds=0.17e-3, cpu_seconds_fixed=0.1e-3, cpu_seconds_per_token=0.0,
                      cpu_seconds_call=0.3e-3)
    free_call = CostModel(fetch_seconds=0.17e-3, cpu_seconds_fixed=0.1e-3, cpu_seconds_per_token=0.0)
    for misses in (1, 2):
        tokens = {e: 1 for e in range(misses)}
        assert model.split(tokens) == set() and free_call.split(tokens)
    eight = {e: 1 for e in range(8)}
    chosen = model.split(eight)
    assert 0 < len(chosen) < len(free_call.split(eight))
    assert model.layer_seconds(eight, chosen) == pytest.approx(
        max(0.17e-3 * (8 - len(chosen)), 0.3e-3 + 0.1e-3 * len(chosen)))
    assert model.layer_seconds(eight, set()) == pytest.approx(8 * 0.17e-3)  # no CPU, no call


def test_a_rules_cost_model_takes_the_call_cost_too():
    values = {"fetch_seconds": 1, "cpu_seconds_fixed": 0.5, "cpu_seconds_per_token": 0.1}
    assert CostModel.from_kwargs(values).cpu_seconds_call == 0.0
    assert CostModel.from_kwargs({**values, "cpu_seconds_call": "0.25"}).cpu_seconds_call == 0.25
    with pytest.raises(ValueError, match="cpu_seconds_call"):
        CostModel.from_kwargs({**values, "cpu_seconds_call": "soon"})
    tracker = CostTracker(CostModel.from_kwargs({**values, "cpu_seconds_call": 0.25}))
    tracker.observe_copy(2.0)
    tracker.observe_cpu(1, 1, 1.2)
    assert tracker.model.cpu_seconds_call == 0.25  # the online rates keep it

"""EPLB-style baseline: replication, packing and periodic rebalancing on constructed loads."""

import pytest
import torch

from vismmoe_kt.lb.eplb import EPLBPlacement, pack, rank_loads, replicate


def test_replicate_gives_copies_to_the_heaviest_load_per_copy():
    assert replicate(torch.tensor([100.0, 10, 10, 40]), 6).tolist() == [3, 1, 1, 1]
    assert replicate(torch.tensor([5.0, 5]), 2).tolist() == [1, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        replicate(torch.ones(4), 3)


def test_pack_balances_ranks_with_equal_slots():
    load = torch.tensor([100.0, 10, 10, 40])
    copies = replicate(load, 6)
    placement = pack(load, copies, 2)
    per_rank = rank_loads(load, placement, copies, 2)
    assert sorted(r for _, r in placement).count(0) == 3
    assert per_rank.sum().item() == pytest.approx(160)
    assert (per_rank.max() / per_rank.mean()).item() < 1.05  # greedy: 83.3 vs 76.7, close to even


def test_placement_lags_a_change_and_catches_up_after_a_rebalance():
    eplb = EPLBPlacement(num_experts=4, num_ranks=2, redundant=2, window=2, period=2)
    skewed = torch.tensor([100.0, 10, 10, 40])
    first = eplb.observe(skewed)          # still the initial, load-blind placement
    second = eplb.observe(skewed)         # a rebalance happens after this step
    third = eplb.observe(skewed)
    assert eplb.rebalances == 1
    assert (first.max() / first.mean()) > (third.max() / third.mean())
    assert (third.max() / third.mean()).item() < 1.05
    assert torch.equal(first, second)


def test_bad_sizes():
    with pytest.raises(ValueError, match="split evenly"):
        EPLBPlacement(num_experts=5, num_ranks=2, redundant=0)

"""Expert budget: byte sizes and the pinned-prefix interval of VisMMOE Eq. 10."""

import pytest

from vismmoe_kt.runtime.budget import BudgetError, choose_pinned_layers, parse_bytes, valid_prefix_range

GIB = 2**30


@pytest.mark.parametrize("text,value", [(1234, 1234), ("24GiB", 24 * GIB), ("40 GB", 40 * 10**9), ("512MiB", 512 * 2**20),
                                        ("1.5GiB", int(1.5 * GIB)), ("77", 77)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["24 gigs", "", "-3GiB", -1, True, "GiB"])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises(BudgetError, match="byte size"):
        parse_bytes(bad)


def test_eq10_interval():
    # floor((100 - 20) / 10) = 8, so L in [2, 8]
    assert valid_prefix_range(100, 10, 20, 2) == range(2, 9)


def test_eq10_upper_bound_is_floored():
    assert valid_prefix_range(109, 10, 20, 2) == range(2, 9)  # 89 / 10 -> 8
    assert valid_prefix_range(110, 10, 20, 2) == range(2, 10)  # 90 / 10 -> 9


def test_eq10_single_point_and_empty():
    assert valid_prefix_range(40, 10, 20, 2) == range(2, 3)  # exactly L_semantic fits
    assert len(valid_prefix_range(39, 10, 20, 2)) == 0
    assert len(valid_prefix_range(10, 10, 20, 0)) == 0  # budget below C_safe


def test_empty_interval_error_states_the_minimum_budget():
    with pytest.raises(BudgetError, match=r"at least .* \(40 bytes\)"):
        choose_pinned_layers(39, 10, 20, 2, num_moe_layers=48)


def test_default_choice_is_the_smallest_valid_depth():
    assert choose_pinned_layers(100, 10, 20, 2, num_moe_layers=48) == 2


def test_budget_that_holds_every_layer_pins_them_all():
    assert choose_pinned_layers(480, 10, 20, 2, num_moe_layers=48) == 48


def test_requested_depth_is_checked_against_eq10():
    assert choose_pinned_layers(100, 10, 20, 2, 48, requested=8) == 8
    with pytest.raises(BudgetError, match=r"pinned_layers=9 is outside the valid range 2..8"):
        choose_pinned_layers(100, 10, 20, 2, 48, requested=9)
    with pytest.raises(BudgetError, match=r"pinned_layers=1 is outside"):
        choose_pinned_layers(100, 10, 20, 2, 48, requested=1)

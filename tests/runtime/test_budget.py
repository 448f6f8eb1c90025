"""Expert budget: byte sizes, the pinned-prefix interval of VisMMOE Eq. 10, and the depth `auto` takes in it."""

from dataclasses import replace

import pytest
import torch

from vismmoe_kt.runtime.budget import (BudgetError, choose_pinned_layers, parse_budget, parse_bytes,
                                       pinned_depth_choice, resolve_budget, valid_prefix_range)
from vismmoe_kt.runtime.prefix_depth import DepthModel, HitRateCurve, default_model, predict, shipped_curve

GIB = 2**30
QWEN_LAYER = 128 * 3 * 2048 * 768 * 2  # Qwen3-VL-30B-A3B: 128 experts of 3 x 2048 x 768 BF16 per MoE layer


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


def test_without_a_hit_rate_curve_for_the_shape_auto_takes_the_smallest_valid_depth():
    assert choose_pinned_layers(100, 10, 20, 2, num_moe_layers=48) == 2
    assert "no decode hit-rate curve for this shape" in pinned_depth_choice(100, 10, 20, 2, 48).reason


def test_budget_that_holds_every_layer_pins_them_all():
    assert choose_pinned_layers(480, 10, 20, 2, num_moe_layers=48) == 48


def test_requested_depth_is_checked_against_eq10():
    assert choose_pinned_layers(100, 10, 20, 2, 48, requested=8) == 8
    with pytest.raises(BudgetError, match=r"pinned_layers=9 is outside the valid range 2..8"):
        choose_pinned_layers(100, 10, 20, 2, 48, requested=9)
    with pytest.raises(BudgetError, match=r"pinned_layers=1 is outside"):
        choose_pinned_layers(100, 10, 20, 2, 48, requested=1)


# --- auto: the depth that minimises predicted time per decode token (prefix_depth.py) ---------------------

def toy_model(**kw):
    """4 layers x 4 experts, top-2, 1-byte experts, 1 B/s: a layer's hit rate 0.5 / 0.8 / 1.0 at 2 / 3 / 4 slabs."""
    curve = HitRateCurve((2, 3, 4), ((0.5, 0.8, 1.0),) * 4, experts=4, top_k=2, expert_bytes=1, source="toy")
    figures = dict(zero_copy_bytes_per_s=1.0, copy_bytes_per_s=1.0, layer_seconds=0.0, offload_overhead_seconds=0.0,
                   tolerance=0.0)
    return DepthModel(curve, 1, **{**figures, **kw})


def test_a_budget_where_pinning_costs_hit_rate_keeps_the_prefix_short():
    # 3 layers of budget, C_safe 1 layer: Eq. 10 allows 1..2. At 1 the 3 offloaded layers get 8/3 slabs each
    # (hit 0.7, 1.8 experts read); at 2 the other two get 2 each (hit 0.5, 2.0 read): 1 is faster.
    choice = pinned_depth_choice(12, 4, 4, 1, 4, model=toy_model())
    assert choice.valid == (1, 2) and choice.depth == 1
    assert [round(r.experts_read, 6) for r in choice.rows] == [1.8, 2.0]
    assert "the fastest of Eq. 10's 1..2" in choice.reason


def test_an_abundant_budget_pins_deeper():
    # 3.75 layers of budget, C_safe 1 byte: 1..3; every depth reads 0.4 experts, and each offloaded layer's
    # upkeep then decides: the deepest prefix wins
    choice = pinned_depth_choice(15, 4, 1, 1, 4, model=toy_model(offload_overhead_seconds=0.01))
    assert choice.valid == (1, 3) and choice.depth == 3
    assert [round(r.experts_read, 6) for r in choice.rows] == [0.4, 0.4, 0.4]


def test_depths_within_the_tolerance_of_the_fastest_go_to_the_deepest():
    tie = pinned_depth_choice(15, 4, 1, 1, 4, model=toy_model())  # no upkeep: every depth reads 0.4 experts
    assert len({round(r.seconds, 9) for r in tie.rows}) == 1 and tie.depth == 3  # an exact tie: the deepest
    # 1.8 vs 2.0 experts read: 11% apart, so a 15% tolerance takes the deeper one, 5% does not
    assert pinned_depth_choice(12, 4, 4, 1, 4, model=toy_model(tolerance=0.15)).depth == 2
    assert pinned_depth_choice(12, 4, 4, 1, 4, model=toy_model(tolerance=0.05)).depth == 1


def test_lookahead_hides_copies_behind_the_prefix():
    # 2 layers, 1 s of compute each; an offloaded layer misses its one expert every token (0.5 s to copy, 1 s zero-copy)
    curve = HitRateCurve((1, 2), ((0.0, 0.0),) * 2, experts=2, top_k=1, expert_bytes=1)
    model = DepthModel(curve, 1, zero_copy_bytes_per_s=1.0, copy_bytes_per_s=2.0, layer_seconds=1.0,
                       offload_overhead_seconds=0.0)
    assert predict(model, 10, 2, 1).seconds == pytest.approx(3.0)  # read when the layer runs: 1 + (1 + 1)
    ahead = DepthModel(curve, 1, zero_copy_bytes_per_s=1.0, copy_bytes_per_s=2.0, layer_seconds=1.0,
                       offload_overhead_seconds=0.0, lookahead=1)
    assert predict(ahead, 10, 2, 1).seconds == pytest.approx(2.0)  # copied during the pinned layer: hidden
    assert predict(ahead, 10, 2, 0).seconds == pytest.approx(2.5)  # layer 0 has nothing to hide behind
    half = DepthModel(curve, 1, zero_copy_bytes_per_s=1.0, copy_bytes_per_s=2.0, layer_seconds=1.0,
                      offload_overhead_seconds=0.0, lookahead=1, recall=0.5)
    assert predict(half, 10, 2, 1).seconds == pytest.approx(2.5)  # the unpredicted half is read in place


def test_hit_rate_curve_interpolates_and_extrapolates_to_zero():
    curve = HitRateCurve((2, 4), ((0.4, 1.0),), experts=4, top_k=2)
    assert curve.rate(0, 1) == pytest.approx(0.2)  # below top_k: linearly down to 0
    assert curve.rate(0, 3) == pytest.approx(0.7)
    assert curve.rate(0, 9) == 1.0
    with pytest.raises(ValueError, match="ascend"):
        HitRateCurve((4, 2), ((0.4, 1.0),), experts=4, top_k=2)


@pytest.mark.parametrize("gib", range(14, 54))
def test_qwen3_vl_auto_depth_lies_in_eq10_range(gib):
    budget = gib * GIB
    choice = pinned_depth_choice(budget, QWEN_LAYER, QWEN_LAYER, 1, 48)
    assert choice.valid == (1, (budget - QWEN_LAYER) // QWEN_LAYER)
    assert choice.valid[0] <= choice.depth <= choice.valid[1]
    assert [r.depth for r in choice.rows] == list(range(choice.valid[0], choice.valid[1] + 1))
    assert choose_pinned_layers(budget, QWEN_LAYER, QWEN_LAYER, 1, 48) == choice.depth


def test_qwen3_vl_shapes_pin_one_layer_at_16gib_and_more_at_32gib():
    """The shipped decode hit-rate curve (synthetic routing) with the H200's bandwidths."""
    assert shipped_curve() is not None and shipped_curve().layers == 48
    tight = pinned_depth_choice(16 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48)
    assert tight.valid == (1, 13) and tight.depth == 1
    assert "H200 defaults, not measured here" in tight.basis
    roomy = pinned_depth_choice(32 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48)
    assert roomy.valid == (1, 27) and 1 < roomy.depth < 27
    fastest = min(roomy.rows, key=lambda r: r.seconds)
    chosen = next(r for r in roomy.rows if r.depth == roomy.depth)
    assert chosen.seconds <= fastest.seconds * 1.02
    assert pinned_depth_choice(60 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48).depth == 48  # everything fits


def test_auto_takes_the_fastest_depth_not_a_deeper_near_tie():
    """6 GiB of Q4_K slabs (Qwen3-VL's shapes, 144 bytes per 256 weights): every deeper pin costs 128 slabs
    and a little hit rate, so the fastest depth is Eq. 10's shallowest. A 2% tolerance would pin 3 (the rule
    the default rules measured 0.96x of lru with); the default takes the fastest."""
    block = QWEN_LAYER // 128 // 512 * 144
    layer = 128 * block
    model = default_model(48, QWEN_LAYER, read_bytes=block, slab_bytes=block)
    choice = pinned_depth_choice(6 * GIB, layer, layer, 1, 48, model=model, read_bytes=block)
    fastest = min(choice.rows, key=lambda r: r.seconds)
    assert choice.depth == fastest.depth == 1 and "the fastest of Eq. 10's 1..17" in choice.reason
    seconds = [r.seconds for r in choice.rows]
    assert seconds == sorted(seconds)  # deeper only costs here
    loose = pinned_depth_choice(6 * GIB, layer, layer, 1, 48, model=replace(model, tolerance=0.02), read_bytes=block)
    assert loose.depth > 1 and "the deepest such depth" in loose.reason


def test_explicit_depths_are_still_validated_and_reported_with_the_auto_choice():
    choice = pinned_depth_choice(16 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48, requested=10)
    assert choice.depth == 10 and "pinned_layers=10 given" in choice.reason and "auto would pin 1" in choice.reason
    with pytest.raises(BudgetError, match=r"pinned_layers=14 is outside the valid range 1..13"):
        choose_pinned_layers(16 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48, requested=14)
    with pytest.raises(BudgetError, match=r"at least 2.2 GiB"):
        choose_pinned_layers(2 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48)


def test_the_runtime_summary_says_why_it_pinned_what_it_did():
    from vismmoe_kt.runtime.offload import OffloadRuntime
    from vismmoe_kt.runtime.offload_settings import OffloadSettings

    experts, hidden, inter = 4, 8, 4
    layer = experts * 3 * hidden * inter * 4
    for kwargs, expected in [({}, "auto: 1, the smallest depth of Eq. 10's 1..2"),
                             ({"pinned_layers": 2}, "pinned_layers=2 given (Eq. 10 allows 1..2; auto would pin 1)")]:
        runtime = OffloadRuntime(OffloadSettings(expert_budget=3 * layer, **kwargs), [0, 1, 2, 3, 4], experts, hidden,
                                 inter, torch.float32, "cpu", top_k=2)
        assert runtime.summary()["pinned_layers_reason"].startswith(expected)


def test_an_empty_prefix_where_allowed_and_predicted_faster_and_one_layer_where_nothing_prices_it():
    """L_semantic 0 (the default rule file's): at 16 GiB of BF16 the shipped curve predicts no pinned layer faster
    (a layer's 128 slabs buy more hits shared than pinned), at 32 GiB three layers whatever the minimum; a shape
    without a curve keeps the paper's one layer rather than guess."""
    assert pinned_depth_choice(16 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48).depth == 1
    empty = pinned_depth_choice(16 * GIB, QWEN_LAYER, QWEN_LAYER, 0, 48)
    assert empty.depth == 0 and empty.rows[0].seconds < empty.rows[1].seconds
    assert pinned_depth_choice(32 * GIB, QWEN_LAYER, QWEN_LAYER, 0, 48).depth == \
        pinned_depth_choice(32 * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48).depth == 3
    uncurved = pinned_depth_choice(16 * GIB, QWEN_LAYER // 2, QWEN_LAYER, 0, 48)
    assert uncurved.depth == 1 and "no decode hit-rate curve" in uncurved.reason
    assert pinned_depth_choice(QWEN_LAYER // 2 + QWEN_LAYER, QWEN_LAYER // 2, QWEN_LAYER, 0, 48).depth == 1
    assert pinned_depth_choice(QWEN_LAYER + QWEN_LAYER // 4, QWEN_LAYER // 2, QWEN_LAYER, 0, 48).depth == 0  # only 0 fits


def test_a_quantized_stores_cheaper_misses_are_priced_at_their_bytes():
    """With Q4_0 blocks (18 bytes per 32 weights, 0.28x of BF16's) a miss reads a quarter of the bytes
    while the budget still holds BF16 slabs: the same slabs per depth, fewer bytes read and less time
    per token."""
    block = QWEN_LAYER // 128 * 18 // 64  # BF16's 2 bytes per weight -> Q4_0's 18 bytes per 32 weights
    for gib in (16, 32):
        bf16 = pinned_depth_choice(gib * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48)
        q4 = pinned_depth_choice(gib * GIB, QWEN_LAYER, QWEN_LAYER, 1, 48, read_bytes=block)
        assert [r.slabs for r in q4.rows] == [r.slabs for r in bf16.rows]
        for fast, slow in zip(q4.rows, bf16.rows):
            assert fast.bytes_read == pytest.approx(slow.bytes_read * block / (QWEN_LAYER // 128))
            assert fast.seconds < slow.seconds or fast.experts_read == 0
        chosen = {r.depth: r for r in q4.rows}[q4.depth]
        assert chosen.seconds < {r.depth: r for r in bf16.rows}[bf16.depth].seconds
        assert q4.valid == bf16.valid and q4.valid[0] <= q4.depth <= q4.valid[1]


@pytest.mark.parametrize("text,value", [("30%", "30%"), (" 12.5 % ", "12.5%"), ("24GiB", 24 * GIB), (77, 77)])
def test_a_budget_is_bytes_or_a_share_of_the_experts(text, value):
    assert parse_budget(text) == value


@pytest.mark.parametrize("bad", ["%", "0%", "-5%", "lots%", "nan%"])
def test_a_share_must_be_a_positive_percentage(bad):
    with pytest.raises(BudgetError, match="not a share of the experts"):
        parse_budget(bad)


def test_a_share_resolves_against_the_experts_bytes_rounding_up():
    assert resolve_budget("30%", 1000) == 300 and resolve_budget("30%", 1001) == 301
    assert resolve_budget(4096, 10) == 4096  # bytes stay bytes


def test_the_runtime_resolves_a_share_of_its_experts():
    """ "30%" of 10 MoE layers is 3 layers' experts: one pinned layer (Eq. 10's smallest depth, no hit-rate
    curve for this shape) and two layers' worth of slabs; the summary reports the bytes, the settings the
    rules gave stay as they were."""
    from vismmoe_kt.runtime.offload import OffloadRuntime
    from vismmoe_kt.runtime.offload_settings import OffloadSettings

    experts, hidden, inter = 8, 8, 4
    layer = experts * 3 * hidden * inter * 4
    settings = OffloadSettings(expert_budget="30%")
    runtime = OffloadRuntime(settings, list(range(10)), experts, hidden, inter, torch.float32, "cpu", top_k=2)
    assert runtime.settings.expert_budget == 3 * layer and runtime.requested_settings.expert_budget == "30%"
    assert len(runtime.pinned) == 1 and runtime.num_slabs == 2 * experts
    assert runtime.summary()["expert_budget"] == "9.0 KiB"  # 3 x 3 KiB

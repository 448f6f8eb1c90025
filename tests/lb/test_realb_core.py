"""ReaLB building blocks: NVFP4 numerics, the precision plan, AIMD control of M_d."""

import pytest
import torch

from vismmoe_kt.lb.aimd import AIMDController
from vismmoe_kt.lb.nvfp4 import E2M1, nvfp4_dequantize, nvfp4_quantize, round_to_e2m1
from vismmoe_kt.lb.policy import plan_precision

GRID = torch.cat([E2M1, -E2M1[1:], torch.tensor([0.0])])  # 16 values: every magnitude, both signs


@pytest.mark.parametrize("scale", [0.125, 0.5, 1.0, 3.0, 20.0, 56.0, 448.0])  # all exact in E4M3
def test_grid_values_times_representable_scales_round_trip_exactly(scale):
    x = (GRID * scale).reshape(1, 16).repeat(3, 2)  # (3, 32): two blocks per row
    q = nvfp4_quantize(x, global_scale=1.0)
    assert torch.equal(nvfp4_dequantize(q), x)


def test_shapes_of_codes_and_scales():
    q = nvfp4_quantize(torch.randn(4, 5, 64))
    assert q.codes.shape == (4, 5, 32) and q.codes.dtype == torch.uint8
    assert q.block_scales.shape == (4, 5, 4) and q.block_scales.dtype == torch.float8_e4m3fn
    assert q.global_scale.dtype == torch.float32 and q.global_scale.dim() == 0
    assert nvfp4_dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def test_random_error_stays_within_the_format_bound():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.rand(64, 1) * 10
    y = nvfp4_dequantize(nvfp4_quantize(x))
    blocks_amax = x.reshape(64, 16, 16).abs().amax(-1, keepdim=True).expand(64, 16, 16).reshape(64, 256)
    # E2M1's widest step is 2 (between 4 and 6) of 6 units, plus E4M3's scale rounding
    assert ((y - x).abs() <= blocks_amax * (1 / 6 + 1 / 16) + 1e-6).all()
    assert (y - x).norm() / x.norm() < 0.15


def test_ties_round_to_even_codes():
    mags = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 6.0])
    assert E2M1[round_to_e2m1(mags)].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="NaN or infinite"):
        nvfp4_quantize(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(2, 24))


# --- the precision plan -------------------------------------------------------------------------
RANKS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def test_gate_keeps_everything_bf16_below_gamma():
    load, vision = torch.tensor([900.0, 100, 10, 10, 10, 10, 10, 10]), torch.tensor([900.0, 100, 0, 0, 0, 0, 0, 0])
    plan = plan_precision(load, vision, RANKS, 4, tokens=2047, gate_tokens=2048)
    assert plan.gated and not plan.lowprec.any()


def test_only_overloaded_vision_dominant_ranks_switch():
    # rank 0: 500 pairs, all vision; rank 1: 400, all text; ranks 2, 3: 100 each (light, some vision)
    load = torch.tensor([300.0, 200, 250, 150, 50, 50, 50, 50])
    vision = torch.tensor([300.0, 200, 0, 0, 50, 50, 0, 0])
    plan = plan_precision(load, vision, RANKS, 4, tokens=4096, vision_threshold=0.9, lowprec_cost=0.5)
    assert plan.lowprec[:2].any() and not plan.lowprec[2:].any()
    assert float(plan.rank_time_after[0]) <= 400  # down to the next straggler, which text keeps at 400
    assert plan.imbalance() < plan.imbalance(after=False)


def test_greedy_takes_the_vision_heaviest_first_and_stops_at_the_target():
    # rank 0 = 100 + 300 + 40 vision-heavy experts (experts 0, 1, 8); others 100 each
    ranks = torch.tensor([0, 0, 1, 2, 3, 1, 2, 3, 0])
    load = torch.tensor([100.0, 300, 50, 50, 50, 50, 50, 50, 40])
    vision = torch.tensor([95.0, 290, 0, 0, 0, 0, 0, 0, 40])
    plan = plan_precision(load, vision, ranks, 4, tokens=4096, vision_threshold=0.9, lowprec_cost=0.5)
    # switching expert 1 saves 145: rank 0 falls from 440 to 295, above the target (mean 185 vs next 100);
    # then expert 0 (next heaviest, 95 vision) saves 47.5 -> 247.5; then expert 8 (40) -> 227.5
    assert plan.lowprec.tolist() == [True, True, False, False, False, False, False, False, True]
    assert float(plan.rank_time_after[0]) == pytest.approx(440 - 0.5 * (290 + 95 + 40))


def test_text_rows_stay_bf16_unless_the_whole_expert_switches():
    load, vision = torch.tensor([400.0, 50, 50, 50]), torch.tensor([380.0, 0, 0, 0])
    ranks = torch.tensor([0, 1, 2, 3])
    rows = plan_precision(load, vision, ranks, 4, tokens=4096, vision_threshold=0.9, lowprec_cost=0.5)
    whole = plan_precision(load, vision, ranks, 4, tokens=4096, vision_threshold=0.9, lowprec_cost=0.5, scope="expert")
    assert float(rows.rank_time_after[0]) == 400 - 0.5 * 380   # the 20 text pairs still count in full
    assert float(whole.rank_time_after[0]) == 400 - 0.5 * 400
    assert rows.imbalance(after=False) > rows.imbalance()


def test_aimd_additive_decrease_multiplicative_backoff_and_bounds():
    c = AIMDController(threshold=0.9, minimum=0.6, step=0.1, backoff=0.5, target_imbalance=1.1, lowprec_budget=0.3)
    assert c.update(imbalance=1.5, lowprec_share=0.1) == pytest.approx(0.8)   # imbalanced: additive decrease
    assert c.update(imbalance=1.5, lowprec_share=0.1) == pytest.approx(0.7)
    assert c.update(imbalance=1.5, lowprec_share=0.1) == pytest.approx(0.6)
    assert c.update(imbalance=1.5, lowprec_share=0.1) == pytest.approx(0.6)   # floor M_min
    assert c.update(imbalance=1.0, lowprec_share=0.1) == pytest.approx(0.8)   # balanced: gap to 1 halves
    assert c.update(imbalance=1.5, lowprec_share=0.4) == pytest.approx(0.9)   # over budget: back off too
    for _ in range(60):
        c.update(imbalance=1.0, lowprec_share=0.0)
    assert 0.99 < c.threshold <= 1.0
    with pytest.raises(ValueError, match="M_min <= M_d"):
        AIMDController(threshold=0.5, minimum=0.7)

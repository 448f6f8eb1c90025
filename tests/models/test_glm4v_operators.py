"""GLM-4.5V under the operators the Qwen3-VL rule files put on the experts, through its own rule files:
ReaLB's mixed precision (optimize_rules/glm4v-realb.yaml), expert parallelism on gloo ranks
(glm4v-ep.yaml) and every routed expert on the CPU backend (glm4v-kt-cpu.yaml). The operators take
the top-k ids and weights GLM's sigmoid router chose (correction bias, routed scaling included); the
shared experts stay with the model's MoE block (or the lean step's attention piece), and the dense
first layer has no experts to replace. Exact where the operator computes what the model would (the
transformers fp32 reference, max abs logit diff <= 1e-5, same greedy tokens); switched ReaLB pairs
only on image rows; kt-kernel (BF16 kernels) within the BF16 tolerance scripts/gpu_check.py allows."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.engine.generation import generate

from conftest import tiny_case

NAME, SEED = "tiny-glm-4x16", 1
MOE_LAYERS = 3  # of 4: layer 0 is dense
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """An image-heavy prompt (121 visual tokens of 148), so that a small LB gate opens in prefill."""
    model_dir, ref, inputs = tiny_case(tmp_path_factory, NAME, SEED, "Describe the image.", (448, 448), 5)
    with torch.no_grad():
        expected = (ref(**inputs).logits, ref.generate(**inputs, max_new_tokens=TOKENS, do_sample=False))
    return model_dir, ref, inputs, expected


def run(model, inputs, lean: bool, tokens: int = TOKENS):
    with torch.no_grad():
        logits = model(**inputs).logits
        out = generate(model, dict(inputs), tokens) if lean else model.generate(**inputs, max_new_tokens=tokens,
                                                                                  do_sample=False)
    return logits, out


def check_exact(model, inputs, expected, lean: bool):
    logits, tokens = run(model, inputs, lean)
    assert (logits - expected[0]).abs().max().item() <= 1e-5
    assert torch.equal(tokens, expected[1])
    assert tokens.shape[1] - inputs["input_ids"].shape[1] == TOKENS  # no early end: every step compared


# --- ReaLB: MixedPrecisionExperts ------------------------------------------------------------------
REALB = "optimize_rules/glm4v-realb.yaml"


@pytest.mark.parametrize("overrides,decode", [({}, "lean"), ({"mode": "bf16", "lb_gate_tokens": 0}, "hf"),
                                              ({"mode": "bf16", "lb_gate_tokens": 0}, "lean"),
                                              ({"mode": "eplb", "eplb_period": 1}, "lean")])
def test_realb_with_lb_off_is_exactly_the_reference(case, overrides, decode):
    """The default gate (2048 tokens) stays shut on this prompt; mode bf16 never switches; mode eplb
    balances by placement only: each the model's own experts, on both decode paths."""
    model_dir, _, inputs, expected = case
    model, _ = load(model_dir, REALB, decode=decode, graphs="off", **overrides, **CPU)
    check_exact(model, inputs, expected, lean=decode == "lean")
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["count"] == MOE_LAYERS and stats["lowprec_pairs"] == 0
    assert stats["calls"] == MOE_LAYERS * (2 + TOKENS - 1)  # the logits' forward, the prefill, 7 decode steps
    if overrides.get("mode") == "eplb":
        assert stats["imbalance_after"] > 0


@pytest.mark.parametrize("backend", ["nvfp4-emulated", "fp8"])
def test_realb_switches_pairs_of_image_rows_only_and_stays_close(case, backend, monkeypatch):
    """A small LB gate and M_d from 0: vision-heavy experts of overloaded virtual ranks switch; with
    fp4_scope vision_tokens only their image rows' pairs go low-precision (the adapter hands our text
    model GLM's image-token mask), so the logits move, but not far."""
    import vismmoe_kt.operators.mixed_precision as operator

    model_dir, ref, inputs, expected = case
    model, _ = load(model_dir, REALB, lb_gate_tokens=64, md_start=0.0, precision_backend=backend, **CPU)
    seen = []
    if backend == "nvfp4-emulated":
        original = operator.lowprec_pairs

        def recording(mlp, hidden, index, weights, lowprec, *rest, **kwargs):
            seen.append(lowprec.any(dim=1))  # the rows with a low-precision pair, per layer call
            return original(mlp, hidden, index, weights, lowprec, *rest, **kwargs)
        monkeypatch.setattr(operator, "lowprec_pairs", recording)
    logits, tokens = run(model, inputs, lean=True, tokens=2)
    stats = collect_stats(model)["operators"]["MixedPrecisionExperts"]
    assert stats["precision_backend"] == backend
    assert stats["switched_experts"] > 0 and 0 < stats["lowprec_pairs"] < stats["pairs"]
    error = ((logits - expected[0]).norm() / expected[0].norm()).item()
    assert 0 < error < 0.2  # low precision on part of the image rows: changed, but not destroyed
    if backend == "nvfp4-emulated":
        visual = inputs["input_ids"][0] == ref.config.image_token_id
        prefill = [rows for rows in seen if rows.numel() == visual.numel()]
        assert prefill and all(rows.any() and not (rows & ~visual).any() for rows in prefill)

"""Operators injected into the tiny Qwen3-VL-MoE give exactly the reference logits and greedy tokens (fp32, CPU)."""

import copy

import pytest
import torch

from vismmoe_kt.inject import inject
from vismmoe_kt.operators.base import BaseInjectedModule
from vismmoe_kt.operators.experts import PlacedExperts, routed_expert_mlp

BASE = "vismmoe_kt.operators.base.BaseInjectedModule"
CPU = {"generate_device": "cpu", "prefill_device": "cpu"}
EXPERTS = r"^model\.language_model\.layers\.\d+\.mlp\.experts$"

PASS_THROUGH_EVERYWHERE = [
    {"match": {"name": r"^model\.visual$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"^model\.language_model$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"^model\.language_model\.layers\.\d+$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"\.self_attn$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"\.mlp$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": EXPERTS}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"\.mlp\.gate$"}, "replace": {"class": BASE, "kwargs": CPU}},
    {"match": {"name": r"^lm_head$"}, "replace": {"class": BASE, "kwargs": CPU}},
]


def run(model, inputs, new_tokens=6):
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return logits, tokens


@pytest.fixture(scope="module")
def expected(reference, image_inputs):
    return run(reference[0], image_inputs)


def injected_copy(reference, rules):
    model = copy.deepcopy(reference[0])
    inject(model, rules, model.config, default_device="cpu")
    return model


def test_pass_through_operators_at_every_level_give_identical_outputs(reference, image_inputs, expected):
    model = injected_copy(reference, PASS_THROUGH_EVERYWHERE)
    replaced = [m for m in model.modules() if type(m) is BaseInjectedModule]
    # visual, text model, 4 x (layer, attn, mlp, experts, gate), lm_head, and the 2 vision blocks' mlp
    assert len(replaced) == 2 + 4 * 5 + 1 + 2
    logits, tokens = run(model, image_inputs)
    assert torch.equal(tokens, expected[1])
    assert (logits - expected[0]).abs().max().item() <= 1e-5


# torch.device("cpu:0") != torch.device("cpu"): weights on "cpu:0" with compute on "cpu" takes the
# offload path (gather the routed experts, copy, compute) on a machine without a GPU.
@pytest.mark.parametrize("kwargs,fetches", [(CPU, False), ({**CPU, "weights_device": "cpu"}, False),
                                            ({**CPU, "weights_device": "cpu:0"}, True)])
def test_placed_experts_give_identical_outputs(reference, image_inputs, expected, kwargs, fetches):
    rules = [{"match": {"name": EXPERTS}, "replace": {"class": "vismmoe_kt.operators.experts.PlacedExperts", "kwargs": kwargs},
              "recursive": False}]
    model = injected_copy(reference, rules)
    operators = [m for m in model.modules() if isinstance(m, PlacedExperts)]
    assert len(operators) == 4
    logits, tokens = run(model, image_inputs)
    assert torch.equal(tokens, expected[1])
    assert (logits - expected[0]).abs().max().item() <= 1e-5
    assert sum(op.counters.calls for op in operators) > 0
    fetched = sum(op.counters.experts_fetched for op in operators)
    assert (fetched > 0) == fetches
    if fetches:  # never more than the experts that exist, per call
        assert all(op.counters.experts_fetched <= op.counters.calls * op.num_experts for op in operators)


def test_fetched_subset_computes_what_the_full_experts_compute(reference):
    """The offload path gathers only the routed experts and renumbers them; results must not change."""
    experts = reference[0].model.language_model.layers[0].mlp.experts
    torch.manual_seed(1)
    tokens, top_k = 9, 4
    hidden = torch.randn(tokens, experts.hidden_dim)
    index = torch.stack([torch.randperm(experts.num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k), dim=-1)
    with torch.no_grad():
        full = experts(hidden, index, weights)
        hit, local = torch.unique(index, return_inverse=True)
        subset = routed_expert_mlp(hidden, local, weights, experts.gate_up_proj[hit], experts.down_proj[hit], experts.act_fn)
    assert hit.numel() < experts.num_experts or tokens * top_k >= experts.num_experts
    assert (full - subset).abs().max().item() <= 1e-5

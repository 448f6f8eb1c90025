"""Operators injected into the tiny Qwen3-VL-MoE give exactly the reference logits and greedy tokens (fp32, CPU)."""

import copy

import pytest
import torch

from vismmoe_kt.core.inject import inject
from vismmoe_kt.operators.base import BaseInjectedModule

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

"""Batched generation (engine/batched.py): requests decoded together, as the scheduler plans, give
every request the greedy tokens it gets alone, with every expert resident or offloaded, whatever the
batch size and whoever joins or leaves meanwhile."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.batched import generate_batch
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.inputs import build_inputs, user_turn

from conftest import layer_bytes, make_image, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, _, _ = tiny_case(tmp_path_factory, "tiny-4x16", 1, "Describe the image.", (160, 128), 2)
    return model_dir


def requests_for(processor):
    """Prompts of different lengths, with and without images of different sizes."""
    return [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)]),
            build_inputs(processor, [user_turn("What is here? Answer in a few words please.", 1)],
                         [make_image(96, 64, seed=2)]),
            build_inputs(processor, [user_turn("Hello there", 0)], []),
            build_inputs(processor, [user_turn("Two shapes?", 1)], [make_image(128, 128, seed=3)])]


@pytest.mark.parametrize("rules,layers,max_batch", [("qwen3vl-offload", 4, 4), ("qwen3vl-offload", 4, 2),
                                                    ("qwen3vl-offload", 2, 3), ("qwen3vl", 2, 3)])
def test_batched_greedy_tokens_equal_each_request_alone(case, rules, layers, max_batch):
    """qwen3vl: VisMMOE whole, visual tokens pruned after the pinned layer (each slot's later layers hold
    fewer tokens than its first), misses split between the GPU and the CPU."""
    budget = int(layer_bytes(SPECS["tiny-4x16"]) * layers)
    model, processor = load(case, f"optimize_rules/{rules}.yaml", expert_budget=budget, **CPU)
    requests = requests_for(processor)
    budgets = [12, 5, 9, 7]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        sizes = []
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=max_batch,
                                  min_new_tokens=max(budgets), on_step=sizes.append)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert max(sizes) == min(max_batch, len(requests)) and max(sizes) > 1  # rows really ran together
    if rules == "qwen3vl":
        assert model.vismmoe.context.pruning.pruned_prefills == 6  # three image requests, alone and batched
    with torch.no_grad():  # the single-request path still works after a batch
        assert torch.equal(generate(model, dict(requests[0]), budgets[0], min_new_tokens=budgets[0]), alone[0])


def test_what_batched_generation_refuses(case):
    model, processor = load(case, "optimize_rules/qwen3vl-gpu.yaml", **CPU)  # no VisDecoder: no lean engine
    with pytest.raises(ValueError, match="runs on the lean decode path"):
        generate_batch(model, requests_for(processor)[:1], 4)

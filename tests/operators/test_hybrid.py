"""Hybrid mode: missing experts computed on the CPU give the reference model's outputs; `auto` decides
per expert by the cost model; the KTransformers-style rule runs every routed expert on the CPU."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.operators.cpu_experts import CpuExperts
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS, build_tiny_model, save_tiny_model

from conftest import layer_bytes, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
HYBRID = "optimize_rules/qwen3vl.yaml"


@pytest.fixture(scope="module", params=["tiny-4x16", "tiny-6x64"])
def shape(request, tmp_path_factory):
    name = request.param
    model_dir, ref, inputs = tiny_case(tmp_path_factory, name, 2, "What is this?", (128, 96), 4)
    with torch.no_grad():
        expected = ref.generate(**inputs, max_new_tokens=24, do_sample=False)
    return name, model_dir, inputs, expected


def run(model_dir, inputs, **overrides):
    model, _ = load(model_dir, HYBRID, keep_ratio=1.0, **overrides, **CPU)  # no token pruning here
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    return tokens, collect_stats(model)["operators"]["VisExperts"]


def test_cpu_miss_policy_matches_reference(shape):
    name, model_dir, inputs, expected = shape
    tokens, stats = run(model_dir, inputs, expert_budget=2 * layer_bytes(SPECS[name]), miss_policy="cpu")
    assert torch.equal(tokens, expected)
    assert stats["decode_cpu_experts"] > 0 and stats["prefill_cpu_experts"] > 0
    assert stats["decode_misses"] == 0 and stats["prefill_misses"] == 0  # nothing waited on a fetch
    assert stats["bytes_cpu_backend"] == 0  # the torch backend reads the store in place


def test_auto_takes_both_branches_on_a_forced_cost_model(shape):
    name, model_dir, inputs, expected = shape
    # a fetch costs 1 s, the CPU 0.3 s per token: per layer, the CPU takes the misses with the fewest
    # tokens while its total stays under the copies of the rest (cost_model.split)
    cost = {"fetch_seconds": 1.0, "cpu_seconds_fixed": 0.0, "cpu_seconds_per_token": 0.3}
    tokens, stats = run(model_dir, inputs, expert_budget=2 * layer_bytes(SPECS[name]), miss_policy="auto", cost_model=cost)
    assert torch.equal(tokens, expected)
    assert stats["prefill_misses"] > 0 and stats["prefill_cpu_experts"] > 0  # both branches in prefill
    # decode (one token per expert): three of every four misses or so go to the CPU (3 x 0.3 s beside one 1 s copy)
    assert stats["decode_cpu_experts"] > 2 * stats["decode_misses"] > 0
    assert stats["decode_cpu_pairs"] == stats["decode_cpu_experts"]  # one pair each: nothing double-counted


def test_auto_with_a_measured_cost_model_runs(shape):
    name, model_dir, inputs, expected = shape
    tokens, stats = run(model_dir, inputs, expert_budget=2 * layer_bytes(SPECS[name]), miss_policy="auto")
    assert torch.equal(tokens, expected)
    total = sum(stats[f"{p}_{k}"] for p in ("prefill", "decode") for k in ("misses", "cpu_experts"))
    assert total > 0


def test_kt_style_rule_runs_every_routed_expert_on_the_cpu(tiny_dir, reference, image_inputs):
    model, _ = load(tiny_dir, "optimize_rules/qwen3vl-kt-cpu.yaml", **CPU)
    operators = [m for m in model.modules() if isinstance(m, CpuExperts)]
    assert len(operators) == SPECS["tiny-4x16"].layers
    with torch.no_grad():
        logits = model(**image_inputs).logits
        ref = reference[0](**image_inputs).logits
    assert (logits - ref).abs().max().item() <= 1e-5  # tiny-4x16's sizes leave kt-kernel out: torch, fp32
    stats = collect_stats(model)["operators"]["CpuExperts"]
    assert stats["calls"] == SPECS["tiny-4x16"].layers and stats["cpu_backend"].startswith("torch")


def test_bad_miss_policy_is_a_clear_error(tiny_dir):
    from vismmoe_kt.errors import RuleError

    with pytest.raises(RuleError, match="miss_policy 'sometimes' is not one of: wait, cpu, auto"):
        load(tiny_dir, HYBRID, miss_policy="sometimes", keep_ratio=1.0, **CPU)
    with pytest.raises(RuleError, match="cost_model needs numbers"):
        load(tiny_dir, HYBRID, miss_policy="auto", cost_model={"fetch_seconds": 1}, **CPU)


@pytest.mark.skipif(not __import__("cpu_kernels.isa", fromlist=["x"]).kt_kernel_installed(), reason="kt_kernel is not installed")
def test_kt_style_rule_with_kt_kernel(tmp_path):
    """tiny-6x64's sizes suit kt-kernel: BF16 kernels, so logits agree to BF16 precision."""
    model_dir = save_tiny_model(tmp_path / "m", "tiny-6x64", seed=0)
    ref, processor = build_tiny_model("tiny-6x64", seed=0)
    inputs = processor(text=["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    model, _ = load(model_dir, "optimize_rules/qwen3vl-kt-cpu.yaml", cpu_backend="kt-kernel", **CPU)
    with torch.no_grad():
        logits, expected = model(**inputs).logits, ref(**inputs).logits
    assert ((logits - expected).norm() / expected.norm()).item() < 3e-2
    stats = collect_stats(model)["operators"]["CpuExperts"]
    assert stats["cpu_backend"].startswith("kt-kernel") and stats["bytes_cpu_backend"] > 0


@pytest.mark.parametrize("backend", ["torch", pytest.param("kt-kernel", marks=pytest.mark.skipif(
    not __import__("cpu_kernels.isa", fromlist=["x"]).kt_kernel_installed(), reason="kt_kernel is not installed"))])
def test_kt_style_rule_decodes_on_the_lean_path_with_every_step_captured(tmp_path, backend):
    """The KTransformers-style rule file has the VisDecoder: its CPU expert layers are capturable, so
    the lean step's CPU twin of the graphs replays every step, with the tokens of an eager run;
    `cpu_infer` sets kt-kernel's worker count."""
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.engine.decoding import decode_engine

    model_dir = save_tiny_model(tmp_path / "m", "tiny-6x64", seed=0)
    _, processor = build_tiny_model("tiny-6x64", seed=0)
    inputs = processor(text=["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    tokens = {}
    for graphs in ("replay", "off"):
        model, _ = load(model_dir, "optimize_rules/qwen3vl-kt-cpu.yaml", cpu_backend=backend, graphs=graphs,
                        cpu_infer=1, **CPU)
        with torch.no_grad():
            tokens[graphs] = generate(model, dict(inputs), 12, min_new_tokens=12)
        stats = decode_engine(model).stats()
        if graphs == "replay":
            assert stats["graphed_steps"] == stats["steps"] == 11 and stats["eager_pieces_per_step"] == 0
        if backend == "kt-kernel":
            assert model.vismmoe.context.cpu_backend.plan.workers == 1
    assert torch.equal(tokens["replay"], tokens["off"])

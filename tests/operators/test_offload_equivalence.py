"""The offload runtime on the CPU gives the reference model's logits and 32 greedy tokens at every budget.

Budgets run from "everything fits" (every layer pinned, no transfers) down to the smallest the
runtime accepts: one pinned layer plus one layer of slabs for `vismmoe` (Eq. 10 with L_semantic=1,
C_safe=one layer), one layer of slabs for `lru`; at the minimum a decode step evicts every step.
"""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.errors import RuleError
from vismmoe_kt.operators.vis_experts import VisExperts
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS

from conftest import layer_bytes, tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
RULES = {"vismmoe": "optimize_rules/qwen3vl-offload.yaml", "lru": "optimize_rules/qwen3vl-lru.yaml"}


@pytest.fixture(scope="module", params=["tiny-4x16", "tiny-6x64"])
def shape(request, tmp_path_factory):
    name = request.param
    model_dir, ref, inputs = tiny_case(tmp_path_factory, name, 1, "What is in the picture?", (160, 128), 2)
    with torch.no_grad():
        expected = (ref(**inputs).logits, ref.generate(**inputs, max_new_tokens=32, do_sample=False))
    return name, model_dir, inputs, expected


CASES = [  # (policy, budget in layers of experts, extra kwargs, expect transfers)
    ("vismmoe", "all", {}, False),
    ("vismmoe", 3, {}, True),
    ("vismmoe", 2, {}, True),                     # the minimum: 1 pinned + 1 layer of slabs
    ("vismmoe", 2.5, {"pinned_layers": 1}, True),
    ("lru", 1, {}, True),                         # the minimum for lru: 1 layer of slabs
]


@pytest.mark.parametrize("policy,layers,extra,transfers", CASES)
def test_offloaded_model_matches_reference(shape, policy, layers, extra, transfers):
    name, model_dir, inputs, (ref_logits, ref_tokens) = shape
    spec = SPECS[name]
    budget = layer_bytes(spec) * (spec.layers if layers == "all" else layers)
    model, _ = load(model_dir, RULES[policy], expert_budget=int(budget), **extra, **CPU)
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, ref_tokens)
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["count"] == spec.layers
    assert (stats["bytes_copied"] > 0) == transfers
    if layers == 2 and policy == "vismmoe":
        assert stats["pinned_layers"] == 1 and stats["slabs"] == spec.experts
        assert stats["evictions"] > 0 and stats["decode_misses"] > 0
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    runtime.cache.check_invariants()
    assert not any(p.is_meta for p in model.parameters())


def test_budget_below_the_minimum_is_a_clear_error_at_load(tiny_dir):
    minimum = 2 * layer_bytes(SPECS["tiny-4x16"])
    with pytest.raises(RuleError, match=r"VisExperts rejects .* expert budget .* is too small: .* at least .* \(%d bytes\)" % minimum):
        load(tiny_dir, RULES["vismmoe"], expert_budget=minimum - 1, **CPU)
    with pytest.raises(RuleError, match=r"expert budget .* is too small: .* \(%d bytes\)" % layer_bytes(SPECS["tiny-4x16"])):
        load(tiny_dir, RULES["lru"], expert_budget=layer_bytes(SPECS["tiny-4x16"]) - 1, **CPU)


def test_bad_runtime_kwargs_are_clear_errors(tiny_dir):
    with pytest.raises(RuleError, match=r"not a byte size: 'lots'"):
        load(tiny_dir, RULES["vismmoe"], expert_budget="lots", **CPU)
    with pytest.raises(RuleError, match=r"policy 'fifo' is not one of: vismmoe, lru"):
        load(tiny_dir, RULES["vismmoe"], policy="fifo", **CPU)
    with pytest.raises(RuleError, match=r"pinned_layers=4 is outside the valid range"):
        load(tiny_dir, RULES["vismmoe"], expert_budget=3 * layer_bytes(SPECS["tiny-4x16"]), pinned_layers=4, **CPU)


def test_row_chunks_respect_the_group_limit():
    from vismmoe_kt.runtime.expert_compute import row_chunks

    counts = [(5, 2), (1500, 1), (3, 4), (1027, 3), (2000, 5)]
    chunks = row_chunks(counts, max_groups=1024)
    # rows sorted: 3(4) 5(2) 1027(3) 1500(1) 2000(5); pairs in that order 0..15
    assert chunks == [(3, 6, 0, 6), (1027, 2001, 6, 15)]
    assert all(hi - lo <= 1024 for lo, hi, _, _ in chunks)


def test_chunked_bank_compute_equals_one_call(reference):
    """The same routed experts spread over a bank of more rows than one grouped GEMM takes."""
    from vismmoe_kt.runtime.expert_compute import bank_experts, row_chunks

    experts = reference[0].model.language_model.layers[0].mlp.experts
    E = experts.num_experts
    torch.manual_seed(3)
    hidden = torch.randn(7, experts.hidden_dim)
    index = torch.stack([torch.randperm(E)[:4] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 4), dim=-1)
    placement = torch.randperm(2500)[:E]  # expert e sits at bank row placement[e]
    gate_up = torch.zeros(2500, *experts.gate_up_proj.shape[1:])
    down = torch.zeros(2500, *experts.down_proj.shape[1:])
    gate_up[placement], down[placement] = experts.gate_up_proj.detach(), experts.down_proj.detach()
    used, pairs = torch.unique(index, return_counts=True)
    chunks = row_chunks(list(zip(placement[used].tolist(), pairs.tolist())), max_groups=1024)
    assert len(chunks) > 1
    with torch.no_grad():
        out = bank_experts(hidden, index, weights, placement, gate_up, down, experts.act_fn, chunks)
        ref = experts(hidden, index, weights)
    assert (out - ref).abs().max().item() <= 1e-5

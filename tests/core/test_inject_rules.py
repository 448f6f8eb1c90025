import types
"""Rule semantics, one test per rule of KTransformers' optimize rules (see vismmoe_kt/core/inject.py)."""

import pytest
import torch
from torch import nn

from toy_modules import Block, Scaled, Toy
from vismmoe_kt.core.inject import RuleWarning, inject, plan_rules

DEV = {"generate_device": "cpu", "prefill_device": "cpu"}
SCALED = "toy_modules.Scaled"


def test_every_module_gets_an_entry_and_unmatched_ones_get_the_default_device():
    model = Toy(2)
    plan = plan_rules(model, [], default_device="meta")
    names = {name for name, _ in model.named_modules()}
    assert set(plan) == names and "" in plan
    assert all(entry == {"class": "default", "kwargs": {"generate_device": "meta", "prefill_device": "meta"}}
               for entry in plan.values())


def test_first_matching_rule_wins_even_when_a_later_rule_is_more_specific():
    rules = [
        {"match": {"name": r"layers\.1\b"}, "replace": {"class": "default", "kwargs": {"generate_device": "cpu"}}},
        {"match": {"name": r"^layers\.1\.mlp$"}, "replace": {"class": SCALED}},
    ]
    with pytest.warns(RuleWarning, match="rule 1: applies to no module"):
        plan = plan_rules(Toy(2), rules)
    assert plan["layers.1.mlp"] == {"class": "default", "kwargs": {"generate_device": "cpu"}}


def test_name_is_re_search_so_it_matches_substrings():
    rules = [{"match": {"name": r"layers\.1"}, "replace": {"class": "default", "kwargs": {"generate_device": "x"}}}]
    plan = plan_rules(Toy(12), rules, default_device="d")
    hit = {name for name, entry in plan.items() if entry["kwargs"].get("generate_device") == "x"}
    assert "layers.10.attn" in hit and "layers.1.mlp.0" in hit and "layers.11" in hit
    assert "layers.2" not in hit and "layers.0.attn" not in hit


def test_class_match_uses_isinstance():
    rules = [{"match": {"class": "torch.nn.Linear"}, "replace": {"class": "default", "kwargs": {"generate_device": "lin"}}}]
    plan = plan_rules(Toy(2), rules, default_device="d")
    linear = {name for name, entry in plan.items() if entry["kwargs"]["generate_device"] == "lin"}
    assert linear == {name for name, m in Toy(2).named_modules() if isinstance(m, nn.Linear)}


def test_name_and_class_must_both_hold():
    rules = [{"match": {"name": r"^layers\.0", "class": "torch.nn.Linear"},
              "replace": {"class": "default", "kwargs": {"generate_device": "both"}}}]
    plan = plan_rules(Toy(2), rules, default_device="d")
    both = {name for name, entry in plan.items() if entry["kwargs"]["generate_device"] == "both"}
    assert both == {"layers.0.attn", "layers.0.mlp.0", "layers.0.mlp.2"}


def test_replace_default_keeps_the_module_and_only_records_kwargs():
    model = Toy(2)
    before = dict(model.named_modules())
    rules = [{"match": {"name": "mlp$"}, "replace": {"class": "default", "kwargs": DEV}}]
    plan = inject(model, rules, config=None, default_device="cpu")
    assert dict(model.named_modules()) == before
    assert plan["layers.0.mlp"] == {"class": "default", "kwargs": DEV}


def test_kwargs_are_deep_copied_per_module():
    model = Toy(2)
    rules = [{"match": {"name": r"^layers\.\d+\.mlp$"}, "replace": {"class": SCALED, "kwargs": {"tags": ["a"], **DEV}}}]
    inject(model, rules, config=None)
    model.layers[0].mlp.tags.append("changed")
    assert model.layers[1].mlp.tags == ["a"]
    assert rules[0]["replace"]["kwargs"]["tags"] == ["a"]


def test_recursive_false_hides_children_from_later_rules():
    rules = [
        {"match": {"name": r"^layers\.0$"}, "replace": {"class": "default", "kwargs": DEV}, "recursive": False},
        {"match": {"name": r"mlp"}, "replace": {"class": SCALED, "kwargs": DEV}},
    ]
    model = Toy(2)
    plan = inject(model, rules, config=None)
    assert not any(name.startswith("layers.0.") for name in plan)
    assert isinstance(model.layers[0].mlp, nn.Sequential)  # untouched
    assert isinstance(model.layers[1].mlp, Scaled)


def test_recursive_default_continues_into_children_of_a_replaced_module():
    rules = [
        {"match": {"name": r"^layers\.0$"}, "replace": {"class": SCALED, "kwargs": DEV}},
        {"match": {"name": r"^layers\.0\.mlp$"}, "replace": {"class": SCALED, "kwargs": {"factor": 3.0, **DEV}}},
    ]
    model = Toy(2)
    inject(model, rules, config=None)
    assert isinstance(model.layers[0], Scaled)
    # the child is injected into the original module, which the operator keeps as orig_module
    assert isinstance(model.layers[0].orig_module.mlp, Scaled)
    assert model.layers[0].orig_module.mlp.factor == 3.0


def test_operator_receives_the_upstream_constructor_arguments():
    model, config, loader = Toy(2), object(), types.SimpleNamespace()  # any object that can hold attributes
    original = model.layers[1].mlp
    rules = [{"match": {"name": r"^layers\.1\.mlp$"}, "replace": {"class": SCALED, "kwargs": {"factor": 5, **DEV}}}]
    inject(model, rules, config=config, loader=loader)
    op = model.layers[1].mlp
    assert (op.key, op.gguf_loader, op.config, op.orig_module) == ("layers.1.mlp", loader, config, original)
    assert (op.factor, op.generate_device, op.prefill_device) == (5, "cpu", "cpu")


def test_injected_operator_changes_the_forward_result():
    model = Toy(2)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(x)
        rules = [{"match": {"name": r"^head$"}, "replace": {"class": SCALED, "kwargs": {"factor": 2.0, **DEV}}}]
        inject(model, rules, config=None)
        assert torch.allclose(model(x), 2 * ref)


def test_rules_from_a_yaml_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        '- match:\n    name: "^head$"\n  replace:\n    class: toy_modules.Scaled\n'
        '    kwargs:\n      factor: 4.0\n      generate_device: "cpu"\n'
    )
    model = Toy(1)
    plan = inject(model, str(path), config=None)
    assert plan["head"]["class"] == SCALED and model.head.factor == 4.0


def test_overrides_set_devices_everywhere_and_replace_existing_kwargs():
    model = Toy(2)
    rules = [{"match": {"name": r"^layers\.\d+\.mlp$"}, "replace": {"class": SCALED, "kwargs": {"factor": 2.0, "generate_device": "a"}}}]
    plan = inject(model, rules, config=None, overrides={"generate_device": "cpu", "prefill_device": "cpu", "factor": 7.0})
    assert all(e["kwargs"]["generate_device"] == "cpu" and e["kwargs"]["prefill_device"] == "cpu" for e in plan.values())
    assert model.layers[0].mlp.factor == 7.0 and model.layers[1].mlp.factor == 7.0


def test_plan_rules_is_pure():
    model = Toy(2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    plan_rules(model, [{"match": {"name": "mlp$"}, "replace": {"class": SCALED}}])
    assert dict(model.named_modules()) == modules
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_block_class_is_importable_for_class_rules():
    rules = [{"match": {"class": "toy_modules.Block"}, "replace": {"class": "default", "kwargs": {"generate_device": "b"}}}]
    plan = plan_rules(Toy(3), rules, default_device="d")
    assert [n for n, e in plan.items() if e["kwargs"]["generate_device"] == "b"] == ["layers.0", "layers.1", "layers.2"]
    assert isinstance(Toy(1).layers[0], Block)

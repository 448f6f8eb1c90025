"""Bad rule files and overrides give errors that name the file, the rule index and the problem."""

import warnings

import pytest

from toy_modules import Toy
from vismmoe_kt.errors import RuleError
from vismmoe_kt.core.inject import RuleWarning, inject, plan_rules, read_rules

DEV = {"generate_device": "cpu", "prefill_device": "cpu"}


def write(tmp_path, text):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


def test_unreadable_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "- match: {name: [unclosed\n")
    with pytest.raises(RuleError, match=r"rules\.yaml: not valid YAML"):
        read_rules(path)


def test_missing_rule_file():
    with pytest.raises(RuleError, match="cannot read rule file /nonexistent/rules.yaml"):
        read_rules("/nonexistent/rules.yaml")


def test_top_level_must_be_a_list(tmp_path):
    with pytest.raises(RuleError, match="a YAML list of rules, got dict"):
        read_rules(write(tmp_path, "match: {name: x}\n"))


def test_rule_without_match(tmp_path):
    path = write(tmp_path, "- match: {name: head}\n  replace: {class: default}\n- replace: {class: default}\n")
    with pytest.raises(RuleError, match=r"rules\.yaml, rule 1: 'match' must have at least one of 'name' and 'class'"):
        read_rules(path)


def test_rule_without_replace():
    with pytest.raises(RuleError, match=r"rule 0: 'replace' is required"):
        read_rules([{"match": {"name": "x"}}])


def test_unknown_keys_are_errors_not_silently_ignored():
    with pytest.raises(RuleError, match=r"rule 0: unknown keys in 'replace': \['kwarg'\]"):
        read_rules([{"match": {"name": "x"}, "replace": {"class": "default", "kwarg": {}}}])
    with pytest.raises(RuleError, match=r"rule 0: unknown keys \['recurse'\]"):
        read_rules([{"match": {"name": "x"}, "replace": {"class": "default"}, "recurse": False}])


def test_bad_regex():
    with pytest.raises(RuleError, match=r"rule 0: bad regex '\(unclosed' in match.name"):
        read_rules([{"match": {"name": "(unclosed"}, "replace": {"class": "default"}}])


def test_match_class_that_does_not_import():
    with pytest.raises(RuleError, match=r"rule 0: class path 'no_such_pkg.Thing' does not import: ModuleNotFoundError"):
        read_rules([{"match": {"class": "no_such_pkg.Thing"}, "replace": {"class": "default"}}])
    with pytest.raises(RuleError, match=r"module 'torch.nn' has no 'Lineer'"):
        read_rules([{"match": {"class": "torch.nn.Lineer"}, "replace": {"class": "default"}}])


def test_replace_class_that_does_not_import_names_the_rule():
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "vismmoe_kt.operators.nope.Missing", "kwargs": DEV}}]
    with pytest.raises(RuleError, match=r"<rules>, rule 0: class path 'vismmoe_kt.operators.nope.Missing' does not import"):
        inject(Toy(1), rules, config=None)


def test_replace_class_that_is_not_a_module():
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "collections.OrderedDict"}}]
    with pytest.raises(RuleError, match="is not an nn.Module class"):
        inject(Toy(1), rules, config=None)


def test_operator_rejecting_kwargs_names_rule_operator_and_module():
    rules = [
        {"match": {"name": "^embed$"}, "replace": {"class": "default", "kwargs": DEV}},
        {"match": {"name": "^head$"}, "replace": {"class": "toy_modules.Scaled", "kwargs": {"factr": 2.0}}},
    ]
    model = Toy(1)
    with pytest.raises(RuleError, match=r"rule 1: Scaled rejects kwargs \{'factr': 2.0\} for module 'head': unexpected kwargs \['factr'\]"):
        inject(model, rules, config=None)


def test_operator_raising_in_its_constructor_names_rule_and_reason():
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "toy_modules.Exploding"}}]
    with pytest.raises(RuleError, match="rule 0: Exploding rejects kwargs .* refuses every module"):
        inject(Toy(1), rules, config=None)


def test_rule_matching_nothing_is_a_warning_not_an_error():
    rules = [{"match": {"name": "no_such_module"}, "replace": {"class": "default"}}]
    with pytest.warns(RuleWarning, match=r"rule 0: applies to no module of Toy"):
        plan = plan_rules(Toy(1), rules)
    assert "head" in plan


def test_rules_that_match_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_rules(Toy(1), [{"match": {"name": "head"}, "replace": {"class": "default"}}])


def test_unknown_override_lists_the_known_kwargs():
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "toy_modules.Scaled", "kwargs": {"factor": 2.0, **DEV}}}]
    with pytest.raises(RuleError, match=r"override 'facter' is not a kwarg of any rule; known kwargs: factor"):
        inject(Toy(1), rules, config=None, overrides={"facter": 3})


def test_root_cannot_be_replaced():
    with pytest.raises(RuleError, match="root module cannot be replaced"):
        inject(Toy(1), [{"match": {"name": "^$"}, "replace": {"class": "toy_modules.Scaled"}}], config=None)


def test_failed_injection_leaves_the_model_intact():
    model = Toy(2)
    before = dict(model.named_modules())
    rules = [  # the first rule's operators build fine; the last one fails after them
        {"match": {"name": r"^layers\.\d+\.mlp$"}, "replace": {"class": "toy_modules.Scaled", "kwargs": DEV}},
        {"match": {"name": "^head$"}, "replace": {"class": "toy_modules.Scaled", "kwargs": {"bad": 1}}},
    ]
    with pytest.raises(RuleError):
        inject(model, rules, config=None)
    assert dict(model.named_modules()) == before


def test_replace_class_that_is_not_an_operator_fails_when_applied():
    """nn.Identity takes (*args, **kwargs): it would be built and only fail (or do nothing) at forward."""
    model = Toy(1)
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "torch.nn.Identity"}}]
    with pytest.raises(RuleError, match=r"<rules>, rule 0: replace.class 'torch.nn.Identity' is not an injectable "
                                        r"operator: expected a subclass of vismmoe_kt.operators.base.BaseInjectedModule, "
                                        r"or a class whose constructor takes \(key, gguf_loader, config, orig_module"):
        inject(model, rules, config=None)
    assert type(model.head).__name__ == "Linear"


def test_rule_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x80" * 50)
    with pytest.raises(RuleError, match=r"cannot read rule file .*rules\.yaml: not UTF-8 text"):
        read_rules(path)


def test_deeply_nested_yaml_is_refused(tmp_path):
    with pytest.raises(RuleError, match=r"rules\.yaml: not a rule file: its YAML is nested too deeply"):
        read_rules(write(tmp_path, "[" * 20000 + "]" * 20000))


def billion_laughs(levels=9):
    """Half a KB of YAML that stands for 9**levels strings once its aliases are expanded."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f"      {names[0]}: &{names[0]} [{', '.join(['lol'] * 9)}]"]
    lines += [f"      {b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip(names, names[1:])]
    return "- match: {name: '^head$'}\n  replace:\n    class: toy_modules.Exploding\n    kwargs:\n" + "\n".join(lines) + "\n"


def test_billion_laughs_rule_file_is_refused_without_expanding_it(tmp_path):
    path = write(tmp_path, billion_laughs())
    assert path.stat().st_size < 1200
    with pytest.raises(RuleError, match=r"rules\.yaml: the YAML has over 100,000 values once its aliases \(\*name\) are expanded"):
        read_rules(path)
    (rule,) = read_rules(write(tmp_path, billion_laughs(levels=3)))  # 9**3 values: aliases as such are fine
    assert len(rule.kwargs["c"]) == 9


def test_error_messages_quote_long_kwargs_in_short():
    rules = [{"match": {"name": "^head$"}, "replace": {"class": "toy_modules.Exploding",
                                                       "kwargs": {"tags": list(range(100_000)), "note": "x" * 10_000}}}]
    with pytest.raises(RuleError, match=r"Exploding rejects kwargs \{'note': 'xxx.*\.\.\..*'tags': \[0, 1, 2, .*\.\.\.\]\} "
                                        r"for module 'head': this operator refuses every module") as exc:
        inject(Toy(1), rules, config=None)
    assert len(str(exc.value)) < 1000

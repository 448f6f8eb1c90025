"""Injection rules: YAML placement rules -> a plan (plain data) -> operators swapped into a model.

The schema and semantics are KTransformers' optimize rules, so rule files move between the two:

    - match:
        name: "^model\\.language_model\\.layers\\.\\d+\\.mlp\\.experts$"   # re.search on the dotted name
        class: transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts
      replace:
        class: vismmoe_kt.operators.vis_experts.VisExperts                 # or "default"
        kwargs: {generate_device: "cuda:0", expert_budget: "16GiB"}
      recursive: False

Semantics (each one tested in tests/core/test_inject_rules.py):
- rules are tried in order for every module, parents before children; the first match wins, even
  when a later rule is more specific;
- a rule that applies to no module is a RuleWarning, not an error;
- `match.name` is `re.search` on the dotted module name ("" is the root), so it matches substrings;
- `match.class` is a dotted import path tested with `isinstance`; with both keys, both must hold;
- `replace.class: default` (or no class) keeps the module and only records its kwargs (devices);
- `replace.kwargs` is deep-copied per module, so operators never share mutable kwargs;
- `recursive: False` stops the descent: children of that module are not visited by any rule;
- modules no rule matches get `{"class": "default", "kwargs": {generate_device, prefill_device}}`
  with the default device. (Upstream forgets to pass its default device down the recursion; we pass
  it, so `default_device="cpu"` means what it says.)

Rule files are code-equivalent: a rule names classes that get imported, like a Python import list.
Only load rule files you trust. The YAML itself is parsed with `yaml.safe_load`, and a document that
would have over MAX_YAML_VALUES values once its aliases are expanded is refused. A replacement class
must be an operator: a BaseInjectedModule, or a class whose constructor names KTransformers' arguments.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import reprlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from ..errors import RuleError

DEFAULT = "default"
# A rule file has tens of values. YAML aliases share one parsed object among all the places that name it, so
# a 1 KB document can stand for billions of values ("billion laughs"): anything that walks or prints them
# (deepcopy of kwargs, an error message) would run for minutes and run out of memory.
MAX_YAML_VALUES = 100_000
OPERATOR_ARGS = ("key", "gguf_loader", "config", "orig_module")  # KTransformers' BaseInjectedModule constructor

_short_repr = reprlib.Repr()  # error messages quote kwargs, which come from a file: keep them a line long
_short_repr.maxlevel, _short_repr.maxdict, _short_repr.maxlist, _short_repr.maxstring = 3, 12, 8, 120
_short_repr.maxother = 120
short = _short_repr.repr


class RuleWarning(UserWarning):
    """A rule that is valid but probably not what its author meant (e.g. it matches nothing)."""


@dataclass
class Rule:
    """One validated rule; `index` and `source` exist so that every error can point at it."""

    index: int
    source: str
    name_pattern: re.Pattern | None
    match_class: type | None
    replace_class: str
    kwargs: dict[str, Any]
    recursive: bool | None
    matched: int = field(default=0, compare=False)

    def where(self) -> str:
        return f"{self.source}, rule {self.index}"

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.match_class is not None and not isinstance(module, self.match_class):
            return False
        if self.name_pattern is not None and self.name_pattern.search(name) is None:
            return False
        return True


def import_dotted(path: str, where: str) -> Any:
    """Import `package.module.Attr`; errors say which rule asked for it."""
    if not isinstance(path, str) or "." not in path:
        raise RuleError(f"{where}: class path {short(path)} must be a dotted path like 'package.module.Class'")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or an error raised while importing that module
        raise RuleError(f"{where}: class path {path!r} does not import: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RuleError(f"{where}: class path {path!r} does not import: module {module_name!r} has no {attr!r}") from None


def read_rules(rules: str | Path | list) -> list[Rule]:
    """Parse and validate rules given as a YAML file path or an already-parsed list."""
    if isinstance(rules, (str, Path)):
        source = str(rules)
        try:
            text = Path(rules).read_text(encoding="utf-8")
        except OSError as exc:
            raise RuleError(f"cannot read rule file {source}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise RuleError(f"cannot read rule file {source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RuleError(f"{source}: not valid YAML: {exc}") from None
        except RecursionError:  # PyYAML composes recursively: thousands of nested brackets
            raise RuleError(f"{source}: not a rule file: its YAML is nested too deeply") from None
        check_yaml_size(data, source)
        if data is None or data == []:  # an empty file, or only comments: most likely the wrong file
            raise RuleError(f"rule file {source} has no rules (it is empty); leave out --optimize_config_path "
                            f"(or --placement) to run every module as the checkpoint has it")
    else:
        source, data = "<rules>", rules
    if data is None:
        data = []
    if not isinstance(data, list):
        raise RuleError(f"{source}: a rule file is a YAML list of rules, got {type(data).__name__}")
    return [_parse_rule(i, raw, source) for i, raw in enumerate(data)]


def check_yaml_size(data: Any, where: str, error: type[Exception] = RuleError, limit: int = MAX_YAML_VALUES) -> None:
    """Refuse parsed YAML that would have over `limit` values if its aliases were expanded.

    Counts without expanding: a walk over the shared objects that stops at the limit, so it takes at
    most `limit` steps and its stack holds at most `limit` containers (it remembers nothing else)."""
    count, stack = 1, [data] if isinstance(data, (dict, list)) else []
    while stack:
        node = stack.pop()
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        count += len(children)
        if count > limit:
            raise error(f"{where}: the YAML has over {limit:,} values once its aliases (*name) are expanded; "
                        f"refusing it")
        stack.extend(child for child in children if isinstance(child, (dict, list)))


def _parse_rule(index: int, raw: Any, source: str) -> Rule:
    where = f"{source}, rule {index}"
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: a rule is a mapping with 'match' and 'replace', got {type(raw).__name__}")
    unknown = set(raw) - {"match", "replace", "recursive"}
    if unknown:
        raise RuleError(f"{where}: unknown keys {sorted(unknown)} (allowed: match, replace, recursive)")
    match = raw.get("match")
    if not isinstance(match, dict) or not ({"name", "class"} & set(match)):
        raise RuleError(f"{where}: 'match' must have at least one of 'name' and 'class'")
    unknown = set(match) - {"name", "class"}
    if unknown:
        raise RuleError(f"{where}: unknown keys in 'match': {sorted(unknown)} (allowed: name, class)")
    if "replace" not in raw or not isinstance(raw["replace"], dict):
        raise RuleError(f"{where}: 'replace' is required and must be a mapping (use class: default to keep the module)")
    replace = raw["replace"]
    unknown = set(replace) - {"class", "kwargs"}
    if unknown:
        raise RuleError(f"{where}: unknown keys in 'replace': {sorted(unknown)} (allowed: class, kwargs)")

    pattern = None
    if "name" in match:
        try:
            pattern = re.compile(str(match["name"]))
        except re.error as exc:
            raise RuleError(f"{where}: bad regex {match['name']!r} in match.name: {exc}") from None
    match_class = None
    if "class" in match:
        match_class = import_dotted(match["class"], where)
        if not isinstance(match_class, type):
            raise RuleError(f"{where}: match.class {match['class']!r} is not a class")
    kwargs = replace.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RuleError(f"{where}: replace.kwargs must be a mapping, got {type(kwargs).__name__}")
    recursive = raw.get("recursive")
    if recursive is not None and not isinstance(recursive, bool):
        raise RuleError(f"{where}: 'recursive' must be true or false, got {short(recursive)}")
    return Rule(index, source, pattern, match_class, str(replace.get("class", DEFAULT)), kwargs, recursive)


def _build_plan(model: nn.Module, rules: list[Rule], default_device: str) -> tuple[dict, dict]:
    """Walk the module tree like upstream's gen_optimize_config; also remember which rule made each entry."""
    plan: dict[str, dict] = {}
    made_by: dict[str, Rule] = {}

    def visit(module: nn.Module, name: str) -> None:
        recursive = True
        for rule in rules:
            if not rule.matches(name, module):
                continue
            rule.matched += 1
            plan[name] = {"class": rule.replace_class, "kwargs": copy.deepcopy(rule.kwargs)}
            made_by[name] = rule
            if rule.recursive is not None:
                recursive = rule.recursive
            break
        else:
            plan[name] = {"class": DEFAULT, "kwargs": {"generate_device": default_device, "prefill_device": default_device}}
        if recursive:
            for child_name, child in module._modules.items():
                if child is not None:
                    visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    for rule in rules:
        if rule.matched == 0:
            warnings.warn(f"{rule.where()}: applies to no module of {type(model).__name__} (it matches none, or an "
                          f"earlier rule wins for every module it matches)", RuleWarning, stacklevel=3)
    return plan, made_by


def plan_rules(model: nn.Module, rules: str | Path | list, default_device: str = "cuda:0") -> dict[str, dict]:
    """Map every module name the rules cover to {"class": path or "default", "kwargs": {...}}.

    Pure: the model is only read. `rules` is a YAML path or an already-parsed list of rules.
    """
    plan, _ = _build_plan(model, read_rules(rules), default_device)
    return plan


DEVICE_KEYS = ("generate_device", "prefill_device")  # set on every module, whether its rule names them or not


def check_override_keys(kwargs: list[dict[str, Any]], overrides: Any) -> None:
    """Every override is a device key or a kwarg that one of `kwargs` (the rules' or plan entries') sets,
    else a RuleError naming it and the kwargs there are."""
    for key in overrides:
        if key not in DEVICE_KEYS and not any(key in entry for entry in kwargs):
            known = sorted({k for entry in kwargs for k in entry} - set(DEVICE_KEYS))
            raise RuleError(f"override {key!r} is not a kwarg of any rule; known kwargs: {', '.join(known) or 'none'}")


def apply_overrides(plan: dict[str, dict], overrides: dict[str, Any]) -> dict[str, dict]:
    """Apply user overrides on top of a plan (returns a new plan).

    `generate_device`/`prefill_device` set every module's devices; any other key replaces that kwarg
    wherever a rule set it. A key that no entry has is an error listing the keys that exist.
    """
    plan = copy.deepcopy(plan)
    check_override_keys([entry["kwargs"] for entry in plan.values()], overrides)
    for key, value in overrides.items():
        if key in DEVICE_KEYS:
            for entry in plan.values():
                entry["kwargs"][key] = value
            continue
        for entry in (entry for entry in plan.values() if key in entry["kwargs"]):
            entry["kwargs"][key] = copy.deepcopy(value)
    return plan


def inject(
    model: nn.Module,
    rules: str | Path | list,
    config: Any,
    loader: Any = None,
    default_device: str = "cuda:0",
    overrides: dict[str, Any] | None = None,
) -> dict[str, dict]:
    """Plan the rules, then construct each operator and swap it in. Returns the (overridden) plan.

    Operators are built as `cls(key=..., gguf_loader=loader, config=config, orig_module=child, **kwargs)`,
    the constructor of KTransformers' BaseInjectedModule. When a module is replaced and the rule lets
    the descent continue, its children are injected into the original module, which the operator
    keeps as `orig_module` (upstream behaves the same way).
    """
    rule_list = read_rules(rules)
    plan, made_by = _build_plan(model, rule_list, default_device)
    plan = apply_overrides(plan, overrides or {})

    # Build every operator before swapping any in, so a failing rule leaves the model untouched.
    swaps: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module._modules.items():
            if child is None or f"{prefix}{child_name}" not in plan:
                continue
            name = f"{prefix}{child_name}"
            if plan[name]["class"] != DEFAULT:
                swaps.append((module, child_name, _construct(name, plan[name], made_by.get(name), child, config, loader)))
            visit(child, name + ".")

    if plan.get("", {}).get("class", DEFAULT) != DEFAULT:
        raise RuleError(f"{made_by[''].where()}: the root module cannot be replaced; match a submodule instead")
    visit(model, "")
    for parent, child_name, operator in swaps:
        parent._modules[child_name] = operator  # works for ModuleList slots ("0", "1", ...) too
    if loader is not None and hasattr(loader, "device_map"):
        loader.device_map.update({name: dict(entry["kwargs"]) for name, entry in plan.items()})
    return plan


def _construct(name: str, entry: dict, rule: Rule | None, child: nn.Module, config: Any, loader: Any) -> nn.Module:
    where = rule.where() if rule else "override"
    cls = import_dotted(entry["class"], where)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise RuleError(f"{where}: replace.class {entry['class']!r} is not an nn.Module class")
    if not _is_operator_class(cls):
        # e.g. torch.nn.Identity takes (*args, **kwargs): it would be built, then fail (or do nothing) at forward
        raise RuleError(f"{where}: replace.class {entry['class']!r} is not an injectable operator: expected a subclass "
                        f"of vismmoe_kt.operators.base.BaseInjectedModule, or a class whose constructor takes "
                        f"({', '.join(OPERATOR_ARGS)}, prefill_device, generate_device, **kwargs) as KTransformers' "
                        f"operators do")
    kwargs = copy.deepcopy(entry["kwargs"])
    args = dict(key=name, gguf_loader=loader, config=config, orig_module=child)
    try:
        inspect.signature(cls).bind(**args, **kwargs)
    except TypeError as exc:
        raise RuleError(f"{where}: {cls.__name__} rejects kwargs {short(sorted(kwargs))} for module {name!r}: {exc}") from None
    try:
        return cls(**args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise RuleError(f"{where}: {cls.__name__} rejects kwargs {short(kwargs)} for module {name!r}: {exc}") from exc


def _is_operator_class(cls: type) -> bool:
    """Ours (marked `is_injected_operator`: the rule engine sits below the operators and does not import
    them), or a class (an upstream operator) whose constructor names the operator arguments itself."""
    if getattr(cls, "is_injected_operator", False):
        return True
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    named = {p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return set(OPERATOR_ARGS) <= named

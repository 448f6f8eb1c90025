"""A benchmark configuration: a rule file and the settings on top of it, as a user would load them.

On the command line a configuration is `NAME` or `NAME:key=value,key=value`:
  NAME    hf: the reference, stock transformers modules and loop, no rules (every other row's greedy
          tokens are compared with its) | a placement (vismmoe, gpu, offload, lru, hybrid, kt-cpu, realb, ep:
          `vismmoe-kt rules list`), resolved for the model's family exactly as `--placement` resolves it
          (the generated optimize_rules/<family>[-<placement>].yaml) | the path of a rule file (YAML)
  kwargs  what chat and serve take as `--set key=value` (values read as YAML scalars, so 16GiB, 30%, 0.5,
          off): rule kwargs (expert_budget, store_dtype, slab_format, pinned_layers, predictor,
          prefetch_min_probability, batch_experts, cpu_backend, cpu_dtype, miss_policy, ...), the engine's
          options (decode=lean|hf, graphs=auto|cuda|replay|off), cpu_infer=N; and load()'s gguf_path=DIR:
          the weights from that GGUF checkpoint (its config, its family's rules) instead of made in memory

A key that neither the rule file nor the loader knows is refused before anything loads, with the same
message `--set` gives; a value the operators refuse fails at that configuration's load, with theirs.
The spec as given labels the configuration's row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vismmoe_kt.apps.flags import parse_set
from vismmoe_kt.core.inject import read_rules
from vismmoe_kt.core.loader import check_overrides
from vismmoe_kt.core.placements import (PLACEMENTS, check_placement, family_for_model_type, family_of_model,
                                        placement_rules, routing_rule, rule_file_name)
from vismmoe_kt.errors import InputError, VismmoeError

REFERENCE = "hf"
GGUF_KEY = "gguf_path"  # load()'s own keyword: with it the configuration loads that checkpoint
OLD_NAMES = ("lean", "kt-cpu+")  # how configurations' names were spelled before (lean:16GiB, kt-cpu+int4)
OLD_SPELLINGS = " (the old spellings, e.g. lean:16GiB+q4k, and their translations: benchmarks/results/README.md)"
KT_KERNEL_BACKENDS = ("kt-kernel", "auto")  # cpu_backend values that may start kt-kernel (auto: where it imports)


@dataclass(frozen=True)
class Configuration:
    label: str                    # the spec as given: the row's name
    name: str                     # hf, a placement, or a rule file's path
    rules: list | str | None      # what load() gets: a placement's rule list, a path, or None (hf)
    rule_file: str | None         # the file it stands for (optimize_rules/qwen3vl-offload.yaml), for the record
    settings: dict[str, Any]      # the kwargs, as `--set` reads them

    @property
    def is_reference(self) -> bool:
        return self.name == REFERENCE

    @property
    def gguf_path(self) -> str | None:
        return self.settings.get(GGUF_KEY)

    def routed(self, routing: str, model_type: str) -> list | None:
        """The rules with a routing source's rule first (`vismmoe-kt rules show --routing`): `model` adds none;
        the reference gets the routing rule alone (every row replays the same requests' routing)."""
        if routing == "model":
            return self.rules
        family = family_of_model(self.gguf_path) if self.gguf_path else family_for_model_type(model_type)
        rules = [] if self.rules is None else \
            yaml.safe_load(Path(self.rules).read_text(encoding="utf-8")) if isinstance(self.rules, str) else self.rules
        return [routing_rule(family, routing), *rules]

    def uses_kt_kernel(self) -> bool:
        """Whether a rule's CPU experts may be kt-kernel's (whose weights outlive the model in the process)."""
        if self.rules is None:
            return False
        backends = [self.settings.get("cpu_backend", rule.kwargs["cpu_backend"]) for rule in read_rules(self.rules)
                    if "cpu_backend" in rule.kwargs]
        return any(backend in KT_KERNEL_BACKENDS for backend in backends)


def parse_configuration(spec: str, model_type: str) -> Configuration:
    """`NAME[:key=value,...]` for a model of `model_type` (its config's; with gguf_path, that checkpoint's)
    -> the configuration; anything wrong is an InputError that names the spec."""
    try:
        return _parse(spec, model_type)
    except VismmoeError as exc:
        raise InputError(f"--configs {spec}: {exc}") from None


def _parse(spec: str, model_type: str) -> Configuration:
    name, _, kwargs = spec.partition(":")
    path = name.endswith((".yaml", ".yml")) or "/" in name
    if name != REFERENCE and not path and name not in PLACEMENTS:
        raise InputError(f"unknown configuration {name!r}: {REFERENCE}, a placement ({', '.join(PLACEMENTS)}) or a rule "
                         f"file's path, then :key=value,...{OLD_SPELLINGS if name.startswith(OLD_NAMES) else ''}")
    items = [item for item in kwargs.split(",") if item.strip()]
    if any("=" not in item for item in items):  # lru:16GiB, hybrid:16GiB+cpu, kt-cpu:16: an old spelling
        raise InputError(f"{next(i for i in items if '=' not in i)!r} is not key=value{OLD_SPELLINGS}")
    settings = parse_set(items, flag="--configs")
    if name == REFERENCE:
        rules, rule_file = None, None
    elif path:
        if not Path(name).is_file():
            raise InputError(f"no such rule file {name}")
        rules = rule_file = name
    else:
        family = family_of_model(settings[GGUF_KEY]) if GGUF_KEY in settings else family_for_model_type(model_type)
        check_placement(family, name)
        rules, rule_file = placement_rules(family, name), f"optimize_rules/{rule_file_name(family, name)}"
    check_overrides(rules, {key: value for key, value in settings.items() if key != GGUF_KEY})
    return Configuration(spec, name, rules, rule_file, settings)

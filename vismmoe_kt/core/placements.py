"""Rule lists from (family, placement): the rule files under optimize_rules/ are this module's output.

A placement says where the routed experts live and which operator serves them; the family (its facts in
vismmoe_kt/models/placement_facts.py) says which modules the rules match. `placement_rules` is pure: the
same rules in the same order, as plain data in KTransformers' schema, every time. `vismmoe-kt rules show`
prints them as YAML (vismmoe_kt/core/rule_text.py), `--placement NAME` loads them, and a test checks that
every checked-in file parses to exactly them. A custom rule file still loads with --optimize_config_path.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..models.placement_facts import FAMILIES, PlacementFacts, facts_for_model_type

# every placement a family may have, in the order `rules list` shows them; "vismmoe" is `<family>.yaml`
PLACEMENTS = ("vismmoe", "gpu", "offload", "lru", "hybrid", "kt-cpu", "realb", "ep")
PLACEMENT_HELP = {
    "vismmoe": "the family's default: Qwen3-VL's hybrid with visual-token pruning, the others' lean decode path "
               "with every weight on the GPU",
    "gpu": "everything on the GPU, the stock modules and transformers' loop: the reference",
    "offload": "VisMMOE offload-only: experts in host memory, pinned prefix + slab cache + prefetch on the GPU",
    "lru": "baseline: the offload runtime as on-demand loading with an LRU cache",
    "hybrid": "VisMMOE hybrid: offload, and missing experts fetched or computed on the CPU by a cost model",
    "kt-cpu": "KTransformers-style: every routed expert on the CPU backend",
    "realb": "ReaLB: vision-heavy experts of overloaded (virtual) ranks in low precision",
    "ep": "expert parallelism under torchrun: each rank keeps 1/N of every layer's experts",
}

OPERATORS = "vismmoe_kt.operators"
VIS_DECODER = f"{OPERATORS}.vis_decoder.VisDecoder"
VISION_SALIENCY = f"{OPERATORS}.vis_decoder.VisionSaliency"
VIS_EXPERTS = f"{OPERATORS}.vis_experts.VisExperts"
VISION_EXPERTS = f"{OPERATORS}.vis_experts.VisionExperts"
CPU_EXPERTS = f"{OPERATORS}.cpu_experts.CpuExperts"
MIXED_PRECISION = f"{OPERATORS}.mixed_precision.MixedPrecisionExperts"
EP_EXPERTS = f"{OPERATORS}.ep_experts.ExpertParallelExperts"
SOURCE_ROUTER = f"{OPERATORS}.source_router.SourceRouter"

GPU = {"generate_device": "cuda:0", "prefill_device": "cuda:0"}
CPU = {"generate_device": "cpu", "prefill_device": "cpu"}

# each operator's kwargs as the rule files set them (the operators' settings dataclasses hold the defaults)
OFFLOAD_STORE = {"store_dtype": "auto", "slab_format": "auto"}
OFFLOAD_BATCH = {"batch_experts": "auto", "batch_table_pairs": 32}  # in the files so that `--set` can change them
OFFLOAD_DECODE = {"reservations": "auto"}
OFFLOAD_VISMMOE = {"policy": "vismmoe", "pinned_layers": "auto", "predictor": None, "prefetch_topk": 20,
                   "prefetch_min_probability": 0.7, "prefetch_stride": 1}
HYBRID = {"miss_policy": "auto", "cpu_backend": "torch", "cpu_dtype": "auto", "cost_model": None}
PRUNING = {"compression": "affinity", "keep_ratio": 0.5, "salient_ratio": None, "tradeoff": 2.0, "prune_layer": "auto"}
CPU_EXPERTS_KWARGS = {"cpu_backend": "auto", "cpu_dtype": "auto", "gpu_prefill_tokens": 0, "gpu_prefill_format": "auto",
                      "gpu_prefill_share": 1.0}
REALB = {"mode": "realb", "fixed_threshold": 0.7, "precision_backend": "auto", "ep_size": 4, "lb_gate_tokens": 2048,
         "fp4_scope": "vision_tokens", "md_start": 0.9, "md_min": 0.0, "eplb_redundant": None, "eplb_period": 8}
EP = {"expert_map": None, "mode": "bf16", "capture_exchange": False, "lb_gate_tokens": 2048, "eplb_period": 8,
      "eplb_window": 16, "eplb_async": False}


def families() -> list[str]:
    return list(FAMILIES)


def facts_of(family: str) -> PlacementFacts:
    if family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; the families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def placements_of(family: str) -> list[str]:
    """The placements `family` has rule files for, in PLACEMENTS' order."""
    missing = facts_of(family).missing
    return [name for name in PLACEMENTS if name not in missing]


def rule_file_name(family: str, placement: str) -> str:
    return f"{family}.yaml" if placement == "vismmoe" else f"{family}-{placement}.yaml"


def family_for_model_type(model_type: str | None, where: str = "config") -> str:
    facts = facts_for_model_type(model_type)
    if facts is None:
        known = ", ".join(f"{f.model_type} ({f.family})" for f in FAMILIES.values())
        raise InputError(f"{where}: no placements for model_type={model_type!r}; they exist for: {known}")
    return facts.family


def check_placement(family: str, placement: str) -> None:
    """An unknown placement, or one this family lacks, is an InputError naming the choices (and why it lacks it)."""
    facts = facts_of(family)
    if placement not in PLACEMENTS:
        raise InputError(f"unknown placement {placement!r}; the placements: {', '.join(PLACEMENTS)}")
    if placement in facts.missing:
        raise InputError(f"{family} has no {placement} placement ({facts.missing[placement]}); its placements: "
                         f"{', '.join(placements_of(family))}")


def _rule(name: str, replace: str, kwargs: dict[str, Any], match_class: str | None = None,
          recursive: bool | None = None) -> dict[str, Any]:
    match = {"name": name, **({"class": match_class} if match_class else {})}
    rule = {"match": match, "replace": {"class": replace, "kwargs": kwargs}}
    if recursive is not None:
        rule["recursive"] = recursive
    return rule


def _experts(facts: PlacementFacts, replace: str, kwargs: dict[str, Any], pattern: str | None = None) -> dict:
    return _rule(pattern or facts.experts, replace, kwargs, facts.experts_class, recursive=False)


def _decoder(facts: PlacementFacts, **kwargs: Any) -> dict:
    return _rule(facts.text_model, VIS_DECODER, {**GPU, "compression": "none", **kwargs})


def _everything_else() -> dict:
    return _rule(".*", "default", dict(GPU))


def _vis_experts(facts: PlacementFacts, placement: str) -> dict[str, Any]:
    kwargs = {**GPU, "expert_budget": facts.expert_budget, **OFFLOAD_STORE, **OFFLOAD_BATCH, **OFFLOAD_DECODE}
    # the reservations are `auto` (the boundary's upkeep between steps moved beside the step where that measures
    # faster, reservations.py: on GPUs it was 1.00-1.16x as fast), except the hybrid's, whose CPU quota follows each
    # step's misses
    if placement == "lru":
        return {**kwargs, "policy": "lru"}
    if placement == "hybrid":
        kwargs = {**kwargs, "reservations": "before-step"}
    # the default placement's eviction is `auto` (never slower than recency, eviction.py), and its pinned prefix may
    # be empty where the depth model predicts that faster (16 GiB of BF16: a pinned layer's 128 slabs cost more
    # misses than its own save); offload and hybrid keep VisMMOE's ranking and Eq. 10's L_semantic 1, as published
    if placement == "vismmoe":
        kwargs = {**kwargs, "min_pinned_layers": 0}
    eviction = {"eviction": "auto" if placement == "vismmoe" else "vismmoe"}
    return {**kwargs, **OFFLOAD_VISMMOE, **eviction, **(HYBRID if placement in ("hybrid", "vismmoe") else {})}


def _vision_experts(facts: PlacementFacts) -> list[dict]:
    """A second expert set's own small runtime (ERNIE's vision experts) beside an offloading placement."""
    if facts.vision_experts is None:
        return []
    kwargs = {**GPU, "expert_budget": facts.vision_experts_budget, "pinned_layers": 0, "policy": "lru"}
    return [_experts(facts, VISION_EXPERTS, kwargs, facts.vision_experts)]


def placement_rules(family: str, placement: str) -> list[dict[str, Any]]:
    """The rule list (KTransformers' schema, plain data) for `family` under `placement`."""
    check_placement(family, placement)
    facts = FAMILIES[family]
    if placement == "gpu":
        return [_everything_else()]
    if placement == "vismmoe" and facts.default == "lean":
        return [_decoder(facts), _everything_else()]
    if placement == "vismmoe":  # hybrid-pruned: the hybrid placement behind affinity-aware visual-token pruning
        saliency = _rule(facts.vision_tower, VISION_SALIENCY, dict(GPU))
        pruned = _rule(facts.text_model, VIS_DECODER, {**GPU, **PRUNING})
        return [saliency, pruned, _experts(facts, VIS_EXPERTS, _vis_experts(facts, placement)),
                *_vision_experts(facts), _everything_else()]
    if placement in ("offload", "lru", "hybrid"):
        experts = [_experts(facts, VIS_EXPERTS, _vis_experts(facts, placement)), *_vision_experts(facts)]
    elif placement == "kt-cpu":
        experts = [_experts(facts, CPU_EXPERTS, {**CPU, **CPU_EXPERTS_KWARGS}), *_vision_experts(facts)]
    elif placement == "realb":  # a second expert set holds the image tokens' experts: ReaLB switches only those
        experts = [_experts(facts, MIXED_PRECISION, {**GPU, **REALB}, facts.vision_experts)]
        return [_decoder(facts, keep_ratio=1.0), *experts, _everything_else()]
    else:  # ep: a second expert set (prefill's image tokens only) stays whole on every rank
        experts = [_experts(facts, EP_EXPERTS, {**GPU, **EP})]
    return [_decoder(facts), *experts, _everything_else()]


def routing_rule(family: str, routing: str, record: bool = False) -> dict[str, Any]:
    """The rule that puts a routing source on `family`'s MoE routers (synthetic or replayed routing for
    benchmarks on random weights; `model` with `record` to record the router's own): first in a rule list,
    before the catch-all."""
    return _rule(facts_of(family).router, SOURCE_ROUTER, {**GPU, "routing": routing, "record": record},
                 recursive=False)


def family_of_model(model_dir: Any) -> str:
    """The family of the checkpoint in `model_dir`, from its config.json's model_type."""
    import json
    from pathlib import Path

    config_file = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise InputError(f"cannot read the model's family from {config_file} "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    return family_for_model_type(model_type, where=str(config_file))

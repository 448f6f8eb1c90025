"""The configurations `python -m benchmarks.bench` compares, each as the rule list it loads.

Baselines (what users would otherwise run):
    all-on-gpu     stock Hugging Face modules, everything on the GPU (the ceiling; skipped when it does not fit)
    all-pinned     our runtime with a budget that pins every layer (our compute path, no transfers)
    accelerate     transformers/accelerate `device_map` offload capped by `max_memory` (the paper's "AC")
    kt-cpu         KTransformers-style: every routed expert on the CPU backend (the paper's "KT")
    lru            on-demand expert loading with an LRU cache (qwen3vl-lru.yaml)

VisMMOE's ablation (paper Table 4), each step adding one thing to the previous, in offload-only
(`vismmoe-*`: a missing expert is fetched and waited for) and hybrid mode (`hybrid-*`: the start-up
cost model may compute a missing expert on the CPU instead):
    *-base       pinned prefix (Eq. 10, at least one layer as in the paper, though the default rule file
                 allows none) + slab cache with safe eviction; on-demand fetches only
    *+compress   + affinity-aware visual-token compression (keep_ratio 0.5, after the prefix)
    *+predict    + prediction and prefetching, shallow: the next offloaded layer, one copy in flight
    *-full       + the full pipeline orchestration: deep lookahead (window 2, or the trained
                 predictor's top-B) with up to 16 copies in flight (the rule files' defaults)
A trained predictor (`--predictor`, from `vismmoe-kt calibrate`) replaces the history policy in
the +predict and -full steps.

Expert parallelism (under `torchrun --nproc-per-node N`; rank 0 measures, the other ranks follow):
    ep             every rank keeps 1/N of each layer's experts, BF16 (qwen3vl-ep.yaml)
    ep-graphs      ep with the decode steps' exchanges captured in their CUDA graphs (capture_exchange)
    ep-realb       the same with ReaLB on the group's real ranks; ep-realb-seq without the metadata
                   overlap, ep-fixed with a fixed M_d, ep-lowprec-all every pair in low precision
                   (FP4-All), ep-eplb replication instead of precision, ep-eplb-async with the weights moved beside
                   the next step (the paper's baselines)
Under torchrun only these run; without it they are rows skipped with the reason.

Each configuration names a rule file by its role (gpu, offload, lru, ladder, kt-cpu, ep); RULE_FILES gives
each model family's file for it. Qwen3-VL's ladder is qwen3vl.yaml (offload runtime, CPU misses and
visual-token compression); GLM-4.5V's and DeepSeek-OCR-2's is their offload file, which prunes no visual
tokens: there +compress adds nothing and -full is the deep prefetch alone (the run's notes say so).

Every configuration except all-on-gpu, all-pinned, kt-cpu and the ep ones takes the expert budget (bytes,
or a share of the model's routed experts such as 30%, which the offload runtime resolves). The
configurations on our runtime keep the rule files' VisDecoder (without pruning below +compress), so
they all decode through the lean path, as does kt-cpu (its rule file has the VisDecoder too); all-on-gpu
and accelerate use transformers' loop.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vismmoe_kt.errors import InputError

RULES_DIR = Path(__file__).resolve().parents[2] / "optimize_rules"
EXPERTS_OPERATOR = "vismmoe_kt.operators.vis_experts.VisExperts"
EP_OPERATOR = "vismmoe_kt.operators.ep_experts.ExpertParallelExperts"
COMPRESSION_OPERATORS = ("vismmoe_kt.operators.vis_decoder.VisionSaliency", "vismmoe_kt.operators.vis_decoder.VisDecoder")
PIN_EVERYTHING = "1TiB"  # more than any model's experts: Eq. 10 then pins every layer


DEFAULT_FAMILY = "qwen3_vl_moe"
# each model family's rule file (under optimize_rules/) for each role a configuration names
RULE_FILES: dict[str, dict[str, str]] = {
    "qwen3_vl_moe": {"gpu": "qwen3vl-gpu.yaml", "offload": "qwen3vl-offload.yaml", "lru": "qwen3vl-lru.yaml",
                     "ladder": "qwen3vl.yaml", "kt-cpu": "qwen3vl-kt-cpu.yaml", "ep": "qwen3vl-ep.yaml"},
    "deepseek_ocr2": {"gpu": "deepseek-ocr2-gpu.yaml", "offload": "deepseek-ocr2-offload.yaml",
                      "lru": "deepseek-ocr2-lru.yaml", "ladder": "deepseek-ocr2-offload.yaml",
                      "kt-cpu": "deepseek-ocr2-kt-cpu.yaml", "ep": "deepseek-ocr2-ep.yaml"},
    "glm4v_moe": {"gpu": "glm4v-gpu.yaml", "offload": "glm4v-offload.yaml", "lru": "glm4v-lru.yaml",
                  "ladder": "glm4v-offload.yaml", "kt-cpu": "glm4v-kt-cpu.yaml", "ep": "glm4v-ep.yaml"},
    "ernie4_5_vl_moe": {"gpu": "ernie45vl-gpu.yaml", "offload": "ernie45vl-offload.yaml", "lru": "ernie45vl-lru.yaml",
                        "ladder": "ernie45vl-offload.yaml", "kt-cpu": "ernie45vl-kt-cpu.yaml", "ep": "ernie45vl-ep.yaml"},
    "llama4": {"gpu": "llama4-gpu.yaml", "offload": "llama4-offload.yaml", "lru": "llama4-lru.yaml",
               "ladder": "llama4-offload.yaml", "kt-cpu": "llama4-kt-cpu.yaml", "ep": "llama4-ep.yaml"},
}


def rule_file(family: str, role: str) -> str:
    """The family's rule file for a role (a clear error for a family the benchmarks have no files for)."""
    if family not in RULE_FILES:
        raise InputError(f"the benchmarks have no rule files for model family {family!r} "
                         f"(they do for {', '.join(sorted(RULE_FILES))})")
    if role not in RULE_FILES[family]:
        raise InputError(f"model family {family!r} has no {role} rule file ({', '.join(RULE_FILES[family])})")
    return RULE_FILES[family][role]


def ladder_compresses(family: str) -> bool:
    """Whether the family's ladder file prunes visual tokens (has the VisionSaliency rule)."""
    rules = yaml.safe_load((RULES_DIR / rule_file(family, "ladder")).read_text(encoding="utf-8"))
    return any(r["replace"].get("class") == COMPRESSION_OPERATORS[0] for r in rules)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    description: str
    role: str                       # which of the family's rule files it loads (RULE_FILES)
    takes_budget: bool = True
    needs_cuda: bool = False        # meaningless without a GPU (skipped there, with this reason)
    compression: bool = False       # keep the VisionSaliency/VisDecoder rules of the rule file
    expert_kwargs: tuple = ()       # (key, value) pairs set on the VisExperts rule
    uses_predictor: bool = False    # gets `--predictor` when one is given
    accelerate: bool = False        # loaded on the host, then dispatched by accelerate
    operator: str = EXPERTS_OPERATOR  # the experts rule that expert_kwargs (and the budget) edit
    needs_group: bool = False       # expert parallel: runs under torchrun only

    def rules(self, budget: str | None, predictor: str | None = None,
              family: str = DEFAULT_FAMILY) -> list[dict[str, Any]]:
        """The rule list to load: the family's rule file with this configuration's edits applied."""
        rules = yaml.safe_load((RULES_DIR / rule_file(family, self.role)).read_text(encoding="utf-8"))
        if not self.compression:  # the decoder stays (it owns the decode path), without pruning
            rules = [r for r in rules if r["replace"].get("class") != COMPRESSION_OPERATORS[0]]
            for rule in rules:
                if rule["replace"].get("class") == COMPRESSION_OPERATORS[1]:
                    rule["replace"].setdefault("kwargs", {})["compression"] = "none"
        for rule in rules:
            if rule["replace"].get("class") != self.operator:
                continue
            kwargs = rule["replace"].setdefault("kwargs", {})
            kwargs.update(copy.deepcopy(dict(self.expert_kwargs)))
            if budget is not None:
                kwargs["expert_budget"] = budget
            if self.uses_predictor and predictor:
                kwargs["predictor"] = predictor
        return rules


def _ladder(mode: str, miss_policy: str, what: str) -> list[BenchConfig]:
    steps = [
        ("-base", "pinned prefix + slab cache, on-demand fetches", False, (("prefetch_window", 0),), False),
        ("+compress", "+ affinity token compression (keep 0.5)", True, (("prefetch_window", 0),), False),
        ("+predict", "+ prefetch of the next offloaded layer, one copy in flight", True,
         (("prefetch_window", 1), ("max_in_flight", 1)), True),
        ("-full", "+ deep lookahead (window 2 / predictor top-B), 16 copies in flight", True, (), True),
    ]
    return [BenchConfig(f"{mode}{step}", f"{what}: {description}", "ladder", compression=compression,
                        expert_kwargs=(("miss_policy", miss_policy), ("min_pinned_layers", 1)) + kwargs,
                        uses_predictor=predictor)
            for step, description, compression, kwargs, predictor in steps]


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in [
    BenchConfig("all-on-gpu", "stock Hugging Face, every module on the GPU", "gpu", takes_budget=False),
    BenchConfig("all-pinned", "our runtime, every layer pinned (no transfers)", "offload",
                takes_budget=False, expert_kwargs=(("expert_budget", PIN_EVERYTHING), ("prefetch_window", 0))),
    BenchConfig("accelerate", "accelerate device_map offload, GPU capped by max_memory (AC)", "gpu",
                needs_cuda=True, accelerate=True),
    BenchConfig("kt-cpu", "KTransformers-style: every routed expert on the CPU backend (KT)", "kt-cpu",
                takes_budget=False),
    BenchConfig("lru", "on-demand expert loading, LRU cache", "lru"),
    *_ladder("vismmoe", "wait", "offload-only"),
    *_ladder("hybrid", "auto", "hybrid"),
    BenchConfig("ep", "expert parallelism over the torchrun group, BF16", "ep", takes_budget=False,
                operator=EP_OPERATOR, needs_group=True, expert_kwargs=(("mode", "bf16"),)),
    BenchConfig("ep-realb", "expert parallelism, ReaLB on the group's real ranks", "ep",
                takes_budget=False, operator=EP_OPERATOR, needs_group=True, expert_kwargs=(("mode", "realb"),)),
    BenchConfig("ep-graphs", "expert parallelism, BF16, decode steps' exchanges inside their CUDA graphs",
                "ep", takes_budget=False, operator=EP_OPERATOR, needs_group=True,
                expert_kwargs=(("mode", "bf16"), ("capture_exchange", True))),
    BenchConfig("ep-realb-seq", "ReaLB with its plan's metadata exchanged before the dispatch (no overlap)",
                "ep", takes_budget=False, operator=EP_OPERATOR, needs_group=True,
                expert_kwargs=(("mode", "realb-seq"),)),
    BenchConfig("ep-fixed", "ReaLB with a fixed M_d (0.7), no AIMD", "ep", takes_budget=False,
                operator=EP_OPERATOR, needs_group=True, expert_kwargs=(("mode", "fixed"),)),
    BenchConfig("ep-lowprec-all", "every pair in low precision (FP8 on Hopper, NVFP4 emulated elsewhere: the "
                "paper's FP4-All)", "ep", takes_budget=False, operator=EP_OPERATOR, needs_group=True,
                expert_kwargs=(("mode", "all"),)),
    BenchConfig("ep-eplb", "EPLB: hot experts replicated, re-placed from a window of loads (window 200, every "
                "300 steps, the paper's)", "ep", takes_budget=False, operator=EP_OPERATOR,
                needs_group=True, expert_kwargs=(("mode", "eplb"), ("eplb_window", 200), ("eplb_period", 300))),
    BenchConfig("ep-eplb-async", "Async EPLB: the same re-placements, their weights moved on a group of their own "
                "while the next step runs on the old placement", "ep", takes_budget=False,
                operator=EP_OPERATOR, needs_group=True,
                expert_kwargs=(("mode", "eplb"), ("eplb_window", 200), ("eplb_period", 300), ("eplb_async", True))),
]}
CUDA_REASON = "needs CUDA: accelerate offloads between a GPU and host memory"
GROUP_REASON = "needs a torchrun launch: torchrun --nproc-per-node N -m vismmoe_kt.apps.cli bench ... --configs ep"


def run_label(name: str, budget: str | None) -> str:
    """How a configuration at a budget is named in progress, profile.json and the chart."""
    return f"{name} @ {budget}" if budget else name


def parse_configs(names: list[str] | None, in_group: bool = False) -> list[BenchConfig]:
    """`--configs` names -> configurations, in the order given (default: all; under torchrun, the
    expert-parallel ones, which are the only ones that can run there)."""
    if not names:
        return [c for c in CONFIGS.values() if c.needs_group] if in_group else list(CONFIGS.values())
    if in_group:
        single = [n for n in names if n in CONFIGS and not CONFIGS[n].needs_group]
        if single:
            raise InputError(f"--configs {', '.join(single)}: under torchrun only the expert-parallel configurations "
                             f"run ({', '.join(c.name for c in CONFIGS.values() if c.needs_group)}); measure the "
                             f"others in a single process")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise InputError(f"--configs: unknown configuration {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(CONFIGS)}")
    return [CONFIGS[n] for n in dict.fromkeys(names)]

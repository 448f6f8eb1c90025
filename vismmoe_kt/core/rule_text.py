"""A generated rule list as a commented YAML file: what `vismmoe-kt rules show` prints and optimize_rules/ holds.

The comments say what each placement does and what each kwarg may be set to; the rules themselves come from
vismmoe_kt/core/placements.py, and `yaml.safe_load` of the text gives exactly them back.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

from .placements import FAMILIES, PlacementFacts, placement_rules, routing_rule, rule_file_name

WIDTH = 110
NOTE_COLUMN = 36  # where a kwarg's comment starts
LEAN = ("The text model's forward is ours, so the decode engine can hold its static cache and capture its steps in "
        "CUDA graphs: --decode lean|hf, --graphs auto|cuda|replay|off.")

# (operator class name, kwarg) -> the comment beside it in the YAML
KWARG_NOTES = {
    ("VisExperts", "store_dtype"): "a GGUF's expert format as stored, else model | q8_0 | q4_0 | q4_k | q5_k",
    ("VisExperts", "slab_format"): "quantized where it works (a quantized store, miss_policy wait, no predictor) | "
                                   "dequantized | quantized",
    ("VisExperts", "batch_experts"): "a batched step's pinned layers: auto (the table kernel up to batch_table_pairs "
                                     "pairs, then expert-major; quantized blocks: the GEMVs up to the device's "
                                     "tuned pairs) | table | grouped-gemm | expert-major",
    ("VisExperts", "reservations"): "each decode step's landing slabs reserved after the step before's records | "
                                    "ahead: while the step before runs (decode without a CPU share or a predictor) | "
                                    "auto: decode's first steps time both, keep the faster",
    ("VisExperts", "eviction"): "auto: decode's first steps time lru against vismmoe, keep the faster | vismmoe | lru",
    ("VisExperts", "predictor"): "a predictor.pt from `vismmoe-kt calibrate`; null: prefetch by routing history",
    ("SourceRouter", "routing"): "synthetic[:SEED] | trace:PATH replace the routers' choice; model keeps it",
    ("SourceRouter", "record"): "keep what the routers chose (`vismmoe-kt trace record`)",
    ("VisExperts", "prefetch_min_probability"): "decode prefetches only pairs the predictor believes in",
    ("VisExperts", "prefetch_stride"): "decode runs the predictor at every S-th MoE layer (S <= its window)",
    ("VisExperts", "miss_policy"): "auto: the cost model splits the misses | cpu: all on the CPU | wait: fetch them",
    ("VisExperts", "cpu_dtype"): "kt-kernel's copy: auto (a GGUF's quantized experts as stored, else bf16) | bf16 | "
                                 "int8 | int4",
    ("VisExperts", "cost_model"): "null: measure copy and CPU times at start-up",
    ("VisionExperts", "expert_budget"): "slabs the prefill's vision experts stream through (a layer's 64 hold 0.5 GB)",
    ("VisDecoder", "salient_ratio"): "null: 0.4 * keep_ratio",
    ("VisDecoder", "prune_layer"): "after the offload runtime's pinned prefix (at least the first layer)",
    ("VisExperts", "min_pinned_layers"): "Eq. 10's L_semantic: 0 lets pinned_layers auto pin none where that "
                                         "predicts faster",
    ("CpuExperts", "cpu_dtype"): "a GGUF's own quantized types where kt-kernel takes them, else bf16 | bf16 | int8 | "
                                 "int4",
    ("CpuExperts", "gpu_prefill_tokens"): "KTransformers' dual prefill: prompts of at least this many tokens run each "
                                          "layer's experts on the GPU from a host copy, a layer ahead over PCIe; "
                                          "0: off",
    ("CpuExperts", "gpu_prefill_format"): "that copy: auto (q4_k where the widths allow, else q8_0) | model | q8_0 | "
                                          "q4_0 | q4_k | q5_k",
    ("CpuExperts", "gpu_prefill_share"): "the GPU's share of a layer's experts then, the CPU computing the rest at "
                                         "once | auto",
    ("MixedPrecisionExperts", "precision_backend"): "fp8 on GPUs with FP8 tensor cores (Hopper), else nvfp4-emulated; "
                                                    "fp8 keeps an E4M3 copy of every expert (+50% of their BF16 bytes)",
    ("MixedPrecisionExperts", "md_start"): "AIMD: initial vision-fraction threshold M_d ...",
    ("MixedPrecisionExperts", "md_min"): "... and its floor",
    ("MixedPrecisionExperts", "eplb_redundant"): "mode eplb: extra expert copies (null: one per rank)",
    ("MixedPrecisionExperts", "eplb_period"): "mode eplb: steps between re-placements",
    ("ExpertParallelExperts", "mode"): "bf16 | realb | realb-seq | fixed | all | eplb",
    ("ExpertParallelExperts", "capture_exchange"): "decode steps' expert exchanges inside their CUDA graphs (NCCL "
                                                   "captured)",
    ("ExpertParallelExperts", "eplb_period"): "mode eplb: steps between re-placements ...",
    ("ExpertParallelExperts", "eplb_window"): "... from the summed loads of this many steps",
    ("ExpertParallelExperts", "eplb_async"): "... weights moved while the next step runs on the old placement "
                                             "(Async EPLB)",
}


def _description(facts: PlacementFacts, placement: str) -> str:
    """What the placement does, in this family's words (the header comment's body)."""
    family, second = facts.family, facts.vision_experts is not None
    keeps = f" {facts.stays_on_gpu[0].upper()}{facts.stays_on_gpu[1:]} stay on the GPU with the attention." \
        if facts.stays_on_gpu else ""
    vision_runtime = (" The vision experts, which only a prefill's image tokens reach, get a runtime of their own "
                      "(VisionExperts) with a small budget: a prefill streams them through a few slabs, and decode, "
                      "which never uses them, keeps the whole expert_budget for the text experts. --set expert_budget "
                      "sets both rules' budgets: give the vision experts theirs by editing their rule.") \
        if second else ""
    experts = "text experts (the ones decode runs)" if second else "routed experts"
    hybrid = (f"VisMMOE GPU-CPU hybrid mode: the offload runtime of {family}-offload.yaml, and for the experts a "
              "layer needs that are not on the GPU, a split by a cost model measured at start-up: fetch some, run the "
              "others' tokens on the CPU backend, the copies and the CPU work overlapping each other and the GPU's "
              "hits. cpu_backend torch reads the page-locked expert store in place (no second host copy of the "
              "experts) but waits on the host, so on a GPU it serves prefill and decode's misses go over PCIe (the "
              "one-graph table step, as under miss_policy wait); kt-kernel keeps its own copy (cpu_dtype int8: half "
              "the store's size) and runs inside the step, in decode too: --set "
              f"cpu_backend=kt-kernel --set cpu_dtype=int8. expert_budget is all GPU memory for the {experts}: "
              f"{facts.budget_note}.{vision_runtime}")
    if placement == "gpu":
        lean = f" {family}.yaml is the same placement on our lean decode path." if facts.default == "lean" else ""
        return ("everything on the GPU with the stock Hugging Face modules (transformers' own forward and generation "
                "loop): the reference placement every other rule file is compared against, and the benchmarks' "
                f"all-on-gpu baseline.{lean} Without a GPU: vismmoe-kt chat ... --generate_device cpu "
                "--prefill_device cpu")
    if placement == "vismmoe" and facts.default == "lean":
        return ("the lean decode path: our text model's forward and decode engine (static cache, steps captured in "
                "CUDA graphs: --decode lean|hf, --graphs auto|cuda|replay|off), every weight on the GPU. "
                f"{facts.model_note} Features are off: no visual-token pruning (compression: none), no offloading "
                f"({family}-offload.yaml adds it).")
    if placement == "vismmoe":
        return (f"{hybrid} Visual tokens are pruned after the pinned prefix by affinity-aware compression (keep_ratio "
                "0.5; --set keep_ratio=1.0 turns it off). Compression needs batch size 1. "
                f"{family}-hybrid.yaml is the same placement without pruning. {LEAN}")
    if placement == "offload":
        return ("VisMMOE offload-only mode: routed expert weights live in page-locked host memory; the GPU keeps the "
                f"pinned prefix (chosen from the budget by Eq. 10) and a slab cache fed by a prefetch stream.{keeps} "
                f"expert_budget is all GPU memory for the {experts}: {facts.budget_note}. Override on the command "
                f"line: --set expert_budget=32GiB.{vision_runtime} {LEAN} Visual-token pruning is off "
                "(compression: none).")
    if placement == "lru":
        return ("baseline: on-demand expert loading with an LRU cache (no pinned prefix, no prefetch), as in earlier "
                f"MoE offloading work; same runtime and budget meaning as {family}-offload.yaml.{keeps} "
                f"expert_budget: bytes or a share of the {experts}' bytes (--set expert_budget=30%). {LEAN}")
    if placement == "hybrid":
        return f"{hybrid} Visual-token pruning is off (compression: none; {family}.yaml adds it to Qwen3-VL). {LEAN}"
    if placement == "kt-cpu":
        where = (" The vision experts, which only a prefill's image tokens reach and which are worth a GPU's tensor "
                 "cores on hundreds of tokens at once, stream to the GPU through their own small runtime "
                 "(VisionExperts)." if second else "")
        also = f", with {facts.stays_on_gpu}" if facts.stays_on_gpu else ""
        return (f"KTransformers-style: every {'text' if second else 'routed'} expert computed on the CPU "
                "(kt-kernel's AMX / AVX-512 / AVX2 kernels when installed and the expert sizes are multiples of 32, "
                f"else torch); attention, router and the vision tower on the GPU{also}.{where} CPU expert workers: "
                "--cpu_infer (default physical cores - 2). The "
                "text model's forward is ours, so decode runs on the lean path: with kt-kernel on a CUDA device each "
                "layer's CPU call runs inside the stream and the whole step is one CUDA graph (--graphs off: eager).")
    if placement == "realb":
        which = ("the vision experts only: every token there is an image token, the ones ReaLB may lower; the text "
                 "experts, and so text-only prompts and decode, stay the model's exact BF16 experts" if second else
                 "every MoE layer's routed experts")
        return (f"ReaLB: modality-aware mixed precision on {which}; vision-heavy experts of overloaded (virtual) "
                "expert-parallel ranks switch to NVFP4 (or FP8) under the LB gate, M_d under AIMD control. The "
                "VisDecoder rule (no compression) tells the operator which tokens are image tokens. Configurations: "
                f"--set mode=bf16 | all | realb | realb-seq | fixed (with fixed_threshold) | eplb. {LEAN}")
    whole = (" The vision experts, which only a prefill's image tokens reach, stay whole on every rank (the model's "
             "own modules): decode, the part expert parallelism speeds up, never runs them." if second else "")
    return ("expert parallelism: run under `torchrun --nproc-per-node N`; every rank keeps 1/N of each MoE layer's "
            f"{experts} and serves its own requests (attention replicated, data parallel).{whole} expert_map: null = "
            f"contiguous (expert e on rank e * N // E), or a list of ranks, one per expert. {LEAN}")


def header(family: str, placement: str) -> str:
    facts = FAMILIES[family]
    generated = (f"Generated by `vismmoe-kt rules show --family {family} --placement {placement}` "
                 "(vismmoe_kt/core/placements.py; `vismmoe-kt rules write` rewrites every file, and a test checks "
                 "they agree): change the generator, not this file. Editing a copy is fine: any rule file in "
                 "KTransformers' schema loads with --optimize_config_path, as KTransformers' own rules do.")
    return _comment(generated, "") + _comment(f"{facts.title}, {_description(facts, placement)}", "")


def _comment(text: str, indent: str) -> str:
    lines = textwrap.wrap(text, WIDTH - len(indent) - 2, break_on_hyphens=False)
    return "".join(f"{indent}# {line}\n" for line in lines)


PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def scalar(value: Any) -> str:
    """A YAML scalar that reads back as `value`: plain words bare, anything else quoted (JSON's escapes are YAML's)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if PLAIN.fullmatch(value) and value.lower() not in ("null", "true", "false", "yes", "no", "on", "off", "y", "n"):
        return value
    return json.dumps(value)


def render_rule(rule: dict[str, Any]) -> str:
    operator = rule["replace"]["class"].rpartition(".")[2]
    out = [f"- match:\n    name: {scalar(rule['match']['name'])}\n"]
    if "class" in rule["match"]:
        out.append(f"    class: {rule['match']['class']}\n")
    out.append(f"  replace:\n    class: {rule['replace']['class']}\n    kwargs:\n")
    for key, value in rule["replace"]["kwargs"].items():
        line, note = f"      {key}: {scalar(value)}", KWARG_NOTES.get((operator, key))
        if note and len(f"{line:<{NOTE_COLUMN}} # {note}") > WIDTH:  # a long note goes on the lines above
            out.append(_comment(note, "      ") + f"{line}\n")
        else:
            out.append(f"{line:<{NOTE_COLUMN}} # {note}\n" if note else f"{line}\n")
    if "recursive" in rule:
        out.append(f"  recursive: {rule['recursive']}\n")  # KTransformers' files spell it False
    return "".join(out)


def rule_text(family: str, placement: str, routing: str | None = None) -> str:
    """The commented YAML of `placement_rules(family, placement)`, as optimize_rules/<file> holds it; with
    `routing`, a routing source's rule on the routers first (what the benchmarks load)."""
    rules = placement_rules(family, placement)
    if routing is not None:
        rules = [routing_rule(family, routing), *rules]
    return header(family, placement) + "".join(render_rule(rule) for rule in rules)


__all__ = ["rule_text", "rule_file_name", "header"]

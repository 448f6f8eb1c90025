"""GPU check of the foundation on a CUDA machine, in one go (used with the device tool).

For every rule file under optimize_rules/, load a saved tiny Qwen3-VL-MoE with its default (CUDA)
devices and compare logits and greedy tokens with the all-on-GPU reference (fp32, TF32 off).
Prints one line per rule file with the max logit difference, token equality, where the weights
went and what the operators did; exits non-zero if any rule file disagrees. Generation goes through
`vismmoe_kt.engine.generate`, so rule files with a VisDecoder exercise the lean decode path and its
CUDA graphs (a capture error or a graphed step that differs from the eager one counts as a failure).
qwen3vl-ep.yaml is left out: it needs a torchrun launch.

    PYTHONPATH=. python3 scripts/gpu_check.py [--out DIR]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS, save_tiny_model
from vismmoe_kt.engine.inputs import build_inputs, user_turn


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for the GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny-6x64", "tiny-6x64", seed=0)
    rules = sorted(r for r in Path("optimize_rules").glob("*.yaml") if r.name != "qwen3vl-ep.yaml")  # needs torchrun
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8))

    def run(rule_file, **overrides):
        model, processor = load(model_dir, rule_file, progress=False, **overrides)
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], "cuda:0")
        with torch.inference_mode():
            logits = model(**inputs).logits.float().cpu()
            start = time.perf_counter()
            tokens = generate(model, inputs, 8).cpu()  # the lean decode path where the rules have a VisDecoder
            seconds = time.perf_counter() - start
        return logits, tokens, seconds, collect_stats(model)

    ref_logits, ref_tokens, _, _ = run("optimize_rules/qwen3vl-gpu.yaml")
    # the offload runtimes again at their smallest budgets, so that every step copies and evicts
    spec = SPECS["tiny-6x64"]
    layer = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4  # one layer of fp32 experts
    cases = [(str(r), {}) for r in rules] + [("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": 2 * layer}),
                                            ("optimize_rules/qwen3vl-lru.yaml", {"expert_budget": layer}),
                                            # every expert resident: the whole decode step is one CUDA graph
                                            ("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": "1GiB",
                                                                                     "graphs": "cuda"})]
    results, ok = [], True
    for rule_file, overrides in cases:
        logits, tokens, seconds, stats = run(rule_file, **overrides)
        rule_file = Path(rule_file)
        diff = (logits - ref_logits).abs().max().item()
        same = torch.equal(tokens, ref_tokens)
        lean = stats["operators"].get("VisDecoder", {})
        graphs_ok = lean.get("decode_capture_failures", 0) == 0 and lean.get("decode_check_failures", 0) == 0
        ok &= diff <= 1e-5 and same and graphs_ok
        row = {"rules": rule_file.name, "overrides": overrides, "max_abs_logit_diff": diff, "greedy_tokens_equal": same,
               "generate_8_tokens_s": round(seconds, 3), "weights_by_device": stats.get("weights_by_device"),
               "operators": stats["operators"]}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                              "results": results}, indent=2))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

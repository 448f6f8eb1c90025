"""Anchor (pinned-prefix) depth study, VisMMOE Figure 12: end-to-end time against L_pinned at a fixed
expert budget, and the depth that `pinned_layers: auto` (Eq. 10) picks there.

    python3 -m benchmarks.anchor_depth_study --out DIR [--model tiny-6x64 | --synthetic-layers N]
        [--budget-layers 3] [--decode-tokens 16] [--device cuda:0]

The budget is given in layers of experts (`--budget-layers 3`: three layers' worth of GPU memory).
Each depth from 0 to the deepest that Eq. 10 allows is loaded with optimize_rules/qwen3vl.yaml
(keep_ratio 0.5, miss_policy wait) and timed on one image prompt: one warm-up, then the median of
`--reps` runs of prefill + decode. Random weights: routing, and so the curve, is not a trained model's.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


from vismmoe_kt.demo.pictures import make_image
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from vismmoe_kt import load
from vismmoe_kt.operators.vis_experts import VisExperts
from vismmoe_kt.runtime.budget import BudgetError, choose_pinned_layers
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for anchor_depth.json")
    parser.add_argument("--model", default="tiny-6x64", help="tiny random model to build (a vismmoe_kt.demo.tiny spec)")
    parser.add_argument("--synthetic-layers", type=int,
                        help="instead of --model: N layers of Qwen3-VL-30B-A3B shapes, random weights")
    parser.add_argument("--budget-layers", type=float, default=3,
                        help="expert budget, in layers' worth of expert weights")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens decoded per timed run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per depth after one warm-up (median reported)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="where prefill and decode run (default: cuda:0 when there is a GPU, else cpu)")
    args = parser.parse_args()
    common = dict(generate_device=args.device, prefill_device=args.device, miss_policy="wait", keep_ratio=0.5, progress=False)
    if args.synthetic_layers:
        from benchmarks.models.synthetic import QWEN3_VL_30B_A3B, load_synthetic

        text = QWEN3_VL_30B_A3B["text"]
        layer_bytes, layers = text["num_experts"] * 3 * text["moe_intermediate_size"] * text["hidden_size"] * 2, args.synthetic_layers

        def build(**overrides):
            return load_synthetic(rules="optimize_rules/qwen3vl.yaml", layers=layers, **overrides, **common)
        name = f"qwen3-vl-30b-a3b shapes, {layers} layers"
    else:
        from vismmoe_kt.demo.tiny import SPECS, save_tiny_model

        spec = SPECS[args.model]
        layer_bytes, layers, name = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4, spec.layers, args.model
        model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / args.model, args.model)

        def build(**overrides):
            return load(model_dir, "optimize_rules/qwen3vl.yaml", **overrides, **common)
    budget = int(args.budget_layers * layer_bytes)
    auto = choose_pinned_layers(budget, layer_bytes, layer_bytes, 0, layers)  # the default rule file's L_semantic
    rows = []
    for depth in range(0, layers + 1):
        try:
            model, processor = build(expert_budget=budget, pinned_layers=depth)
        except Exception as exc:  # outside Eq. 10's interval: the loader refuses, which ends the sweep
            if isinstance(exc.__cause__, BudgetError) or "outside the valid range" in str(exc):
                continue
            raise
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(448)], args.device)
        times = []
        for rep in range(args.reps + 1):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, do_sample=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if rep:  # the first run warms up
                times.append(time.perf_counter() - start)
        runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
        rows.append({"pinned_layers": len(runtime.pinned), "slabs": runtime.num_slabs,
                     "seconds_median": statistics.median(times), "seconds_min": min(times), "seconds_max": max(times)})
        print(json.dumps(rows[-1]), flush=True)
        runtime.close()
        del model
    result = {"model": name, "device": args.device, "budget_layers": args.budget_layers, "auto_pinned_layers": auto,
              "decode_tokens": args.decode_tokens, "rows": rows, "routing": "random weights"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "anchor_depth.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()

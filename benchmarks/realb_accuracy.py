"""Accuracy cost of low precision on the tiny model: FP4-All vs ReaLB vs BF16 (the reference).

    python3 -m benchmarks.realb_accuracy --out DIR [--model tiny-6x64] [--requests 8] [--tokens 16]

For each synthetic image request (448 px: 196 of 236 prompt tokens are visual): the relative logit
error of the prefill against the BF16 reference and the share of greedy tokens that agree over
`--tokens` decoded tokens. ReaLB runs with its gate lowered to 64 tokens so that it acts on these
small batches. The tiny model has random weights: the numbers show how much NVFP4 perturbs this
network, not how a trained model's answers change.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch


from vismmoe_kt import load, stats
from vismmoe_kt.apps.calibrate import synthetic_image
from vismmoe_kt.demo.tiny import save_tiny_model
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

RULES = "optimize_rules/qwen3vl-realb.yaml"
CONFIGS = {"bf16": {"mode": "bf16"}, "fp4-all": {"mode": "all"},
           "realb": {"mode": "realb", "lb_gate_tokens": 64}, "realb-fixed-0.7": {"mode": "fixed", "lb_gate_tokens": 64}}


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for realb_accuracy.json")
    parser.add_argument("--model", default="tiny-6x64", help="tiny random model to build (a vismmoe_kt.demo.tiny spec)")
    parser.add_argument("--requests", type=int, default=8, help="synthetic image requests compared")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens decoded per request for the agreement share")
    args = parser.parse_args()
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / args.model, args.model)
    cpu = dict(generate_device="cpu", prefill_device="cpu", progress=False)
    models = {name: load(model_dir, RULES, **overrides, **cpu) for name, overrides in CONFIGS.items()}
    processor = models["bf16"][1]
    results = {name: {"logit_rel_error": [], "token_agreement": []} for name in CONFIGS if name != "bf16"}
    for i in range(args.requests):
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [synthetic_image(7000 + i, 448)])
        outputs = {}
        for name, (model, _) in models.items():
            with torch.no_grad():
                logits = model(**inputs).logits
                tokens = model.generate(**inputs, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            outputs[name] = (logits, tokens[0, inputs["input_ids"].shape[1]:])
        ref_logits, ref_tokens = outputs["bf16"]
        for name in results:
            logits, tokens = outputs[name]
            results[name]["logit_rel_error"].append(float((logits - ref_logits).norm() / ref_logits.norm()))
            results[name]["token_agreement"].append(float((tokens == ref_tokens).float().mean()))
    summary = {}
    for name, r in results.items():
        ops = stats(models[name][0])["operators"]["MixedPrecisionExperts"]
        summary[name] = {"mean_logit_rel_error": sum(r["logit_rel_error"]) / len(r["logit_rel_error"]),
                         "mean_token_agreement": sum(r["token_agreement"]) / len(r["token_agreement"]),
                         "lowprec_pair_share": ops["lowprec_pairs"] / max(ops["pairs"], 1)}
        print(name, json.dumps({k: round(v, 4) for k, v in summary[name].items()}))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "realb_accuracy.json").write_text(json.dumps({"model": args.model, "requests": args.requests,
                                                                     "tokens": args.tokens, "summary": summary,
                                                                     "routing": "random weights"}, indent=2))


if __name__ == "__main__":
    main()

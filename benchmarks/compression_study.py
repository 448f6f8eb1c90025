"""Token compression vs expert working set: distinct experts per layer, bytes moved and prefill time
for compression none / random / saliency / affinity at keep ratios 0.7 and 0.5, and a layer x expert
activation heatmap before and after compression (VisMMOE Figure 1/3 style), as PNG.

    python3 -m benchmarks.compression_study --out DIR [--model tiny-6x64 | --synthetic-layers N]
        [--device cpu] [--image-size 448]

The model is loaded once with optimize_rules/qwen3vl.yaml (offload runtime at its smallest budget:
one pinned layer plus one layer of slabs, so every offloaded layer moves bytes), and the VisDecoder's
compression settings are switched between runs; the cache is emptied before each prefill.
Random weights: routing is not a trained model's, and neither are these working sets.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from vismmoe_kt.demo.pictures import make_image
from vismmoe_kt import load, stats
from vismmoe_kt.engine.inputs import ask_inputs
from vismmoe_kt.operators.vis_decoder import VisDecoder
from vismmoe_kt.apps.plots import heatmap_png
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

CASES = [("none", 1.0)] + [(m, b) for b in (0.7, 0.5) for m in ("random", "saliency", "affinity")]


def load_model(args):
    common = dict(generate_device=args.device, prefill_device=args.device, miss_policy="wait", progress=False)
    if args.synthetic_layers:
        from benchmarks.models.synthetic import QWEN3_VL_30B_A3B, load_synthetic

        text = QWEN3_VL_30B_A3B["text"]
        layer_bytes = text["num_experts"] * 3 * text["moe_intermediate_size"] * text["hidden_size"] * 2  # bf16
        budget, name = 2 * layer_bytes, f"qwen3-vl-30b-a3b shapes, {args.synthetic_layers} layers"
        model, processor = load_synthetic(rules="optimize_rules/qwen3vl.yaml", layers=args.synthetic_layers,
                                          expert_budget=budget, **common)
        return model, processor, name
    from vismmoe_kt.demo.tiny import SPECS, save_tiny_model

    spec = SPECS[args.model]
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / args.model, args.model, seed=0)
    budget = 2 * spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4
    model, processor = load(model_dir, "optimize_rules/qwen3vl.yaml", expert_budget=budget, **common)
    return model, processor, args.model


def main():
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for compression_study.json and expert_heatmap.png")
    parser.add_argument("--model", default="tiny-6x64", help="tiny random model to build (a vismmoe_kt.demo.tiny spec)")
    parser.add_argument("--synthetic-layers", type=int,
                        help="instead of --model: N layers of Qwen3-VL-30B-A3B shapes, random weights")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="where prefill runs (default: cuda:0 when there is a GPU, else cpu)")
    parser.add_argument("--image-size", type=int, default=448, help="square test image size, in pixels")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, name = load_model(args)
    decoder = next(m for m in model.modules() if isinstance(m, VisDecoder))
    context, adapter = model.vismmoe.context, model.vismmoe.adapter
    runtime = context.offload_runtime
    layers = adapter.decoder_layers(model)
    num_experts = adapter.moe_shape(model.config).num_experts
    counts = {}

    def hook(index):
        def record(module, inputs, output):
            counts.setdefault(index, torch.zeros(num_experts))
            routed = adapter.routed_experts(output)
            counts[index] += torch.bincount(routed.reshape(-1).cpu(), minlength=num_experts).float()
        return record
    for index, layer in enumerate(layers):
        adapter.router(layer).register_forward_hook(hook(index))
    inputs = ask_inputs(model, processor, "Describe the image.", [make_image(args.image_size)])
    with torch.inference_mode():
        model(**inputs)  # warm-up
    rows, maps = [], {}
    for method, beta in CASES:
        decoder.set_compression(compression=method, keep_ratio=beta)
        runtime.reset_cache()
        counts.clear()
        before = stats(model)["operators"]["VisExperts"]
        start = time.perf_counter()
        with torch.inference_mode():
            model(**inputs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = stats(model)["operators"]["VisExperts"]
        distinct = [int((counts[i] > 0).sum()) for i in range(len(layers))]
        offloaded = [i for i in range(len(layers)) if i not in runtime.pinned]
        rows.append({
            "compression": method, "keep_ratio": beta,
            "tokens_after_prefix": int(context.pruning.keep.numel()) if context.pruning.active else int(inputs["input_ids"].shape[1]),
            "distinct_experts_per_layer": distinct,
            "mean_distinct_experts_offloaded_layers": float(np.mean([distinct[i] for i in offloaded])),
            "bytes_moved": after["bytes_copied"] - before["bytes_copied"],
            "prefill_s": round(seconds, 3),
        })
        print(json.dumps(rows[-1]), flush=True)
        maps[(method, beta)] = torch.stack([counts[i] / counts[i].sum() for i in range(len(layers))]).numpy()
    meta = {"model": name, "device": args.device, "prompt_tokens": int(inputs["input_ids"].shape[1]),
            "visual_tokens": int(adapter.image_token_mask(model.config, inputs["input_ids"]).sum()),
            "pinned_layers": len(runtime.pinned), "routing": "random weights"}
    (out / "compression_study.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    heatmap_png([(f"no compression ({name})", maps[("none", 1.0)]), (f"affinity, keep 0.5 ({name})", maps[("affinity", 0.5)])],
                out / "expert_heatmap.png")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()

"""Visual-expert affinity on a trained model: does Algorithm 1 shrink the working set beyond what the
token count alone does?

    python -m benchmarks.affinity_study --out DIR [--model DIR --rules FILE] [--task demo|scenes] [--device cpu|cuda]
        [--prompts 8] [--train-prompts 8] [--keeps 0.3,0.5,0.7] [--depths 1,2,3,4] [--methods affinity,saliency,random]
        [--decode-tokens 4]

The model: the embedded trained demo model by default (vismmoe_kt/demo: 4 layers x 32 experts), or any
model directory --model names, loaded with --rules (a rule file with the VisDecoder, default
optimize_rules/qwen3vl.yaml) on --device; `study()` takes any loaded model, processor and (image, prompt)
requests, so a larger trained model plugs in. Prompts (--task): demo, held-out demo VQA questions (split seed
2); scenes, held-out questions of the scenes task the routing-study model trains on (scripts/train_routing_model.py:
it trains on split 0 and reports accuracy on split 1; the study measures split 2), its question types cycled, the
pictures at the side the model's spec.json names (vismmoe_kt/demo/routing_model.py). The predictor learns from
the train split (seed 0) of the same task.
For every compression (none; each of --methods at each --keeps and pinned prefix depth --depths, the
VisDecoder's prune_layer; depths the model has no layer after are left out) it records each prompt's
routing (`vismmoe-kt calibrate`'s trace recorder: a prefill and --decode-tokens decode steps) and gives,
per layer and as a mean over the layers after the prefix: distinct experts, top-(E/8) concentration of
all and of the visual tokens' assignments, and inter-layer stability (mean Jaccard of a token's expert
sets at consecutive layers, visual and text tokens apart); and the Hot Recall@(E/4) of the repo's
lookahead predictor (vismmoe_kt/predictor), trained on --train-prompts unpruned prompts (train split)
and evaluated on each compression's traces. The table's last column answers the question: affinity's
distinct experts minus random's at the same keep and depth (negative: Algorithm 1 shrinks the working
set beyond the token count). "none" has a row per depth: the same unpruned traces, averaged over the same
layers as that depth's rows. `fit.gain` in the JSON (the visual concentration gain of affinity at keep
0.5 and the first depth over none) is what benchmarks/affinity_whatif.py --fit-study turns into a
synthetic affinity strength. Writes affinity_study.json and affinity_study.md under --out, the traces
under --out/traces (--keep-traces; else removed at the end).

Cost: (1 + depths x keeps x methods) x --prompts + --train-prompts requests, each a prefill and
--decode-tokens steps through transformers' generate loop (the defaults: 37 x 8 + 8 = 304).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from benchmarks.affinity_metrics import Layer, layer_figures, mean_over
from benchmarks.results import print_table, save_json
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter
from vismmoe_kt.apps.calibrate import record_traces
from vismmoe_kt.operators.vis_decoder import VisDecoder
from vismmoe_kt.predictor.model import PredictorConfig, hot_recall, samples_from_steps, train
from vismmoe_kt.predictor.traces import read_trace

METHODS = ("affinity", "saliency", "random")
FIGURES = ("distinct", "concentration", "concentration_visual", "stability_visual", "stability_text")


TASKS = ("demo", "scenes")


def demo_requests(count: int, split: str = "test") -> list[tuple[Any, str]]:
    """(image, question) of the demo VQA split's first `count` examples."""
    from vismmoe_kt.demo.vqa import make_example, split_seed

    return [(e.image, e.question.text) for e in (make_example(split_seed(split), i) for i in range(count))]


def scenes_requests(count: int, split: str = "test", size: int | None = None) -> list[tuple[Any, str]]:
    """(image, question) of the scenes task's split: its first `count` examples, question types cycled."""
    from vismmoe_kt.demo import scenes

    seed = scenes.split_seed(split)
    return [(e.image, e.question.text) for e in
            (scenes.make_example(seed, i, size=size or scenes.IMAGE_SIZE) for i in range(count))]


def scenes_size(model_dir: str | None) -> int | None:
    """The picture side a routing-study model was trained on (its training directory's spec.json), else None."""
    from vismmoe_kt.demo.routing_model import SPEC_FILE, image_size, read_spec, routing_spec

    if model_dir is None or not (Path(model_dir) / SPEC_FILE).is_file():
        return None
    return image_size(routing_spec(read_spec(model_dir)))


def prefill_layers(path: Path) -> tuple[list[Layer], torch.Tensor]:
    """A recorded request's prefill: per MoE layer (ids, prompt positions), and the modality [T]."""
    tensors = load_file(str(path))
    modality = tensors["modality"].bool()
    kept = tensors.get("kept")
    layers, index = [], 0
    while f"s0.routes.{index}" in tensors:
        ids = tensors[f"s0.routes.{index}"].long()
        positions = torch.arange(len(modality)) if len(ids) == len(modality) else kept
        layers.append((ids, positions))
        index += 1
    return layers, modality


def add_visual_concentration(rows: list[dict], layers: list[Layer], modality: torch.Tensor, experts: int, top: int):
    from benchmarks.affinity_metrics import concentration

    for row, (ids, positions) in zip(rows, layers):
        row["concentration_visual"] = concentration(ids[modality[positions]], experts, top)
        row["visual_tokens"] = int(modality[positions].sum())  # what reached the layer: pruning lowers it


def condition_figures(paths: list[Path], experts: int, top: int) -> list[dict]:
    """Per layer, the mean over requests of each figure."""
    per_request = []
    for path in paths:
        layers, modality = prefill_layers(path)
        rows = layer_figures(layers, modality, experts, top)
        add_visual_concentration(rows, layers, modality, experts, top)
        per_request.append(rows)
    out = []
    for i, row in enumerate(per_request[0]):
        merged = {"layer": i}
        for key in row:
            if key != "layer":
                values = [r[i][key] for r in per_request if not math.isnan(r[i].get(key, math.nan))]
                merged[key] = sum(values) / len(values) if values else math.nan
        out.append(merged)
    return out


def predictor_for(paths: list[Path], epochs: int) -> tuple[Any, PredictorConfig]:
    steps = [s for p in paths for s in read_trace(p)]
    layers, experts = steps[0]["active"].shape
    config = PredictorConfig(num_layers=layers, num_experts=experts, hidden_size=steps[0]["hidden"].shape[1],
                             visual_size=steps[0]["visual"].shape[0], window=min(3, layers - 1))
    data = samples_from_steps(steps, config)
    model, _ = train(config, data, data, epochs=epochs, budget=max(1, experts // 4))
    return model, config


def study(model, processor, requests: list[tuple[Any, str]], train_requests: list[tuple[Any, str]], *,
          methods=METHODS, keeps=(0.3, 0.5, 0.7), depths=(1, 2, 3, 4), decode_tokens: int = 4, epochs: int = 6,
          work: Path | None = None) -> dict[str, Any]:
    """The study on a loaded model (a rule file with the VisDecoder) and its (image, prompt) requests."""
    adapter = model.vismmoe.adapter
    shape = adapter.moe_shape(model.config)
    experts, layers = shape.num_experts, len(shape.moe_layers)
    top, budget = max(1, experts // 8), max(1, experts // 4)
    decoder = next((m for m in model.modules() if isinstance(m, VisDecoder)), None)
    if decoder is None:
        raise SystemExit("the model has no VisDecoder: load it with a rule file that prunes (e.g. optimize_rules/qwen3vl.yaml)")
    work = Path(work or tempfile.mkdtemp(prefix="affinity-study-"))
    usable = [d for d in depths if 1 <= d < layers]
    # no pruning once per depth: the same traces, its figures over the same layers as that depth's rows
    cases = [(m, k, d) for d in usable for (m, k) in [("none", 1.0)] + [(m, k) for k in keeps for m in methods]]

    def traces(name: str, method: str, keep: float, depth: int, chosen) -> list[Path]:
        decoder.set_compression(compression=method, keep_ratio=keep, prune_layer=depth)
        return record_traces(model, processor, chosen, work / name, decode_tokens, progress=False)

    predictor, config = predictor_for(traces("train-none", "none", 1.0, 1, train_requests), epochs)
    rows, unpruned = [], None
    for method, keep, depth in cases:
        if method == "none":
            unpruned = unpruned or traces("none", "none", 1.0, 1, requests)
        paths = unpruned if method == "none" else traces(f"{method}-{keep}-{depth}", method, keep, depth, requests)
        per_layer = condition_figures(paths, experts, top)
        data = samples_from_steps([s for p in paths for s in read_trace(p)], config)
        rows.append({"compression": method, "keep": keep, "depth": depth, "per_layer": per_layer,
                     "later": {f: mean_over(per_layer, f, depth) for f in FIGURES},
                     f"hot_recall@{budget}": hot_recall(predictor, data, budget)})
    for row in rows:  # the question: affinity against random at the same keep and depth
        if row["compression"] == "affinity":
            twin = next((r for r in rows if r["compression"] == "random" and r["keep"] == row["keep"]
                         and r["depth"] == row["depth"]), None)
            if twin is not None:
                row["distinct_minus_random"] = row["later"]["distinct"] - twin["later"]["distinct"]
    fit_case = next((r for r in rows if r["compression"] == "affinity" and r["keep"] == 0.5), None)
    fit = None
    if fit_case is not None:
        none = next(r for r in rows if r["compression"] == "none" and r["depth"] == fit_case["depth"])
        fit = {"keep": 0.5, "depth": fit_case["depth"],
               "gain": fit_case["later"]["concentration_visual"] / none["later"]["concentration_visual"] - 1}
    return {"experts": experts, "layers": layers, "top": top, "budget": budget, "prompts": len(requests),
            "train_prompts": len(train_requests), "decode_tokens": decode_tokens,
            "depths_left_out": sorted(set(depths) - set(usable)), "rows": rows, "fit": fit}


def table(result: dict) -> tuple[list[str], list[list[Any]]]:
    top, budget = result["top"], result["budget"]
    header = ["compression", "keep", "depth", "distinct experts", f"top-{top} share", f"visual top-{top} share",
              "stability visual", "stability text", f"Hot Recall@{budget}", "affinity - random distinct"]
    cell = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    rows = [[r["compression"], r["keep"], r["depth"],
             f"{r['later']['distinct']:.2f}", cell(r["later"]["concentration"]), cell(r["later"]["concentration_visual"]),
             cell(r["later"]["stability_visual"]), cell(r["later"]["stability_text"]),
             cell(r[f"hot_recall@{budget}"]),
             f"{r['distinct_minus_random']:+.2f} ({'yes' if r['distinct_minus_random'] < 0 else 'no'})"
             if "distinct_minus_random" in r else ""] for r in result["rows"]]
    return header, rows


def requests_for(task: str, model_dir: str | None, prompts: int, train_prompts: int):
    """The measured (held-out, test split) and the predictor's (train split) requests of --task."""
    if task == "demo":
        return demo_requests(prompts), demo_requests(train_prompts, "train")
    size = scenes_size(model_dir)
    return scenes_requests(prompts, "test", size), scenes_requests(train_prompts, "train", size)


def parse_args(argv: list[str] | None):
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for affinity_study.json and affinity_study.md")
    parser.add_argument("--model", help="a model directory (default: the embedded trained demo model)")
    parser.add_argument("--rules", default="optimize_rules/qwen3vl.yaml", help="rule file (needs the VisDecoder)")
    parser.add_argument("--task", choices=TASKS, default="demo",
                        help="demo: demo VQA prompts | scenes: the routing-study model's task (needs --model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N): where the model runs")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts measured (test split)")
    parser.add_argument("--train-prompts", type=int, default=8, help="unpruned train-split prompts the predictor learns")
    parser.add_argument("--methods", default=",".join(METHODS), help="compressions besides none")
    parser.add_argument("--keeps", default="0.3,0.5,0.7", help="keep ratios")
    parser.add_argument("--depths", default="1,2,3,4", help="pinned prefix depths (prune_layer)")
    parser.add_argument("--decode-tokens", type=int, default=4, help="decode steps recorded per prompt")
    parser.add_argument("--epochs", type=int, default=6, help="predictor training epochs")
    parser.add_argument("--keep-traces", action="store_true", help="leave the recorded traces under OUT/traces")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {sorted(set(args.methods) - set(METHODS))}; known: {', '.join(METHODS)}")
    try:
        args.keeps = [float(k) for k in args.keeps.split(",")]
        args.depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        parser.error("--keeps and --depths take comma-separated numbers")
    if any(not 0 < k < 1 for k in args.keeps) or args.prompts < 1 or args.train_prompts < 1:
        parser.error("--keeps must lie in (0, 1); --prompts and --train-prompts at least 1")
    if args.task == "scenes" and not args.model:
        parser.error("--task scenes needs --model DIR (a model trained on scenes: scripts/train_routing_model.py)")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vismmoe_kt import load
    from vismmoe_kt.demo.tiny import demo_model_dir

    start = time.perf_counter()
    name = args.model or "the embedded trained demo model"
    device = "cuda:0" if args.device == "cuda" else args.device
    model, processor = load(args.model or demo_model_dir(), args.rules, generate_device=device, prefill_device=device,
                            progress=False)
    requests, train_requests = requests_for(args.task, args.model, args.prompts, args.train_prompts)
    work = Path(args.out) / "traces"
    result = study(model, processor, requests, train_requests, methods=args.methods, keeps=args.keeps,
                   depths=args.depths, decode_tokens=args.decode_tokens, epochs=args.epochs, work=work)
    if not args.keep_traces:
        shutil.rmtree(work, ignore_errors=True)
    result.update(model=name, rules=args.rules, task=args.task, device=args.device, routing="the model's own (trained)",
                  seconds=round(time.perf_counter() - start, 1))
    header, rows = table(result)
    title = (f"# Affinity study: {name}, {result['layers']} MoE layers x {result['experts']} experts, "
             f"{result['prompts']} {args.task} prompts (figures: mean over the layers after the prefix)")
    print(title)
    print_table(header, rows)
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    if result["fit"]:
        lines.append(f"\nvisual concentration gain of affinity (keep 0.5, depth {result['fit']['depth']}) over none: "
                     f"{result['fit']['gain']:+.1%} (benchmarks/affinity_whatif.py --fit-study turns it into a strength)")
        print(lines[-1])
    print(f"study took {result['seconds']} s on {args.device}", flush=True)
    save_json(args.out, "affinity_study.json", result)
    (Path(args.out) / "affinity_study.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

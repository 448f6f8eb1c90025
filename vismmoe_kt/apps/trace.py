"""`vismmoe-kt trace plot`: figures from recorded traces (VisMMOE Figures 1, 4 and 10, our data).

- expert_heatmap.png: share of each expert's activations per layer (layer x expert), prefill and
  decode steps side by side;
- layer_similarity.png: Jaccard similarity of consecutive layers' expert sets, per layer pair,
  averaged over steps (how predictable the next layer is from this one), prefill and decode;
- hot_recall.png (with --predictor): per-layer Hot Recall@20 of the predictor vs a random guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import InputError
from .plots import bars_png, heatmap_png
from ..predictor.traces import read_trace


def load_steps(traces: Path) -> list[dict]:
    files = sorted(Path(traces).glob("request-*.safetensors"))
    if not files:
        raise InputError(f"--traces {traces}: no request-*.safetensors trace files")
    return [s for f in files for s in read_trace(f)]


def activation_share(steps: list[dict]) -> np.ndarray:
    counts = sum(s["active"].float() for s in steps)
    return (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()


def layer_similarity(steps: list[dict]) -> list[float]:
    """Mean Jaccard(E_l, E_l+1) over steps, for each consecutive pair of MoE layers."""
    layers = steps[0]["active"].shape[0]
    out = []
    for layer in range(layers - 1):
        values = []
        for s in steps:
            a, b = s["active"][layer], s["active"][layer + 1]
            union = (a | b).sum().item()
            values.append((a & b).sum().item() / union if union else 1.0)
        out.append(float(np.mean(values)))
    return out


def plot(traces: str, out: str, predictor: str | None = None) -> dict:
    steps = load_steps(Path(traces))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_phase = {p: [s for s in steps if s["phase"] == p] for p in ("prefill", "decode")}
    by_phase = {p: v for p, v in by_phase.items() if v}
    heatmap_png([(phase, activation_share(v)) for phase, v in by_phase.items()], out_dir / "expert_heatmap.png")
    similarity = {phase: layer_similarity(v) for phase, v in by_phase.items()}
    pairs = [f"{l}-{l + 1}" for l in range(len(next(iter(similarity.values()))))]
    bars_png(similarity, pairs, out_dir / "layer_similarity.png", "Jaccard similarity of consecutive layers' experts",
             x_label="MoE layer pair", y_label="Jaccard similarity (mean over steps)")
    summary = {"steps": len(steps), "layer_similarity": similarity, "files": ["expert_heatmap.png", "layer_similarity.png"]}
    if predictor:
        from ..predictor.calibration import evaluate
        from ..predictor.model import LookaheadPredictor

        model = LookaheadPredictor.load(predictor)
        ours, guess = evaluate(model, steps, model.config), evaluate(None, steps, model.config)
        layers = list(ours["per_layer@20"])
        bars_png({"predictor": [ours["per_layer@20"][l] for l in layers], "random": [guess["per_layer@20"][l] for l in layers]},
                 [str(l) for l in layers], out_dir / "hot_recall.png", "Hot Recall@20 per layer",
                 x_label="MoE layer", y_label="Hot Recall@20")
        summary["hot_recall_per_layer@20"] = {"predictor": ours["per_layer@20"], "random": guess["per_layer@20"]}
        summary["files"].append("hot_recall.png")
    (out_dir / "trace_views.json").write_text(json.dumps(summary, indent=2))
    return summary


def record(args) -> dict:
    """Run requests with the model's own routing and write what every router chose, token by token."""
    from ..engine.generation import generate
    from ..engine.inputs import ask_inputs
    from ..operators.source_router import install_routing
    from ..routing import save_trace
    from .calibrate import requests_from_args
    from .flags import load_from_args

    requests = requests_from_args(args.images, args.prompts, args.synthetic, args.seed, args.image_size)
    args.decode = "hf"  # transformers' loop calls every router module, whose hooks record (the lean step fuses them)
    model, processor = load_from_args(args)
    if model.vismmoe.context.pruning.active:
        raise InputError("recording needs every token at every layer, and these rules prune visual tokens: "
                         "add --set keep_ratio=1.0")
    source = install_routing(model, "model", record=True)
    adapter = model.vismmoe.adapter
    ids, modality, phase, request_ids = [], [], [], []
    for index, (image, prompt) in enumerate(tqdm(requests, desc="Recording routing", unit="request")):
        inputs = ask_inputs(model, processor, prompt, [image])
        with torch.inference_mode():
            generate(model, inputs, args.decode_tokens, min_new_tokens=args.decode_tokens)
        chosen = source.finish()  # (prompt + decode steps, L, k)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        visual = adapter.image_token_mask(model.config, inputs["input_ids"][0]).cpu()
        ids.append(chosen)
        modality.append(torch.cat([visual, torch.zeros(len(chosen) - prompt_tokens, dtype=torch.bool)]))
        phase.append((torch.arange(len(chosen)) >= prompt_tokens).to(torch.uint8))
        request_ids.append(torch.full((len(chosen),), index, dtype=torch.int32))
    save_trace(args.out, torch.cat(ids), modality=torch.cat(modality), phase=torch.cat(phase),
               request_ids=torch.cat(request_ids))
    return {"requests": len(requests), "tokens": int(sum(len(i) for i in ids)), "file": args.out}


def stats(args) -> str:
    """A trace's routing statistics beside the Qwen3-30B-A3B figures the synthetic router is fitted to."""
    from ..routing import TraceFormatError, load_trace, targets, trace_stats

    try:
        trace = load_trace(args.file, format=args.format)
    except (TraceFormatError, OSError) as exc:
        raise InputError(str(exc)) from None
    experts = args.experts or int(trace.ids.max()) + 1
    result = trace_stats(trace.ids, experts, modality=trace.modality, phase=trace.phase, request_ids=trace.request_ids)
    overall = result["overall"]
    rows = [("tokens x layers x top-k", f"{trace.tokens} x {trace.layers} x {trace.top_k}", "-"),
            ("consecutive-token overlap", overall.get("overlap"), targets.OVERLAP_MEAN),
            ("reuse at the next token", overall.get("reuse_next"), targets.REUSE_NEXT),
            ("reuse within 8 tokens", overall.get("reuse_within8"), targets.REUSE_WITHIN8),
            ("reuse distance, median", overall.get("reuse_median"), targets.REUSE_MEDIAN),
            ("entropy / log E (per prompt)", overall.get("entropy"), "0.62-0.81"),
            ("top-16 share (per prompt)", overall.get("top16_share"), "0.54-0.62"),
            ("corpus hottest / uniform", overall.get("corpus_hot_ratio"), targets.CORPUS_HOT_RATIO),
            ("vision prefill max / mean", overall.get("vision_max_mean"), "5-6 (2-12 per layer)")]

    def cell(value) -> str:
        return value if isinstance(value, str) else "-" if value is None else f"{value:.3f}"
    lines = [f"{args.file}: {experts} experts", "| statistic | trace | Qwen3-30B-A3B (published) |", "|---|---|---|"]
    lines += [f"| {name} | {cell(value)} | {cell(target)} |" for name, value, target in rows]
    per_layer = result.get("per_layer", {}).get("overlap")
    if per_layer is not None:
        lines.append("overlap per layer: " + " ".join(f"{v:.2f}" for v in per_layer))
    return "\n".join(lines)


def add_parser(commands) -> None:
    from .calibrate import add_request_flags

    trace = commands.add_parser("trace", help="record routing traces, their statistics, figures")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True, metavar="{plot,record,stats}",
                                          help="`vismmoe-kt trace NAME --help` describes each")
    plot = trace_commands.add_parser("plot", help="expert heatmap, layer similarity, per-layer Hot Recall (PNG)")
    plot.add_argument("--traces", required=True, help="the traces/ directory written by calibrate")
    plot.add_argument("--out", required=True, help="directory for the PNG figures")
    plot.add_argument("--predictor", help="predictor.pt, to add per-layer Hot Recall")
    rec = trace_commands.add_parser("record", help="record the model's own routing of some requests (a routing trace "
                                                   "that --routing trace:PATH replays)")
    add_request_flags(rec, decode_tokens=16)
    rec.add_argument("--seed", type=int, default=0, help="seed of the synthetic requests (with --synthetic N)")
    rec.add_argument("--out", required=True, help="the trace file (.safetensors or .npz)")
    st = trace_commands.add_parser("stats", help="a routing trace's statistics beside the published Qwen3-30B-A3B ones")
    st.add_argument("file", help="a trace: ours (.safetensors/.npz), vLLM's routed experts, or Mixtral-style JSONL")
    st.add_argument("--format", choices=["project", "vllm", "jsonl"], help="the file's format (default: detected)")
    st.add_argument("--experts", type=int, help="experts per layer (default: the largest id + 1)")


def run(args) -> int:
    if args.trace_command == "record":
        result = record(args)
        print(f"wrote {result['file']}: {result['requests']} requests, {result['tokens']} tokens")
        return 0
    if args.trace_command == "stats":
        print(stats(args))
        return 0
    summary = plot(args.traces, args.out, args.predictor)
    print(f"wrote {', '.join(summary['files'])} to {args.out}")
    return 0

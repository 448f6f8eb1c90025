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
    bars_png(similarity, pairs, out_dir / "layer_similarity.png", "Jaccard similarity of consecutive layers' experts")
    summary = {"steps": len(steps), "layer_similarity": similarity, "files": ["expert_heatmap.png", "layer_similarity.png"]}
    if predictor:
        from ..predictor.calibration import evaluate
        from ..predictor.model import LookaheadPredictor

        model = LookaheadPredictor.load(predictor)
        ours, guess = evaluate(model, steps, model.config), evaluate(None, steps, model.config)
        layers = list(ours["per_layer@20"])
        bars_png({"predictor": [ours["per_layer@20"][l] for l in layers], "random": [guess["per_layer@20"][l] for l in layers]},
                 [str(l) for l in layers], out_dir / "hot_recall.png", "Hot Recall@20 per layer")
        summary["hot_recall_per_layer@20"] = {"predictor": ours["per_layer@20"], "random": guess["per_layer@20"]}
        summary["files"].append("hot_recall.png")
    (out_dir / "trace_views.json").write_text(json.dumps(summary, indent=2))
    return summary


def add_parser(commands) -> None:
    trace = commands.add_parser("trace", help="figures from routing traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    plot = trace_commands.add_parser("plot", help="expert heatmap, layer similarity, per-layer Hot Recall (PNG)")
    plot.add_argument("--traces", required=True, help="the traces/ directory written by calibrate")
    plot.add_argument("--out", required=True)
    plot.add_argument("--predictor", help="predictor.pt, to add per-layer Hot Recall")


def run(args) -> int:
    summary = plot(args.traces, args.out, args.predictor)
    print(f"wrote {', '.join(summary['files'])} to {args.out}")
    return 0

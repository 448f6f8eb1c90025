"""Hot Recall@B of a predictor (or a random guess) on recorded steps: overall, per phase, per layer.

Hot Recall@B = |activated experts of the next layer that were among the B predicted| / |activated|
(DESIGN.md "Decisions"), averaged over steps; `vismmoe-kt calibrate` reports it for the trained
predictor, its history-only ablation and a random guess, and `vismmoe-kt trace plot` draws it per layer.
"""

from __future__ import annotations

from typing import Any

from .model import hot_recall, samples_from_steps


def evaluate(model, steps: list[dict], config, budgets=(10, 20, 30)) -> dict[str, Any]:
    """Hot Recall@B for the model (None: random guess), overall, per phase and per layer."""
    report: dict[str, Any] = {}
    for phase in ("all", "prefill", "decode"):
        chosen = [s for s in steps if phase == "all" or s["phase"] == phase]
        if not chosen:
            continue
        data = samples_from_steps(chosen, config)
        report[phase] = {f"@{b}": round(hot_recall(model, data, min(b, config.num_experts)), 4) for b in budgets}
    data = samples_from_steps(steps, config)
    per_layer = {}
    for layer in sorted(set(data.layer.tolist())):
        per_layer[layer] = round(hot_recall(model, data.subset(data.layer == layer), min(20, config.num_experts)), 4)
    report["per_layer@20"] = per_layer
    return report


"""Hot Recall@B of a predictor (or a random guess) on recorded steps: overall, per phase, per layer;
and the predictor's calibration from requests, whatever produced them (`calibrate_requests`).

Hot Recall@B = |activated experts of the next layer that were among the B predicted| / |activated|
(docs/design.md "Predictor"), averaged over steps; `vismmoe-kt calibrate` reports it for the trained
predictor, its history-only ablation and a random guess, and `vismmoe-kt trace plot` draws it per layer.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from .model import LookaheadPredictor, PredictorConfig, Samples, hot_recall, samples_from_steps, train


def phase_rows(data: Samples, phase: str) -> Samples | None:
    """The rows of one phase ("all", "prefill" or "decode"); None where there are none."""
    if phase == "all":
        return data
    chosen = data.subset(data.decode if phase == "decode" else ~data.decode)
    return chosen if len(chosen.layer) else None


def evaluate(model, steps: list[dict] | Samples, config, budgets=(10, 20, 30)) -> dict[str, Any]:
    """Hot Recall@B for the model (None: random guess), overall, per phase and per layer. `steps` may
    be the rows `samples_from_steps` made of them."""
    data = steps if isinstance(steps, Samples) else samples_from_steps(steps, config)
    report: dict[str, Any] = {}
    for phase in ("all", "prefill", "decode"):
        chosen = phase_rows(data, phase)
        if chosen is None:
            continue
        report[phase] = {f"@{b}": round(hot_recall(model, chosen, min(b, config.num_experts)), 4) for b in budgets}
    per_layer = {}
    for layer in sorted(set(data.layer.tolist())):
        per_layer[layer] = round(hot_recall(model, data.subset(data.layer == layer), min(20, config.num_experts)), 4)
    report["per_layer@20"] = per_layer
    return report


def samples_from_requests(requests: Iterable[list[dict]], config: PredictorConfig,
                          progress: Callable[[int], None] | None = None) -> Samples:
    """The rows of many requests (each a list of steps, prefill first), made one request at a time so
    that only the rows are kept: `requests` may be a generator."""
    parts = []
    for steps in requests:
        parts.append(samples_from_steps(steps, config))
        if progress is not None:
            progress(len(parts))
    if not parts:
        raise ValueError("no requests to calibrate on")
    return Samples.concat(parts)


def calibrate_requests(config: PredictorConfig, train_data: Samples, valid_data: Samples, *, epochs: int = 20,
                       lr: float = 3e-3, batch: int = 1024, schedule: str = "cosine", patience: int = 5,
                       device: str = "cpu", progress: Callable[[str], None] | None = None,
                       seed: int = 0) -> tuple[LookaheadPredictor, dict[str, Any]]:
    """Train a predictor on `train_data` (rows of whole requests, `samples_from_requests`), stopping early
    on Hot Recall@20 of `valid_data`'s decode rows (all its rows where it has none), and report Hot
    Recall@10/20/30 on `valid_data` for it and a random guess (overall, per phase, per layer). The
    report also holds the training log, the wall time and the forward time of one batch-1 call on the
    CPU. Nothing here knows where the requests came from: vismmoe_kt/apps/calibrate.py makes them from
    recorded traces or the synthetic router."""
    say = progress or (lambda line: None)
    budget = min(20, max(1, config.num_experts // 4))  # 20 of 128; a small test shape keeps a real choice
    stop_on = phase_rows(valid_data, "decode") or valid_data
    start = time.perf_counter()

    def epoch_line(entry: dict) -> None:
        say(f"epoch {entry['epoch'] + 1}/{epochs}: loss {entry['loss']:.4f}, validation decode Hot Recall@{budget} "
            f"{100 * entry['valid_hot_recall']:.1f}% ({time.perf_counter() - start:.0f} s)")

    model, log = train(config, train_data, stop_on, epochs=epochs, lr=lr, budget=budget, patience=patience,
                       min_epochs=min(epochs, 2 * patience), seed=seed, progress=epoch_line, batch=batch,
                       schedule=schedule, device=device)
    seconds = time.perf_counter() - start
    report = {"train_rows": len(train_data.layer), "valid_rows": len(valid_data.layer), "epochs_run": len(log),
              "train_seconds": round(seconds, 1), "log": log,
              "predictor": evaluate(model, valid_data, config), "random": evaluate(None, valid_data, config),
              "forward_ms_cpu_batch1": round(1000 * forward_seconds(model), 3)}
    return model, report


def forward_seconds(model: LookaheadPredictor, calls: int = 200) -> float:
    """Median seconds of one eval-mode forward at batch 1 on the CPU (the serving call's shape)."""
    import statistics

    import torch

    c = model.config
    model = model.eval()
    inputs = (torch.tensor([0]), torch.zeros(1, c.history_length, c.num_experts), torch.zeros(1, c.hidden_size),
              torch.zeros(1, c.visual_size), torch.zeros(1, c.window, c.num_experts),
              torch.zeros(1, c.window, c.num_experts))
    times = []
    with torch.no_grad():
        for i in range(calls + 10):
            begin = time.perf_counter()
            model(*inputs)
            if i >= 10:
                times.append(time.perf_counter() - begin)
    return statistics.median(times)

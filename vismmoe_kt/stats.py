"""Runtime statistics of a loaded model, for `--stats` (and later the server's /metrics)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn


def _human_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def collect_stats(model: nn.Module) -> dict[str, Any]:
    """Load facts plus every operator's `stats()`, summed per operator class."""
    info = getattr(model, "vismmoe", None)
    operators: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0})
    for module in model.modules():
        if not getattr(module, "is_injected_operator", False):
            continue
        entry = operators[type(module).__name__]
        entry["count"] += 1
        for key, value in (module.stats() if hasattr(module, "stats") else {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                entry[key] = entry.get(key, 0) + value
            else:
                entry.setdefault(key, value)
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "operators": dict(operators)}
    if info is not None:
        out.update(model_dir=str(info.model_dir), rules=info.rules, load_seconds=round(info.load_seconds, 3),
                   weights_by_device=dict(info.bytes_by_device))
    if torch.cuda.is_available():
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def format_stats(stats: dict[str, Any]) -> str:
    lines = ["runtime stats:"]
    if "model_dir" in stats:
        lines.append(f"  model: {stats['model_dir']}  rules: {stats['rules'] or '(none)'}  load: {stats['load_seconds']:.2f}s")
        weights = ", ".join(f"{dev} {_human_bytes(n)}" for dev, n in sorted(stats["weights_by_device"].items()))
        lines.append(f"  weights: {weights}")
    lines.append(f"  torch threads: {stats['torch_threads']}")
    if "cuda_max_allocated" in stats:
        lines.append(f"  cuda peak allocated: {_human_bytes(stats['cuda_max_allocated'])}")
    if not stats["operators"]:
        lines.append("  operators: none (stock Hugging Face modules)")
    for name, entry in sorted(stats["operators"].items()):
        fields = ", ".join(f"{k}={_human_bytes(v) if k.startswith('bytes') else v}" for k, v in entry.items() if k != "count")
        lines.append(f"  {name} x{entry['count']}: {fields}")
    return "\n".join(lines)

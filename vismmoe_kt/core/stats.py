"""Runtime statistics of a loaded model, for `--stats` (and later the server's /metrics)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ..runtime.budget import human_bytes


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
        weights = ", ".join(f"{dev} {human_bytes(n)}" for dev, n in sorted(stats["weights_by_device"].items()))
        lines.append(f"  weights: {weights}")
    lines.append(f"  torch threads: {stats['torch_threads']}")
    if "cuda_max_allocated" in stats:
        lines.append(f"  cuda peak allocated: {human_bytes(stats['cuda_max_allocated'])}")
    if not stats["operators"]:
        lines.append("  operators: none (stock Hugging Face modules)")
    lines += [f"  {line}" for line in summary(stats["operators"])]
    for name, entry in sorted(stats["operators"].items()):
        fields = [f"{k}={_show(k, v)}" for k, v in entry.items() if k not in ("count", "plan", "eviction", "reservations")]
        lines.append(f"  {name} x{entry['count']}:")
        for start in range(0, len(fields), 6):
            lines.append("    " + ", ".join(fields[start:start + 6]))
    return "\n".join(lines)


def summary(operators: dict[str, dict[str, Any]]) -> list[str]:
    """What the offload runtime and the visual-token pruning did, in words (the counters follow)."""
    lines = []
    for entry in operators.values():
        if {"pinned_layers", "slabs", "fetches", "evictions"} <= entry.keys():
            layers, pinned = entry["count"], entry["pinned_layers"]
            hits, misses = entry.get("decode_hits", 0), entry.get("decode_misses", 0)
            decode = f", decode hits {hits}/{hits + misses}" if hits + misses else ""
            lines.append(f"offload: experts of {pinned} of {layers} MoE layers pinned, the other {layers - pinned} in "
                         f"the host store behind {entry['slabs']} slabs: {entry['fetches']} fetched, "
                         f"{entry['evictions']} evicted{decode}")
        if entry.get("plan"):  # the offload plan's choices and why (runtime/offload_plan.py)
            lines.append("offload plan:")
            lines += [f"  {line}" for line in entry["plan"]]
        if entry.get("eviction"):  # the ranking decode ran: fixed, or what `auto`'s trial kept and why
            lines.append(f"eviction in decode: {entry['eviction']}")
        if entry.get("reservations"):  # when decode reserved its landing slabs: fixed, or what `auto`'s trial kept
            lines.append(f"reservations in decode: {entry['reservations']}")
        if "visual_tokens_before" in entry:
            before, after = entry["visual_tokens_before"], entry["visual_tokens_after"]
            lines.append(f"visual tokens: {before} -> {after} ({entry.get('compression')} compression, "
                         f"{entry.get('pruned_prefills', 0)} of {entry.get('prefills', 0)} prefills pruned)")
    return lines


def _show(key: str, value: Any) -> str:
    if key.startswith("bytes"):
        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)

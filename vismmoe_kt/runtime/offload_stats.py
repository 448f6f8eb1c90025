"""What the offload runtime counts, per MoE layer and phase, and its whole-runtime summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .budget import human_bytes

PHASES = ("prefill", "decode")


@dataclass
class LayerCounters:
    hits: int = 0
    late: int = 0
    misses: int = 0      # fetched and waited for
    cpu: int = 0         # computed on the CPU instead (hybrid mode)
    cpu_pairs: int = 0   # token-expert pairs computed on the CPU
    cpu_seconds: float = 0.0  # host time waiting for the CPU backend after the GPU work was queued
    calls: int = 0


def layer_stats(runtime: Any, layer: int) -> dict[str, Any]:
    out = {}
    for phase in PHASES:
        c = runtime.counters[phase].get(layer, LayerCounters())
        out.update({f"{phase}_hits": c.hits, f"{phase}_late": c.late, f"{phase}_misses": c.misses})
        if runtime.cpu is not None:
            out.update({f"{phase}_cpu_experts": c.cpu, f"{phase}_cpu_pairs": c.cpu_pairs,
                        f"{phase}_cpu_wait_seconds": round(c.cpu_seconds, 6)})
    return out


def pinned_reason(runtime: Any) -> str | None:
    """Why the runtime pinned what it did: Eq. 10's range and, for `auto`, the predicted decode times."""
    choice = getattr(runtime, "depth_choice", None)
    if choice is None:
        return None
    return f"{choice.reason} [{choice.basis}]" if choice.basis else choice.reason


def summary(runtime: Any) -> dict[str, Any]:
    """Whole-runtime figures per phase (copies, stalls, evictions), resolving pending CUDA timings."""
    if runtime.transfers is not None and runtime.transfers.cuda:
        torch.cuda.synchronize(runtime.device)
    settings = runtime.settings
    pool = runtime.pool
    out: dict[str, Any] = {
        "policy": settings.policy,
        "pinned_layers": len(runtime.pinned),
        "pinned_layers_reason": pinned_reason(runtime),
        "plan": runtime.plan.describe(),  # what the runtime chose and why (lines for --stats)
        # the ranking decode runs and why: the rule's, or `auto`'s trial and its two medians (eviction.py)
        "eviction": runtime.boundary.eviction.describe(),
        # when decode reserved its landing slabs and why: the rule's, or `auto`'s trial (reservations.py)
        "reservations": runtime.boundary.reservations.describe(),
        "slabs": runtime.num_slabs,
        # every offloaded expert in a resident slab as the last decode started: its steps had no upkeep between them
        "decode_settled": bool(getattr(runtime.table, "settled", False)),
        "slab_format": "quantized" if runtime.quantized_slabs else "dequantized",  # resolved: dequantized (the model's dtype) | quantized (the store's blocks)
        "expert_budget": human_bytes(settings.expert_budget),
        "miss_policy": settings.miss_policy,
        "host_reads": runtime.host_reads,  # device->host synchronisations: one per offloaded layer call
        "bytes_host_store": runtime.store.nbytes,
        "bytes_gpu_experts": sum(t.numel() * t.element_size() for bank in runtime.banks.values() for t in bank)
        + (sum(t.numel() * t.element_size() for t in pool) if pool is not None and runtime.num_slabs else 0),
    }
    for phase in PHASES:
        cache, copies = runtime.cache_counters[phase], runtime.copy_counters[phase]
        copies.resolve()
        out.update({
            f"{phase}_evictions": cache.evictions, f"{phase}_prefetches": cache.prefetches,
            f"{phase}_fetches": cache.fetches, f"bytes_copied_{phase}": copies.bytes_copied,
            f"{phase}_prefetch_used": cache.prefetch_used, f"{phase}_prefetch_wasted": cache.prefetch_wasted,
            f"bytes_host_reads_{phase}": copies.bytes_host_reads,
            f"{phase}_copy_seconds": round(copies.copy_seconds, 6),
            f"{phase}_stall_seconds": round(copies.stall_seconds, 6),
        })
    if runtime.cpu is not None:
        out["cpu_backend"] = runtime.cpu.describe()
        out["bytes_cpu_backend"] = runtime.cpu.host_bytes
    for total in ("evictions", "prefetches", "fetches", "copy_seconds", "stall_seconds", "prefetch_used",
                  "prefetch_wasted"):
        out[total] = round(sum(out[f"{phase}_{total}"] for phase in PHASES), 6)
    out["bytes_copied"] = sum(out[f"bytes_copied_{phase}"] for phase in PHASES)
    settled = out["prefetch_used"] + out["prefetch_wasted"]  # prefetches used, or evicted unused, so far
    out["prefetch_precision"] = round(out["prefetch_used"] / settled, 4) if settled else None
    out["bytes_prefetch_wasted"] = out["prefetch_wasted"] * runtime.store.block_bytes
    # expert bytes that crossed PCIe: copies into slabs, and the decode kernels' direct reads of misses
    out["bytes_over_pcie"] = out["bytes_copied"] + sum(out[f"bytes_host_reads_{phase}"] for phase in PHASES)
    return out

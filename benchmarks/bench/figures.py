"""What each configuration is judged by besides time, from the runtime's own counters.

Counters are differences over the measured repetitions only (warm-up excluded). Per phase the
offload runtime counts, for each MoE layer call, every distinct expert the tokens need as a hit,
a late prefetch (waited on), a miss (fetched and waited on) or a CPU expert (hybrid mode).

    hit rate           (hits + late) / needed, per phase, over offloaded layers only (pinned layers
                       are not counted: they always hit), so it is not comparable across prefixes
    bytes per token    expert bytes copied in decode / decoded tokens; prefill: per prefill
    copy hidden        1 - (time compute waited on copies) / (time spent copying)
    CPU-expert share   experts computed on the CPU / needed (1 for KT-style, where all are)
    copy bound         time to copy once every offloaded expert the request touches, at the copy
                       bandwidth measured in this run: what a cold cache must move. Prefill: seconds
                       per prefill; decode: the tokens/s that copying alone would allow
    Belady decode      with a routing source (synthetic or a trace): the optimal offline hit rate of a
                       per-layer cache of slabs / offloaded layers experts over the measured requests'
                       decode steps and offloaded layers, the prompt replayed token by token first to
                       warm it (first touches in decode count as misses, as in the runtime's rate).
                       The runtime's cache is shared by all layers and prefills all tokens at once, so
                       this is a yardstick, not a bound it must stay under.
"""

from __future__ import annotations

from typing import Any

FIGURE_KEYS = ("hit_rate_prefill", "hit_rate_decode", "bytes_per_prefill", "bytes_per_decode_token",
               "copy_hidden_fraction", "cpu_expert_share", "touched_bytes_prefill", "touched_bytes_per_decode_token",
               "copy_bound_prefill_s", "copy_bound_decode_tok_s", "belady_hit_rate_decode", "prefetch_precision",
               "prefetch_wasted_bytes", "counters")
COUNTERS = ("hits", "late", "misses", "cpu_experts")
RUNTIME_KEYS = tuple(f"{phase}_{c}" for phase in ("prefill", "decode") for c in COUNTERS) + (
    "bytes_copied_prefill", "bytes_copied_decode", "bytes_host_reads_decode", "copy_seconds", "stall_seconds",
    "prefetch_used", "prefetch_wasted")


def runtime_counters(stats: dict[str, Any]) -> dict[str, float] | None:
    """The offload runtime's counters out of `collect_stats`, or None when the model has no runtime."""
    ops = stats["operators"].get("VisExperts")
    return {k: ops.get(k, 0) for k in RUNTIME_KEYS} if ops else None


def difference(after: dict[str, float] | None, before: dict[str, float] | None) -> dict[str, float] | None:
    return None if after is None else {k: after[k] - before[k] for k in after}


def belady_decode(history: list[dict[str, Any]], decode_tokens: int, offloaded: list[int], slabs: int) -> float | None:
    """Belady's hit rate over the decode steps of these requests, at the offloaded layers' share of slabs."""
    from vismmoe_kt.routing import belady_hit_rate

    if not offloaded or not history or slabs < 1:
        return None
    capacity = max(slabs // len(offloaded), 1)
    # the prompt replayed token by token warms the cache, the decode steps are counted, first touches included
    rates = [belady_hit_rate(request["ids"][:request["prompt"] + decode_tokens][:, offloaded], capacity,
                             include_cold=True, start=request["prompt"]) for request in history]
    rates = [r for r in rates if r == r]  # NaN: too few steps to touch any expert twice
    return sum(rates) / len(rates) if rates else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def offload_figures(delta: dict[str, float], repeats: int, decode_tokens: int, block_bytes: int,
                    bandwidth: float) -> dict[str, Any]:
    needed = {phase: sum(delta[f"{phase}_{c}"] for c in COUNTERS) for phase in ("prefill", "decode")}
    decoded = repeats * decode_tokens
    touched_prefill = needed["prefill"] / repeats * block_bytes
    touched_per_token = needed["decode"] / decoded * block_bytes if decoded else 0
    return {
        "hit_rate_prefill": _ratio(delta["prefill_hits"] + delta["prefill_late"], needed["prefill"]),
        "hit_rate_decode": _ratio(delta["decode_hits"] + delta["decode_late"], needed["decode"]),
        "bytes_per_prefill": delta["bytes_copied_prefill"] / repeats,
        # copies into slabs plus misses the decode kernels read from the host in place: bytes over PCIe
        "bytes_per_decode_token": _ratio(delta["bytes_copied_decode"] + delta["bytes_host_reads_decode"], decoded),
        "copy_hidden_fraction": (1 - delta["stall_seconds"] / delta["copy_seconds"]) if delta["copy_seconds"] else None,
        "cpu_expert_share": _ratio(delta["prefill_cpu_experts"] + delta["decode_cpu_experts"],
                                   needed["prefill"] + needed["decode"]),
        "touched_bytes_prefill": touched_prefill,
        "touched_bytes_per_decode_token": touched_per_token,
        "copy_bound_prefill_s": touched_prefill / bandwidth,
        "copy_bound_decode_tok_s": _ratio(bandwidth, touched_per_token),
        # of the prefetched experts settled in these requests: used before eviction, or evicted unused
        "prefetch_precision": _ratio(delta["prefetch_used"], delta["prefetch_used"] + delta["prefetch_wasted"]),
        "prefetch_wasted_bytes": delta["prefetch_wasted"] * block_bytes / repeats,
        "counters": delta,
    }

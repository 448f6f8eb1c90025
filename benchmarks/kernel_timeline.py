"""Where a decode step's time goes on the device: one request under torch.profiler, its kernels
summed by name and by stream, and how much of the wall time any kernel was running at all.

The lean path replays each decode step as one CUDA graph, so `--profile`'s per-piece timing (which
runs the pieces eagerly) cannot see inside it; CUPTI still reports every kernel a graph launches.
"idle" is the decode wall time during which no kernel ran (host work between steps, syncs, or waits
on copies); "overlap" is kernel time beyond the busy union (streams running at once). The kernels
launched before decode's first replay are the prompt's prefill, summarized the same way as one "step"
(`prefill`). The prompt replays graphs of its own (the vision tower's), so decode's first replay is found
from the first token's arrival, marked in the trace (FIRST_TOKEN): the first graph launch after the last
eager kernel launch before it (decode steps may be launched ahead of the first token's arrival, the
prompt's kernels cannot be).
"""

from __future__ import annotations

import gzip
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from benchmarks.bench.timing import FIRST_TOKEN, mark_first_token, timed_generate


def _busy(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of [start, end) intervals."""
    total, end_so_far = 0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total


LONG_GAP_NS = 20_000  # a gap between kernels longer than this is the host's (a graph's own gaps are a few us)


def _gaps(intervals: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(short gaps ns, long gaps ns, long gap count) between the busy union's pieces."""
    short = long = count = 0
    end_so_far = None
    for start, end in sorted(intervals):
        if end_so_far is not None and start > end_so_far:
            gap = start - end_so_far
            if gap > LONG_GAP_NS:
                long, count = long + gap, count + 1
            else:
                short += gap
        end_so_far = end if end_so_far is None else max(end_so_far, end)
    return short, long, count


def summarize(kernels: list[tuple[str, int, int, int]], steps: int, top: int = 25) -> dict:
    """kernels: (name, stream, start ns, duration ns) of every device kernel in the decode window.
    The idle time splits into short gaps (between kernels a graph launches back to back: launch
    latency) and long ones (the device waiting on the host: between steps, syncs)."""
    if not kernels:
        return {"kernels": 0}
    by_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_stream: dict[int, int] = defaultdict(int)
    for name, stream, _, duration in kernels:
        by_name[name][0] += duration
        by_name[name][1] += 1
        by_stream[stream] += duration
    window = max(s + d for _, _, s, d in kernels) - min(s for _, _, s, _ in kernels)
    busy = _busy([(s, s + d) for _, _, s, d in kernels])
    short, long, long_count = _gaps([(s, s + d) for _, _, s, d in kernels])
    per_step = lambda ns: ns / steps / 1e6  # noqa: E731  milliseconds per decode step
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps, "kernels": len(kernels),
        "window_ms_per_step": per_step(window), "busy_ms_per_step": per_step(busy),
        "idle_ms_per_step": per_step(window - busy),
        "short_gaps_ms_per_step": per_step(short), "long_gaps_ms_per_step": per_step(long),
        "long_gaps_per_step": long_count / steps,
        "overlap_ms_per_step": per_step(sum(by_stream.values()) - busy),
        "streams_ms_per_step": {str(k): per_step(v) for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:120], "ms_per_step": per_step(ns), "calls_per_step": count / steps}
                        for name, (ns, count) in ranked],
    }


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def decode_start(launches: list[tuple[int, bool]], first_token_ns: int | None) -> int | None:
    """The host time (ns) of decode's first graph launch, from the host's launches (start ns, a graph launch
    or not) and the first token's mark: the first graph launch after the last eager launch before the mark.
    Without a mark, the first graph launch; None without graph launches (an eager run)."""
    graphs = sorted(start for start, graph in launches if graph)
    if not graphs:
        return None
    if first_token_ns is None:
        return graphs[0]
    prompt_end = max((start for start, graph in launches if not graph and start < first_token_ns), default=None)
    after = [start for start in graphs if prompt_end is None or start > prompt_end]
    return after[0] if after else graphs[0]


def profile_kernels(model, request: dict, decode_tokens: int, trace_path: Path | None = None) -> dict:
    """One more request under torch.profiler; the decode window's kernels summarized (see summarize)."""
    rate: list[float] = []

    def run() -> int:
        rate.append(timed_generate(model, request, decode_tokens, on_first_token=mark_first_token).decode_tok_s)
        return decode_tokens

    summary = profile_run(run, trace_path)
    summary["wall_ms_per_step"] = 1e3 / rate[0]
    return summary


def profile_run(run: Callable[[], int], trace_path: Path | None = None) -> dict:
    """`run()` under torch.profiler (it returns its decode steps); the kernels from decode's first graph
    replay on summarized per step (see summarize, decode_start), and those queued before it as the prompt's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # PROFILE_STACKS=1: Python frames in the trace too (host_trace.py names the code behind each wait)
    with profile(activities=activities, with_stack=os.environ.get("PROFILE_STACKS") == "1") as prof:
        steps = run()
    events = prof.profiler.kineto_results.events()
    launch_events = [e for e in events if "GraphLaunch" in e.name() or e.name() in KERNEL_LAUNCHES]
    # a kernel belongs to the launch that queued it (CUPTI's correlation id, shared by the two): the device
    # runs behind the host, so a prompt's kernel may start after decode's first launch. A kernel no launch
    # claims (a copy) counts by its own start
    launched_at = {e.correlation_id(): e.start_ns() for e in launch_events}
    rows = sorted(((e.name(), e.device_resource_id(), e.start_ns(), e.duration_ns(),
                    launched_at.get(e.correlation_id(), e.start_ns())) for e in events
                   if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0), key=lambda k: k[2])
    marks = [e.start_ns() for e in events if e.name() == FIRST_TOKEN]
    # decode starts at its first graph replay (the warm-up captured every graph before this request); an
    # eager run has no replay and is summarized whole, prefill included (the summary says so)
    start = decode_start([(e.start_ns(), "GraphLaunch" in e.name()) for e in launch_events], min(marks, default=None))
    decode = [row[:4] for row in rows if start is None or row[4] >= start]
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        raw = trace_path.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    summary = summarize(decode, steps)
    summary["window"] = "decode (from its first graph replay)" if start is not None else \
        "the whole request (no graph replays)"
    if start is not None:  # what was launched before decode's first replay: the prompt's prefill (vision tower included)
        summary["prefill"] = summarize([row[:4] for row in rows if row[4] < start], 1)
    return summary

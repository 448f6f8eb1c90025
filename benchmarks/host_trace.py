"""Where the host's time goes in a profiled request: a torch.profiler chrome trace (what `decode_bench
--kernels` writes as trace-*.json.gz) read back, the prefill window (everything before decode's first CUDA
graph launch, found from the first token's mark: kernel_timeline.decode_start) summarized by runtime call
and by top-level op, and how much of the window those ops cover (the rest is Python between them).

    python -m benchmarks.host_trace OUT/trace-*.json.gz

A prefill whose kernels keep the device busy for a small part of its window is bound by the host: this
says whether by launches (many runtime calls), by syncs (cudaStreamSynchronize, device-to-host copies)
or by Python (top-level ops covering little of the window).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

from benchmarks.kernel_timeline import FIRST_TOKEN, KERNEL_LAUNCHES, decode_start
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter

HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")  # cuda_driver: Triton's launches
PROJECT = "vismmoe_kt/"  # a Python frame of this project's code (with PROFILE_STACKS=1 the trace has them)


def load_events(path: str | Path) -> list[dict]:
    """The trace's complete events ("ph": "X") with a duration."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def prefill_summary(events: list[dict], top: int = 20) -> dict:
    """The host's events before decode's first graph launch (kernel_timeline.decode_start; all of them when there
    is none): the window, per category the total and the top names by time, and the top-level ops' share of
    the window."""
    launches = [(e["ts"], "GraphLaunch" in e["name"]) for e in events
                if "GraphLaunch" in e.get("name", "") or e.get("name") in KERNEL_LAUNCHES]
    marks = [e["ts"] for e in events if e.get("name") == FIRST_TOKEN]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    if not host:
        return {"window_ms": 0.0, "categories": {}, "top_level_ms": 0.0, "top_level_share": 0.0}
    end = decode_start(launches, min(marks, default=None))  # decode's first replay, not the vision tower's
    end = end if end is not None else max(e["ts"] + e["dur"] for e in host)
    host = [e for e in host if e["ts"] < end]
    start = min(e["ts"] for e in host)
    window_ms = (end - start) / 1e3
    by: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    for e in host:
        entry = by[(e["cat"], e["name"])]
        entry[0] += e["dur"] / 1e3
        entry[1] += 1
    categories = {}
    for cat in HOST_CATEGORIES:
        rows = sorted(((name, ms, n) for (c, name), (ms, n) in by.items() if c == cat), key=lambda r: -r[1])
        categories[cat] = {"total_ms": sum(r[1] for r in rows), "calls": sum(r[2] for r in rows),
                           "top": [{"name": name[:100], "ms": ms, "calls": n} for name, ms, n in rows[:top]]}
    covered, edge = 0.0, float("-inf")
    for e in sorted((e for e in host if e["cat"] == "cpu_op"), key=lambda e: e["ts"]):
        if e["ts"] >= edge:  # not nested in the op before it
            covered += e["dur"] / 1e3
            edge = e["ts"] + e["dur"]
    return {"window_ms": window_ms, "categories": categories, "top_level_ms": covered,
            "top_level_share": covered / window_ms if window_ms else 0.0,
            "waits": waits_by_op(host, [e for e in events if e.get("cat") == "python_function" and e["ts"] < end])}


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def waits_by_op(host: list[dict], python: list[dict] = ()) -> list[dict]:
    """The host's waits and copies (WAITS) by the innermost op that issued them, and by that op's outermost
    enclosing op (what the model's code called), or, where the trace has Python frames, the innermost
    frame of this project's code: where a prefill reads the device back."""
    ops = sorted((e for e in host if e["cat"] == "cpu_op"), key=lambda e: e["ts"])
    counts: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0.0])
    for call in (e for e in host if e["cat"] == "cuda_runtime" and e["name"] in WAITS):
        around = [op for op in ops if op["ts"] <= call["ts"] and op["ts"] + op["dur"] >= call["ts"] + call["dur"]
                  and op.get("tid") == call.get("tid")]
        inner = min(around, key=lambda op: op["dur"])["name"] if around else "(no op)"
        outer = max(around, key=lambda op: op["dur"])["name"] if around else "(no op)"
        # with Python frames in the trace (PROFILE_STACKS=1): the innermost frame of this project's code
        frames = [f for f in python if f["ts"] <= call["ts"] and f["ts"] + f["dur"] >= call["ts"] + call["dur"]
                  and PROJECT in f["name"]]
        if frames:
            outer = min(frames, key=lambda f: f["dur"])["name"].split(PROJECT, 1)[1]
            # and the innermost library frame beneath it (a model's own code, e.g. transformers')
            below = [f for f in python if f["ts"] <= call["ts"] and f["ts"] + f["dur"] >= call["ts"] + call["dur"]
                     and ".py(" in f["name"] and "torch/" not in f["name"] and PROJECT not in f["name"]]
            if below:
                outer += " > " + min(below, key=lambda f: f["dur"])["name"].rsplit("/", 1)[-1]
        entry = counts[(call["name"], inner, outer)]
        entry[0] += 1
        entry[1] += call["dur"] / 1e3
    rows = sorted(counts.items(), key=lambda kv: -kv[1][0])
    return [{"call": c, "op": inner[:60], "outermost": outer[:60], "count": n, "ms": ms}
            for (c, inner, outer), (n, ms) in rows]


def report(summary: dict) -> str:
    lines = [f"prefill window {summary['window_ms']:.1f} ms; top-level ops cover {summary['top_level_ms']:.1f} ms "
             f"({summary['top_level_share']:.0%}), the rest is Python between them"]
    for cat, part in summary["categories"].items():
        lines.append(f"{cat}: {part['total_ms']:.1f} ms in {part['calls']} calls")
        lines += [f"  {t['ms']:8.2f} ms {t['calls']:6d}  {t['name']}" for t in part["top"]]
    lines.append("waits and copies by the op that issued them (innermost / outermost):")
    lines += [f"  {w['count']:5d} {w['ms']:7.2f} ms  {w['call']}  {w['op']} / {w['outermost']}"
              for w in summary.get("waits", [])[:25]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("traces", nargs="+", help="chrome traces (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=20, help="names listed per category (by time)")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(f"== {path}")
        print(report(prefill_summary(load_events(path), args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

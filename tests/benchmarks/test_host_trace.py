"""The host-trace summary (benchmarks/host_trace.py): the prefill window ends at the first graph launch,
ops nested in another count once toward the window's coverage, runtime calls are totalled per name; and
it reads the trace a CPU run of decode_bench --kernels writes."""

import gzip
import json
import subprocess
import sys

import pytest

from benchmarks.host_trace import load_events, main, prefill_summary


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_the_prefill_window_ends_at_the_first_graph_launch(tmp_path):
    events = [event("cpu_op", "aten::linear", 0, 400), event("cpu_op", "aten::mm", 50, 300),  # nested: once
              event("cuda_runtime", "cudaLaunchKernel", 60, 10), event("cuda_runtime", "cudaLaunchKernel", 500, 10),
              event("cpu_op", "aten::add", 600, 100), event("cuda_runtime", "cudaStreamSynchronize", 750, 150),
              event("cuda_runtime", "cudaGraphLaunch", 1000, 20), event("cpu_op", "aten::argmax", 1100, 50)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, f)
    summary = prefill_summary(load_events(path))
    assert summary["window_ms"] == pytest.approx(1.0)             # 0 .. the launch at 1000 us
    assert summary["top_level_ms"] == pytest.approx(0.5)          # linear 400 + add 100; mm inside linear
    assert summary["top_level_share"] == pytest.approx(0.5)
    runtime = summary["categories"]["cuda_runtime"]
    assert runtime["calls"] == 3 and runtime["top"][0]["name"] == "cudaStreamSynchronize"
    assert {t["name"] for t in summary["categories"]["cpu_op"]["top"]} == {"aten::linear", "aten::mm", "aten::add"}
    assert main([str(path)]) == 0


def test_it_reads_a_cpu_runs_trace(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--tiny", "tiny-6x64",
                    "--device", "cpu", "--reps", "1", "--decode-tokens", "2", "--configs", "offload:expert_budget=1TiB",
                    "--kernels"], check=True, capture_output=True, timeout=300)
    summary = prefill_summary(load_events(next(out.glob("trace-*.json.gz"))))
    assert summary["window_ms"] > 0 and summary["categories"]["cpu_op"]["calls"] > 100
    assert 0 < summary["top_level_share"] <= 1

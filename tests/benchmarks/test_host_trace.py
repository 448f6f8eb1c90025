"""The host-trace summary (benchmarks/host_trace.py): the prefill window ends at decode's first graph launch,
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


def test_the_vision_towers_replay_does_not_end_the_window_where_the_first_token_is_marked(tmp_path):
    """The prompt replays the vision tower's graph (at 200) before its eager layers; decode's first replay
    (1000) is the first graph launch after the last eager launch before the first token's mark (1050)."""
    from benchmarks.kernel_timeline import FIRST_TOKEN

    events = [event("cuda_runtime", "cudaLaunchKernel", 0, 10), event("cuda_runtime", "cudaGraphLaunch", 200, 20),
              event("cpu_op", "aten::linear", 300, 400), event("cuda_driver", "cuLaunchKernel", 500, 10),
              event("cuda_runtime", "cudaGraphLaunch", 1000, 20), event("user_annotation", FIRST_TOKEN, 1050, 1),
              event("cuda_runtime", "cudaGraphLaunch", 1100, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert prefill_summary(load_events(path))["window_ms"] == pytest.approx(1.0)   # 0 .. 1000 us, not .. 200
    path.write_text(json.dumps({"traceEvents": events[:5] + events[6:]}))          # no mark: the first replay
    assert prefill_summary(load_events(path))["window_ms"] == pytest.approx(0.2)


def test_waits_are_told_by_the_op_that_issued_them(tmp_path):
    """A sync inside aten::item inside aten::linear counts for both (innermost / outermost); one outside
    every op for none; a kernel launch is no wait."""
    events = [event("cpu_op", "aten::linear", 0, 400), event("cpu_op", "aten::item", 100, 100),
              event("cuda_runtime", "cudaStreamSynchronize", 120, 50), event("cuda_runtime", "cudaLaunchKernel", 20, 5),
              event("cuda_runtime", "cudaMemcpyAsync", 500, 10), event("cuda_runtime", "cudaStreamSynchronize", 130, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    waits = prefill_summary(load_events(path))["waits"]
    assert [(w["call"], w["op"], w["outermost"], w["count"]) for w in waits] == [
        ("cudaStreamSynchronize", "aten::item", "aten::linear", 2), ("cudaMemcpyAsync", "(no op)", "(no op)", 1)]
    assert waits[0]["ms"] == pytest.approx(0.07)
    # with Python frames (PROFILE_STACKS=1): the innermost frame of the project's code names the wait
    frames = [event("python_function", "/x/vismmoe_kt/engine/a.py(3): outer", 0, 450),
              event("python_function", "/x/vismmoe_kt/runtime/b.py(9): reads", 110, 80),
              event("python_function", "/x/torch/nn/f.py(1): inner", 115, 60)]
    path.write_text(json.dumps({"traceEvents": events + frames}))
    waits = prefill_summary(load_events(path))["waits"]
    assert (waits[0]["op"], waits[0]["outermost"], waits[0]["count"]) == ("aten::item", "runtime/b.py(9): reads", 2)


def test_it_reads_a_cpu_runs_trace(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--tiny", "tiny-6x64",
                    "--device", "cpu", "--reps", "1", "--decode-tokens", "2", "--configs", "offload:expert_budget=1TiB",
                    "--kernels"], check=True, capture_output=True, timeout=300)
    summary = prefill_summary(load_events(next(out.glob("trace-*.json.gz"))))
    assert summary["window_ms"] > 0 and summary["categories"]["cpu_op"]["calls"] > 100
    assert 0 < summary["top_level_share"] <= 1

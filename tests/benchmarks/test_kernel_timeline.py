"""The decode-step kernel summary: busy time is the union of kernel intervals, overlap what streams
ran at once, idle the rest of the window, all per step; and a CPU run of decode_bench --kernels
reports its window without a GPU."""

import json
import subprocess
import sys

import pytest

from benchmarks.decode_bench import kernel_report
from benchmarks.kernel_timeline import _busy, decode_start, summarize


def test_busy_is_the_union_of_intervals():
    assert _busy([(0, 10), (5, 15), (20, 30)]) == 25
    assert _busy([(20, 30), (0, 10), (2, 3)]) == 20
    assert _busy([]) == 0


def test_summary_splits_busy_idle_and_overlap_per_step():
    ms = 1_000_000
    # two steps: a main-stream kernel of 4 ms, a side-stream one of 3 ms overlapping it by 1 ms, then a gap
    kernels = [("gemv", 7, 0, 4 * ms), ("copy", 9, 3 * ms, 3 * ms),
               ("gemv", 7, 10 * ms, 4 * ms), ("copy", 9, 13 * ms, 3 * ms)]
    s = summarize(kernels, steps=2)
    assert s["window_ms_per_step"] == pytest.approx(8.0)   # 0 .. 16 ms
    assert s["busy_ms_per_step"] == pytest.approx(6.0)     # 0-6 and 10-16
    assert s["idle_ms_per_step"] == pytest.approx(2.0)
    assert s["overlap_ms_per_step"] == pytest.approx(1.0)  # 7 ms of kernels in 6 ms busy
    assert s["streams_ms_per_step"] == {"7": pytest.approx(4.0), "9": pytest.approx(3.0)}
    assert [t["name"] for t in s["top_kernels"]] == ["gemv", "copy"]
    assert s["top_kernels"][0]["calls_per_step"] == 1.0
    report = kernel_report([{"config": "lean:1GiB", "kernels": {**s, "wall_ms_per_step": 9.0, "window": "decode"}}])
    assert s["long_gaps_ms_per_step"] == pytest.approx(2.0) and s["long_gaps_per_step"] == 0.5  # the 4 ms gap
    assert s["short_gaps_ms_per_step"] == 0
    assert "| lean:1GiB | 9.00 | 6.00 | 2.00 | 2.00 (0.5 a step) | 1.00 | 7: 4.00, 9: 3.00 |" in report
    assert "prefill" not in report


def test_gaps_split_into_a_graphs_own_and_the_hosts():
    us = 1_000
    kernels = [("a", 7, 0, 10 * us), ("b", 7, 12 * us, 10 * us), ("c", 7, 100 * us, 10 * us), ("d", 7, 111 * us, 5 * us)]
    s = summarize(kernels, steps=1)
    assert s["short_gaps_ms_per_step"] == pytest.approx(0.003)   # 2 us + 1 us
    assert s["long_gaps_ms_per_step"] == pytest.approx(0.078)    # 78 us
    assert s["long_gaps_per_step"] == 1


def test_the_report_gives_the_prefill_before_the_first_replay():
    ms = 1_000_000
    decode = summarize([("gemv", 7, 10 * ms, 2 * ms)], steps=1)
    prefill = summarize([("grouped_mm", 7, 0, 3 * ms), ("vision", 7, 4 * ms, 1 * ms)], steps=1)
    assert prefill["window_ms_per_step"] == pytest.approx(5.0) and prefill["idle_ms_per_step"] == pytest.approx(1.0)
    report = kernel_report([{"config": "c", "kernels": {**decode, "window": "decode", "prefill": prefill}}])
    assert "c, the prefill before it: 5.00 ms from its first kernel to its last, 4.00 busy, 2 kernels" in report
    assert "| `grouped_mm` | 3.000 | 1 |" in report


def test_decode_starts_after_the_prompts_last_eager_launch_not_at_the_vision_towers_replay():
    """Host launches (start, graph launch): the prompt's eager kernels, the vision tower's graph among them,
    then decode's graphs, one launched ahead of the first token's arrival (the mark at 50)."""
    launches = [(1, False), (2, False), (5, True), (10, False), (30, False), (40, True), (60, True), (70, True)]
    assert decode_start(launches, first_token_ns=50) == 40      # not the tower's replay at 5
    assert decode_start(launches, first_token_ns=None) == 5      # no mark: the first replay
    assert decode_start([(1, False), (2, False)], 50) is None    # eager: no window
    assert decode_start([(5, True), (60, True)], 50) == 5       # no eager launch at all: the first replay
    assert decode_start([(1, False), (5, True), (60, False)], 50) == 5  # an eager launch after the mark: decode's


def test_the_first_token_is_marked_once_as_it_arrives():
    """timed_generate's `on_first_token` runs once, when the first new token reaches the host (before the rest)."""
    import torch

    from benchmarks.bench.timing import _MarkingStreamer

    seen = []
    streamer = _MarkingStreamer(lambda: seen.append(len(streamer.token_times)))
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt: skipped
    assert seen == []
    streamer.put(torch.tensor([7]))
    streamer.put(torch.tensor([8]))
    assert seen == [1] and len(streamer.token_times) == 2


def test_decode_bench_kernels_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--tiny",
                    "tiny-6x64", "--device", "cpu", "--reps", "1", "--decode-tokens", "3", "--configs", "offload:expert_budget=12MiB",
                    "--kernels"], check=True, capture_output=True, timeout=300)
    row = json.loads((out / "decode_bench.json").read_text())["rows"][0]
    assert row["kernels"]["window"] == "the whole request (no graph replays)"  # no CUDA: no device kernels
    assert row["kernels"]["wall_ms_per_step"] > 0
    assert (out / "kernels.md").exists() and list(out.glob("trace-offload_expert_budget=12MiB.json.gz"))


def test_a_batched_run_marks_its_first_token_once():
    """The concurrency run's profile marks the prompts' end as the first token of any request arrives."""
    from benchmarks.bench.concurrency import _run

    class Runner:  # every step gives each request a token, until each has its tokens
        def __init__(self):
            self.requests, self.left = [], 0

        def add(self, request):
            self.requests.append(request)
            self.left = request.max_new_tokens

        @property
        def idle(self):
            return self.left == 0

        def step(self):
            for request in self.requests:
                request.on_token(7)
            self.left -= 1
            return len(self.requests), None

    marks = []
    times, steps = _run(Runner(), [{}, {}, {}], 4, on_first_token=lambda: marks.append(True))
    assert marks == [True] and [len(t) for t in times] == [4, 4, 4] and len(steps) == 4

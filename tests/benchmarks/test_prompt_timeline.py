"""benchmarks/prompt_timeline.py: a tiny model's prompts on the CPU, each stage marked by the hooks, and its
summary's arithmetic on hand-made marks."""

import json

import pytest

from benchmarks import prompt_timeline
from benchmarks.bench import timing


def test_summary_counts_the_layers_the_gpu_finished_right_after_the_host():
    marks = []
    for i, (host_end, gpu_end) in enumerate([(1.0, 1.02), (2.0, 3.5), (3.0, 3.03)]):
        marks.append({"stage": f"layer {i}", "edge": "start", "host_ms": host_end - 0.5, "gpu_ms": gpu_end - 0.4})
        marks.append({"stage": f"layer {i}", "edge": "end", "host_ms": host_end, "gpu_ms": gpu_end})
    summary = prompt_timeline.summarize(marks, 4.0)
    assert summary["layers"] == 3
    assert summary["layers_gpu_waiting_for_host"] == 2  # layers 0 and 2: done within 50 us of their issue
    assert summary["layer_host_ms_median"] == pytest.approx(0.5)
    assert summary["layer_gpu_ms_median"] == pytest.approx(0.4)
    assert summary["gpu_behind_host_ms_at_last_layer"] == pytest.approx(0.03)
    assert summary["first_layer_start_host_ms"] == pytest.approx(0.5)


def test_a_tiny_models_prompts_marked_layer_by_layer_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "timeline"
    assert prompt_timeline.main(["--config", "offload:expert_budget=1GiB", "--out", str(out), "--tiny", "tiny-2x8",
                                 "--device", "cpu", "--image-size", "224", "--text-tokens", "24", "--rounds", "2",
                                 "--split", "--profile", "--top", "5"]) == 0
    result = json.loads((out / "prompt_timeline.json").read_text())
    assert set(result["prompts"]) == {"224 px", "text 24"}
    picture = result["prompts"]["224 px"]
    assert len(picture["runs"]) == 2
    assert all(run["layers"] == 2 for run in picture["runs"])  # tiny-2x8: two decoder layers, each marked once
    stages = [m["stage"] for m in picture["last_marks"] if m["edge"] == "end"]
    assert stages.index("vision") < stages.index("layer 0") < stages.index("layer 1")
    parts = result["prompts"]["text 24"]["split"]["parts"]
    assert parts["layer"]["calls_per_prompt"] == 2  # the prompt's two layer calls; the decode step's are not counted
    assert parts["attention"]["calls_per_prompt"] == 2
    assert parts["layer"]["ms_per_prompt"] >= parts["attention"]["ms_per_prompt"] > 0  # callees within their caller
    assert "vision_host_ms" not in result["prompts"]["text 24"]["runs"][0]
    assert "Ordered by: internal time" in (out / "profile.txt").read_text()
    assert "first layer issued at" in capsys.readouterr().out


def test_no_prompt_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prompt_timeline.main(["--config", "lru:expert_budget=1GiB", "--out", str(tmp_path), "--image-size", "0"])
    assert "no prompt to time" in capsys.readouterr().err


def test_the_clock_counts_from_the_prompts_first_origin_and_says_when_it_never_ran():
    import torch

    model, tower, layer = torch.nn.Sequential(torch.nn.Identity()), torch.nn.Identity(), torch.nn.Identity()
    clock = prompt_timeline.StageClock([model, tower], {"vision": tower, "layer 0": layer}, cuda=False)
    clock.start()
    layer(torch.zeros(1))  # before the prompt's forward: not the prompt's
    tower(torch.zeros(1))  # a runner that builds the text model's inputs itself starts with the tower
    layer(torch.zeros(1))
    model(torch.zeros(1))  # a later origin does not move the clock's start
    marks = clock.stop()
    assert [(m["stage"], m["edge"]) for m in marks] == [("vision", "start"), ("vision", "end"), ("layer 0", "start"),
                                                        ("layer 0", "end")]
    assert all(m["host_ms"] >= 0 and m["gpu_ms"] is None for m in marks)
    assert marks[0]["host_ms"] <= marks[-1]["host_ms"]
    clock.start()
    with pytest.raises(RuntimeError, match="never ran"):
        clock.stop()
    clock.remove()


def test_decode_tokens_put_a_decode_before_each_timed_and_profiled_prompt(tmp_path, monkeypatch):
    """`--decode-tokens N`: each timed prompt (and the profiled one) starts from the cache an N-token decode left,
    as decode_bench's reps do, after warm-ups of that length."""
    calls = []
    real = prompt_timeline.timed_generate

    def recording(model, request, tokens, *args, **kwargs):
        calls.append(tokens)
        return real(model, request, tokens, *args, **kwargs)

    monkeypatch.setattr(prompt_timeline, "timed_generate", recording)
    monkeypatch.setattr(timing, "timed_generate", recording)  # the warm-up's
    assert prompt_timeline.main(["--config", "offload:expert_budget=1GiB", "--out", str(tmp_path), "--tiny",
                                 "tiny-2x8", "--device", "cpu", "--image-size", "224", "--rounds", "2",
                                 "--decode-tokens", "3", "--profile", "--top", "3"]) == 0
    # warm at the decodes' length (one: eager decode captures nothing); two rounds, each a decode then the prompt;
    # the profiled one
    assert calls == [3, 3, 1, 3, 1, 3, 1]


def test_a_negative_decode_count_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prompt_timeline.main(["--config", "lru:expert_budget=1GiB", "--out", str(tmp_path), "--tiny", "tiny-2x8",
                              "--device", "cpu", "--decode-tokens", "-1"])
    assert "--decode-tokens -1" in capsys.readouterr().err


def test_the_links_idle_time_is_split_by_whether_the_next_copy_was_issued():
    from benchmarks.bench.link_log import link_summary

    batches = [
        {"layers": [1], "copies": 10, "issued_ms": 0.5, "start_ms": 1.0, "end_ms": 3.0},
        # issued long before the link went idle at 3.0, started at 4.0: it waited on the device (compute)
        {"layers": [2], "copies": 8, "issued_ms": 1.5, "start_ms": 4.0, "end_ms": 6.0},
        # issued at 7.0, after the link went idle at 6.0: the host was late
        {"layers": [3], "copies": 8, "issued_ms": 7.0, "start_ms": 7.5, "end_ms": 9.0},
        # the urgent stream beside it: overlapping time is counted once
        {"layers": [3], "copies": 1, "issued_ms": 7.6, "start_ms": 8.0, "end_ms": 9.5},
        # right after the last (within GAP_MS): no gap
        {"layers": [4], "copies": 4, "issued_ms": 8.0, "start_ms": 9.51, "end_ms": 10.0},
    ]
    link = link_summary(batches)
    assert link["batches"] == 5 and link["copies"] == 31
    assert link["first_copy_ms"] == 1.0 and link["last_copy_end_ms"] == 10.0
    assert link["busy_ms"] == pytest.approx(2.0 + 2.0 + 1.5 + 0.5 + 0.49)
    assert link["idle_waiting_ms"] == pytest.approx(1.0)
    assert link["idle_host_ms"] == pytest.approx(1.5)
    assert link["idle_ms"] == pytest.approx(9.0 - link["busy_ms"])
    assert [(g["before_layers"], g["cause"]) for g in link["longest_gaps"]] == [([3], "host"), ([2], "waiting")]
    assert link_summary([]) == {"batches": 0, "copies": 0}


def test_an_offloaded_prompts_copies_are_logged_batch_by_batch(tmp_path, capsys):
    """A budget of a layer's experts: every prompt streams most of each layer again, and the log holds each batch
    the runtime issued, on the prompt's clock (the CPU's: copies run as they are issued)."""
    out = tmp_path / "timeline"
    assert prompt_timeline.main(["--config", "lru:expert_budget=50%", "--out", str(out), "--tiny", "tiny-2x8",
                                 "--device", "cpu", "--image-size", "0", "--text-tokens", "48", "--rounds", "2"]) == 0
    result = json.loads((out / "prompt_timeline.json").read_text())
    prompt = result["prompts"]["text 48"]
    for run in prompt["runs"]:
        link = run["link"]
        assert link["copies"] > 0 and link["busy_ms"] > 0
        assert 0 <= link["first_copy_ms"] < link["last_copy_end_ms"] <= run["prefill_ms"]
    batches = prompt["last_link"]
    assert sum(b["copies"] for b in batches) == prompt["runs"][-1]["link"]["copies"]
    assert all(set(b["layers"]) <= {0, 1} and b["start_ms"] <= b["end_ms"] for b in batches)
    assert "; link: " in capsys.readouterr().out


def test_the_link_log_wraps_the_runtimes_issuers_only_while_installed():
    from types import SimpleNamespace

    from benchmarks.bench.link_log import LinkLog

    class Transfers:
        cuda = False

        def __init__(self):
            self.counters = SimpleNamespace(copy_events=[])
            self.issued = []

        def _issue(self, slabs, keys, urgent):
            self.issued.append(list(keys))

    transfers = Transfers()
    log = LinkLog(transfers)
    transfers._issue([0], [(1, 3)], False)  # not armed: passed through, not logged
    log.start()
    transfers._issue([1, 2], [(2, 0), (2, 5)], True)
    batches = log.stop((0.0, None))
    assert [(b["layers"], b["copies"]) for b in batches] == [([2], 2)]
    assert transfers.issued == [[(1, 3)], [(2, 0), (2, 5)]]
    log.remove()
    assert "_issue" not in vars(transfers)  # the class's own method again
    assert LinkLog(None).stop((0.0, None)) == []


def test_the_split_times_a_method_for_every_instance_inside_a_layer_and_puts_it_back(monkeypatch):
    """"module:Class.method": the class's method timed under "Class.method" (the streamed path's runtime methods),
    counted only within a layer's call, and the original restored by `remove`."""
    import sys
    import types

    module = types.ModuleType("fake_runtime")

    class Copier:
        def copy(self, n):
            return n + 1

    module.Copier = Copier
    monkeypatch.setitem(sys.modules, "fake_runtime", module)
    original = Copier.copy
    split = prompt_timeline.HostSplit()
    split.watch_function("fake_runtime:Copier.copy")
    layer = split._timed(split.LAYER, lambda: Copier().copy(1) + Copier().copy(2))
    assert Copier().copy(5) == 6 and split.calls == {}  # outside a layer: not counted
    assert layer() == 5
    assert split.calls == {"Copier.copy": 2, "layer": 1}
    assert split.seconds["layer"] >= split.seconds["Copier.copy"] > 0
    split.remove()
    assert Copier.copy is original

"""benchmarks/trace_replay.py: the copies a shared LRU slab pool makes for recorded traces, counted by hand on
small cases, the pinned prefix never copied, the folders of affinity_study's traces paired by depth."""

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import trace_replay
from benchmarks.trace_replay import SlabPool, replay


def step(active_by_layer, layers, experts, phase):
    active = torch.zeros(layers, experts, dtype=torch.bool)
    for layer, ids in active_by_layer.items():
        active[layer, ids] = True
    return {"active": active, "phase": phase}


def write_request(path, steps, layers, experts):
    """A trace file as vismmoe_kt/predictor/traces.py writes one (what read_trace reads back)."""
    tensors = {"visual": torch.zeros(4, dtype=torch.float16)}
    for s, (active_by_layer, _) in enumerate(steps):
        active = torch.zeros(layers, experts, dtype=torch.uint8)
        for layer, ids in active_by_layer.items():
            active[layer, ids] = 1
        tensors[f"s{s}.active"] = active
        tensors[f"s{s}.hidden"] = torch.zeros(layers, 4, dtype=torch.float16)
    save_file(tensors, str(path), metadata={"steps": str(len(steps)), "moe_layers": json.dumps(list(range(layers))),
                                            "phases": json.dumps([phase for _, phase in steps])})


def test_the_pool_copies_a_miss_and_evicts_the_least_recently_used():
    pool = SlabPool(2)
    assert [pool.use(1, e) for e in (0, 1, 0, 2, 1, 0)] == [True, True, False, True, True, True]
    with pytest.raises(ValueError, match="0 slabs"):
        SlabPool(0)


def test_replay_counts_each_phase_skips_the_pinned_prefix_and_the_warming_request():
    layers, experts = 3, 4  # budget 0.5: 6 experts' room, a pinned layer takes 4, 2 slabs remain
    first = [step({0: [0, 1, 2], 1: [0], 2: [1]}, layers, experts, "prefill"),
             step({0: [3], 1: [0], 2: [1]}, layers, experts, "decode")]
    second = [step({0: [0, 1, 2, 3], 1: [0, 1], 2: [1]}, layers, experts, "prefill"),
              step({1: [0], 2: [2]}, layers, experts, "decode")]
    result = replay([first, second], budget=0.5, depth=1)
    assert result["slabs"] == 2
    # the second request: prefill (1,0) hit, (1,1) copied (evicts (2,1)), (2,1) copied (evicts (1,0));
    # decode (1,0) copied, (2,2) copied; layer 0 is pinned, never copied
    assert result["prefill_per_request"] == [2] and result["decode_per_request"] == [2]
    unpinned = replay([first, second], budget=1.0, depth=0)  # 12 slabs: nothing evicted
    # the second prefill: only (1,1) is new ((0,3) came in with the first request's decode); its decode: (2,2)
    assert unpinned["prefill_per_request"] == [1] and unpinned["decode_per_request"] == [1]


def test_study_pairs_each_pruned_folder_with_the_unpruned_traces_at_its_depth(tmp_path, capsys):
    layers, experts = 4, 16
    for name, used in (("none", [0, 1, 2, 3]), ("affinity-0.5-1", [0, 1, 2]), ("random-0.5-1", [0, 1]),
                       ("random-0.5-2", [0]), ("train-none", [7])):
        (tmp_path / name).mkdir()
        for r in range(3):
            ids = [e + 4 * r for e in used]  # each request its own experts: the pool copies every one
            steps = [({layer: ids for layer in range(layers)}, "prefill"), ({2: [15 - r]}, "decode")]
            write_request(tmp_path / name / f"request-{r:06d}.safetensors", steps, layers, experts)
    assert trace_replay.main(["--traces", str(tmp_path), "--budgets", "0.75", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "trace_replay.json").read_text())["rows"]
    got = {(r["depth"], r["compression"]): r for r in rows}
    assert set(got) == {(1, "none"), (1, "affinity"), (1, "random"), (2, "none"), (2, "random")}  # train-* left out
    # every expert a request uses is new to the pool: its count on each layer after the prefix
    assert [got[(1, c)]["prefill_mean"] for c in ("none", "affinity", "random")] == [12, 9, 6]
    assert got[(2, "random")]["prefill_mean"] == 2 and got[(1, "none")]["decode_mean"] == 1
    # 0.75 x 64 experts' room, less the pinned prefix
    assert got[(1, "none")]["slabs"] == 48 - 16 and got[(2, "none")]["slabs"] == 48 - 2 * 16
    assert "experts copied per prefill" in capsys.readouterr().out


def test_bad_traces_folders_say_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="no `none` folder"):
        trace_replay.study(tmp_path, [0.5], 1)
    (tmp_path / "none").mkdir()
    with pytest.raises(SystemExit, match="METHOD-KEEP-DEPTH"):
        trace_replay.study(tmp_path, [0.5], 1)


def test_a_budget_the_pinned_prefix_fills_is_left_out_with_a_note(tmp_path, capsys):
    layers, experts = 4, 16
    for name in ("none", "affinity-0.5-1", "affinity-0.5-3"):
        (tmp_path / name).mkdir()
        for r in range(2):
            write_request(tmp_path / name / f"request-{r:06d}.safetensors", [({1: [r]}, "prefill")], layers, experts)
    # 0.5 x 64 = 32 experts' room: depth 1 leaves 16 slabs, depth 3 would leave -16
    rows = trace_replay.study(tmp_path, [0.5], 1)
    assert {r["depth"] for r in rows} == {1}
    assert "budget 0.5 at depth 3" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give larger --budgets"):
        trace_replay.study(tmp_path, [0.2], 1)

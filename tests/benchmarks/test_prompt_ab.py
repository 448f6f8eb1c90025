"""benchmarks/prompt_ab.py: configurations' prompts and decodes in turn in one process (ABBA rounds), the ratios paired
by round, every model routed alike, and clear errors for a comparison that is none."""
import json

import pytest

from benchmarks import prompt_ab


def run(config, round_, prefill, decode=None, prompt="p"):
    return {"prompt": prompt, "round": round_, "config": config, "prefill_s": prefill, "decode_tok_s": decode}


def test_ratios_pair_each_round_with_the_baselines_same_round():
    # the host slows down in round 1: paired, b is 0.9x a's prompt every round, although b's median is a's
    runs = [run("a", 0, 1.0, 10.0), run("b", 0, 0.9, 11.0), run("b", 1, 1.8, 22.0), run("a", 1, 2.0, 20.0),
            run("a", 2, 1.0, 10.0), run("b", 2, 0.9, 11.0)]
    ratios = prompt_ab.paired_ratios(runs, "a")
    assert list(ratios) == ["b"] and ratios["b"]["rounds"] == 3
    assert ratios["b"]["prefill_ratio"] == pytest.approx(0.9) and ratios["b"]["decode_ratio"] == pytest.approx(1.1)
    summary = prompt_ab.summarize(runs)
    assert summary["a"] == {"prefill_median_s": 1.0, "prefill_min_s": 1.0, "prefill_max_s": 2.0,
                            "decode_median_tok_s": 10.0, "n": 3}
    assert summary["b"]["prefill_median_s"] == pytest.approx(0.9)


def test_without_decodes_there_is_no_decode_ratio():
    ratios = prompt_ab.paired_ratios([run("a", 0, 1.0), run("b", 0, 1.5)], "a")
    assert ratios["b"]["decode_ratio"] is None and ratios["b"]["prefill_ratio"] == 1.5
    assert prompt_ab.summarize([run("a", 0, 1.0)])["a"]["decode_median_tok_s"] is None


def test_two_tiny_configurations_in_turn_on_the_cpu_route_alike(tmp_path, capsys, monkeypatch):
    from benchmarks.bench import prompt_setup

    models = []
    load = prompt_setup.load_prompt_model

    def keep(*args, **kwargs):
        loaded = load(*args, **kwargs)
        models.append(loaded[0])
        return loaded

    monkeypatch.setattr(prompt_ab, "load_prompt_model", keep)
    out = tmp_path / "ab.json"
    assert prompt_ab.main(["--configs", "lru:expert_budget=13MiB", "vismmoe:expert_budget=13MiB", "--out", str(out),
                           "--tiny", "tiny-2x8", "--device", "cpu", "--image-size", "96", "--rounds", "2",
                           "--decode-tokens", "3"]) == 0
    result = json.loads(out.read_text())
    assert [r["config"] for r in result["runs"]] == ["lru:expert_budget=13MiB", "vismmoe:expert_budget=13MiB",
                                                     "vismmoe:expert_budget=13MiB", "lru:expert_budget=13MiB"]
    assert [r["round"] for r in result["runs"]] == [0, 0, 1, 1]
    assert all(r["prefill_s"] > 0 and r["decode_tok_s"] > 0 for r in result["runs"])
    rows = result["prompts"]["96 px"]
    assert rows["summary"]["vismmoe:expert_budget=13MiB"]["n"] == 2 and result["routing"] == "synthetic"
    assert rows["against_baseline"]["vismmoe:expert_budget=13MiB"]["rounds"] == 2
    assert "lru:expert_budget=13MiB" not in rows["against_baseline"]
    # each model ran the same requests, so the synthetic routing, seeded per request, is at the same request in both
    assert len(models) == 2
    assert models[0].vismmoe.context.routing.requests == models[1].vismmoe.context.routing.requests > 4
    assert "x the baseline's" in capsys.readouterr().out


@pytest.mark.parametrize("argv,why", [
    (["--configs", "lru"], "at least two configurations"),
    (["--configs", "lru", "lru"], "named twice"),
    (["--configs", "lru", "offload", "--rounds", "0"], "at least one round"),
    (["--configs", "lru", "offload", "--decode-tokens", "-1"], "0 or more"),
    (["--configs", "lru", "offload", "--image-size", "0"], "no prompt to time"),
])
def test_bad_arguments_end_with_the_reason_not_a_traceback(argv, why, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prompt_ab.main([*argv, "--out", str(tmp_path / "x.json"), "--device", "cpu"])
    assert exit_info.value.code == 2 and why in capsys.readouterr().err

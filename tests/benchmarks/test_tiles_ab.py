"""benchmarks/tiles_ab.py: alternatives of tuning.json timed in turn in one process (ABBA rounds), its --alt
parsing with clear errors, and a tiny model's sanity run on the CPU."""
import json

import pytest

from benchmarks import tiles_ab


def test_alternatives_parse_to_a_key_and_a_json_value_and_wrong_ones_say_why():
    assert tiles_ab.parse_alternative('a=quantized_prefill:{"block_m": 16}') == ("a", "quantized_prefill", {"block_m": 16})
    for text, why in (("a", "NAME=KEY:JSON"), ("a=quantized_prefill", "NAME=KEY:JSON"),
                      ("a=no_such_key:{}", "'no_such_key' is not a tuning key"),
                      ("a=quantized_prefill:{block_m: 16}", "not JSON")):
        with pytest.raises(ValueError, match=why):
            tiles_ab.parse_alternative(text)


def test_the_default_alternatives_add_the_other_orders_once_each():
    h100 = tiles_ab.WEIGHTS_FIRST
    alternatives = tiles_ab.default_alternatives(h100)   # a device already weights first: three, not four
    assert list(alternatives) == ["committed", "tokens first", "weights ahead"]
    ahead = alternatives["weights ahead"][1]
    assert ahead["gate_up"][4] == ahead["down"][4] == ahead["long"]["down"][4] == "weights-ahead"
    assert h100["gate_up"][4] == "weights"  # the committed entry is not changed in place
    tokens = tiles_ab.default_alternatives(tiles_ab.TOKENS_FIRST)  # a tokens-first device: the H100's tiles to try
    assert list(tokens) == ["committed", "weights first", "weights ahead"]
    assert tokens["weights first"][1] == h100


def test_rounds_alternate_their_order_and_the_summary_keeps_each_request_apart():
    assert tiles_ab.rounds_order(["a", "b"], 4) == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert tiles_ab.rounds_order(["a", "b", "c"], 1) == ["a", "b", "c"]
    summary = tiles_ab.summarize([("a", "448 px", 3.0), ("b", "448 px", 1.0), ("a", "448 px", 1.0),
                                  ("a", "text", 5.0), ("b", "448 px", 2.0)])
    assert summary["448 px"]["a"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert summary["448 px"]["b"]["median"] == 1.5 and summary["text"]["a"]["n"] == 1 and "b" not in summary["text"]


def test_a_tiny_models_prompt_under_two_alternatives_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert tiles_ab.main(["--config", "offload:expert_budget=1GiB", "--out", str(out), "--tiny", "tiny-2x8",
                          "--device", "cpu", "--image-size", "96", "--rounds", "2", "--routing", "model",
                          "--alt", "now=prefetch_programs:32", "--alt", "few=prefetch_programs:4"]) == 0
    result = json.loads(out.read_text())
    assert [name for name, _, _ in result["runs"]] == ["now", "few", "few", "now"]
    rows = result["prefill_s"]["96 px"]
    assert set(rows) == {"now", "few"} and all(row["n"] == 2 and row["min"] > 0 for row in rows.values())
    assert result["alternatives"]["few"] == ["prefetch_programs", 4] and result["routing"] == "model"
    assert "96 px (routing model): now" in capsys.readouterr().out


def test_launches_time_the_two_launch_paths_in_turn(tmp_path):
    out = tmp_path / "launches.json"
    assert tiles_ab.main(["--config", "offload:expert_budget=1GiB", "--out", str(out), "--tiny", "tiny-2x8",
                          "--device", "cpu", "--image-size", "96", "--rounds", "2", "--routing", "model",
                          "--launches"]) == 0
    result = json.loads(out.read_text())
    assert [name for name, _, _ in result["runs"]] == ["direct launches", "through Triton", "through Triton",
                                                       "direct launches"]
    assert result["alternatives"]["through Triton"].endswith("every launch through Triton")


def test_launches_alternate_with_every_launcher_through_triton_inside_its_turns(monkeypatch):
    import kernel_launch

    class Kernel:
        fn = staticmethod(lambda x: None)

    launcher = kernel_launch.Launcher(Kernel(), direct=True)
    monkeypatch.setitem(kernel_launch._LAUNCHERS, "kernel", launcher)
    direct = launcher.direct
    with tiles_ab.launches_through_triton():
        assert launcher.direct is False
    assert launcher.direct is direct  # restored after the turn


def test_bad_arguments_end_with_the_reason_not_a_traceback(tmp_path, capsys):
    for argv, why in ((["--alt", "x"], "NAME=KEY:JSON"), (["--rounds", "0"], "at least one round"),
                      (["--image-size", "0"], "no prompt to time"),
                      (["--launches", "--alt", "a=prefetch_programs:4"], "give no --alt beside it")):
        with pytest.raises(SystemExit) as exit_info:
            tiles_ab.main(["--config", "offload", "--out", str(tmp_path / "x.json"), "--device", "cpu", *argv])
        assert exit_info.value.code == 2 and why in capsys.readouterr().err

"""benchmarks/prompt_compare.py: prompt_timeline results side by side, on hand-made files."""

import json

import pytest

from benchmarks import prompt_compare


def timeline(path, config, prefills, ends, prompt="448 px"):
    marks = []
    for layer, (host, gpu) in ends.items():
        marks.append({"stage": f"layer {layer}", "edge": "start", "host_ms": host - 1, "gpu_ms": None if gpu is None else gpu - 1})
        marks.append({"stage": f"layer {layer}", "edge": "end", "host_ms": host, "gpu_ms": gpu})
    path.mkdir()
    (path / "prompt_timeline.json").write_text(json.dumps(
        {"config": config, "prompts": {prompt: {"runs": [{"prefill_ms": p} for p in prefills], "last_marks": marks}}}))
    return str(path)


def test_two_configurations_layer_by_layer(tmp_path, capsys):
    a = timeline(tmp_path / "a", "vismmoe:expert_budget=6GiB", [210.0, 230.0, 220.0], {0: (7.2, 7.6), 1: (12.8, 13.1)})
    b = timeline(tmp_path / "b", "lru:expert_budget=6GiB", [200.0], {0: (7.2, 11.5), 1: (10.1, None)})
    names, rows = prompt_compare.compare([a, b], layers=(0, 1, 2))
    assert names == ["vismmoe:expert_budget=6GiB", "lru:expert_budget=6GiB"]
    assert rows[0] == ["prefill (median)", "220.0", "200.0"]
    assert rows[1] == ["layer 0 ends, host / GPU", "7.2 / 7.6", "7.2 / 11.5"]
    assert rows[2] == ["layer 1 ends, host / GPU", "12.8 / 13.1", "10.1 / -"]  # no GPU time (a CPU run)
    assert rows[3] == ["layer 2 ends, host / GPU", "-", "-"]  # no such layer
    assert prompt_compare.main([a, b, "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "| layer 1 ends, host / GPU | 12.8 / 13.1 | 10.1 / - |" in out and "layer 0" not in out


def test_a_missing_file_or_prompt_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no prompt_timeline.json"):
        prompt_compare.layer_ends(tmp_path)
    a = timeline(tmp_path / "a", "lru:expert_budget=6GiB", [200.0], {0: (1.0, 2.0)})
    with pytest.raises(SystemExit, match="no prompt 'text 508' \\(it has 448 px\\)"):
        prompt_compare.layer_ends(a, "text 508")


def test_the_links_rows_where_a_configuration_copied(tmp_path):
    a = timeline(tmp_path / "a", "vismmoe:expert_budget=6GiB", [210.0, 230.0], {0: (7.2, 7.6)})
    b = timeline(tmp_path / "b", "lru:expert_budget=6GiB", [200.0], {0: (7.2, 11.5)})
    file = tmp_path / "a" / "prompt_timeline.json"
    result = json.loads(file.read_text())
    links = [{"batches": 40, "first_copy_ms": 4.0, "last_copy_end_ms": 200.0, "busy_ms": 190.0, "idle_host_ms": 1.0,
              "idle_waiting_ms": w} for w in (5.0, 9.0)]
    for run, link in zip(result["prompts"]["448 px"]["runs"], links):
        run["link"] = link
    file.write_text(json.dumps(result))
    _, rows = prompt_compare.compare([a, b], layers=(0,))
    by_label = {row[0]: row[1:] for row in rows}
    assert by_label["link: idle, next copy waiting on compute"] == ["7.0", "-"]  # the runs' median; b copied nothing
    assert by_label["link: busy"] == ["190.0", "-"]
    # neither copied: no link rows at all
    _, rows = prompt_compare.compare([b], layers=(0,))
    assert not any(row[0].startswith("link") for row in rows)

"""benchmarks/streamed_prefill.py on the CPU proxy: the streams' victims chosen by the cycle copy a fixed share of
the layers per prompt, by the cache's own ranking (recency for lru) every layer, and the report carries both with
their routing."""
import json

from benchmarks import streamed_prefill


def test_streams_evicting_the_layer_that_runs_again_last_copy_a_part_of_the_layers(tmp_path):
    assert streamed_prefill.main(["--rules", "optimize_rules/qwen3vl-lru.yaml", "--prompts", "3",
                                  "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "streamed_prefill.json").read_text())
    rows = {row["victims"]: row for row in report["rows"]}
    assert report["routing"].startswith("synthetic") and set(rows) == {"cycle", "cache"}
    for row in rows.values():
        assert row["prefill"] == "streamed" and row["copies_per_prompt"][0] >= 6000  # the first fills empty slabs
    # by recency every offloaded expert again (48 x 128); by the cycle about N - C + 1 layers (C = 2427 / 128)
    assert rows["cache"]["copies_after_the_first"] > 6000
    assert 26 * 128 < rows["cycle"]["copies_after_the_first"] < 31 * 128
    assert rows["cycle"]["link_floor_s"] < rows["cache"]["link_floor_s"]

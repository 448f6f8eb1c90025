"""benchmarks/boundary_upkeep.py on a few decode steps: each reservation order runs as its plan says, the
tokens agree, and the JSON holds a row per (rules, order). Its timings are not asserted (a benchmark's)."""

import json

from benchmarks import boundary_upkeep


def test_both_reservation_orders_run_and_agree(tmp_path, capsys):
    assert boundary_upkeep.main(["--rules", "optimize_rules/qwen3vl-lru.yaml", "--slabs", "2427",
                                 "--decode_tokens", "8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "boundary_upkeep.json").read_text())["rows"]
    assert [row["plan"] for row in rows] == ["before-step", "ahead"]
    assert rows[0]["tokens"] == rows[1]["tokens"] and len(rows[0]["tokens"]) == 9  # the prompt's token, then 8
    assert all(0 < row["decode_hit_rate"] < 1 and row["steps"] >= 7 for row in rows)  # the budget misses and hits
    assert "qwen3vl-lru: tokens agree" in capsys.readouterr().out

"""The pinned-depth report: per-depth predictions and the choice, and the curve the runtime ships."""

import json

import pytest
import torch

from benchmarks.pinned_depth import lru_curve, main, synthetic_requests
from vismmoe_kt.routing import save_trace, synthetic_trace
from vismmoe_kt.runtime.prefix_depth import shipped_curve


def test_report_prints_every_candidate_and_the_choice(tmp_path, capsys):
    assert main(["--budget", "16GiB", "32GiB", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| pinned | slabs | slabs / offloaded layer | predicted hit rate |" in out
    assert "| 1 | 1692 | 36.0 |" in out and "chosen: 1 -- auto: 1 pinned layer(s)" in out
    assert "H200 default" in out  # no measurement given: the defaults say so
    data = json.loads((tmp_path / "pinned_depth.json").read_text())
    tight, roomy = data["budgets"]
    assert tight["valid_range"] == [1, 13] and [r["depth"] for r in tight["candidates"]] == list(range(1, 14))
    assert tight["depth"] == 1 and roomy["valid_range"] == [1, 27] and 1 < roomy["depth"] < 27
    assert data["inputs"]["zero_copy_bytes_per_s"] == [45.7e9, "H200 default (BENCHMARKS.md: decode_kernel_bench, table host)"]


def test_measured_figures_replace_the_defaults(tmp_path, capsys):
    kernels = tmp_path / "decode_kernel_bench.json"
    kernels.write_text(json.dumps({"rows": [{"kernel": "table host", "gb_s": 20.0}, {"kernel": "copy engine", "gb_s": 25.0}]}))
    plain = tmp_path / "figures.json"
    plain.write_text(json.dumps({"layer_ms": 0.5}))
    assert main(["--budget", "16GiB", "--measured", str(kernels), str(plain), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pinned_depth.json").read_text())
    assert data["inputs"]["zero_copy_bytes_per_s"][0] == 20e9 and "measured" in data["inputs"]["zero_copy_bytes_per_s"][1]
    assert data["inputs"]["layer_seconds"] == [0.5e-3, f"measured ({plain}: layer_ms)"]
    assert data["inputs"]["offload_overhead_seconds"][1].startswith("H200 default")
    assert main(["--budget", "16GiB", "--zero-copy-gbps", "30", "--out", str(tmp_path)]) == 0  # a flag wins too
    assert json.loads((tmp_path / "pinned_depth.json").read_text())["inputs"]["zero_copy_bytes_per_s"] == [30e9, "given (--zero-copy-gbps)"]


def test_an_impossible_budget_is_reported_with_the_runtime_message(tmp_path, capsys):
    assert main(["--budget", "2GiB", "--out", str(tmp_path)]) == 1
    assert "is too small: it must hold 1 pinned layer(s)" in capsys.readouterr().out


def test_the_shipped_curve_is_the_synthetic_lru_simulation():
    """Spot-check three capacities of runtime/decode_hit_rates_qwen3_vl_30b_a3b.json against a fresh replay."""
    shipped = shipped_curve()
    capacities = [8, 36, 128]
    fresh = lru_curve(synthetic_requests(48, 128, 8, 3, 128), 128, shipped.expert_bytes, "", capacities)
    for j, capacity in enumerate(capacities):
        column = shipped.capacities.index(capacity)
        assert [row[column] for row in shipped.rates] == pytest.approx([row[j] for row in fresh.rates], abs=1e-5)


def test_a_recorded_trace_gives_the_hit_rates(tmp_path, capsys):
    # two requests of 4 layers x 16 experts, top-2: 20 prefill tokens each warm the cache, 30 decode tokens count
    ids = torch.cat([synthetic_trace(50, layers=4, experts=16, top_k=2, seed=s) for s in (0, 1)])
    phase = torch.tensor(([0] * 20 + [1] * 30) * 2)
    path = save_trace(tmp_path / "trace.npz", ids, phase=phase, request_ids=torch.tensor([0] * 50 + [1] * 50))
    assert main(["--budget", "3000", "--layers", "4", "--experts", "16", "--top-k", "2", "--expert-bytes", "50",
                 "--trace", str(path), "--write-curve", str(tmp_path / "curve.json"), "--out", str(tmp_path)]) == 0
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert curve["layers"] == 4 and curve["capacities"][0] == 2 and curve["capacities"][-1] == 16
    assert all(row[-1] <= 1.0 for row in curve["rates"]) and "trace" in curve["source"]
    budget = json.loads((tmp_path / "pinned_depth.json").read_text())["budgets"][0]
    assert budget["valid_range"] == [1, 2] and budget["depth"] in (1, 2)

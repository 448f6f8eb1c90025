"""The affinity studies: the working-set metrics on constructed traces, the what-if's fit and sweep on
synthetic routing, and the trained-model study on the demo model at a small scale."""

import json
import math

import pytest
import torch

from benchmarks import affinity_whatif
from benchmarks.affinity_metrics import concentration, cover, distinct, layer_figures, stability
from benchmarks.affinity_study import study, table, demo_requests

SHAPE = {"layers": 4, "experts": 64, "top_k": 8, "visual": 96, "text": 24}


def test_identical_consecutive_layers_are_perfectly_stable():
    ids = torch.randint(0, 16, (10, 4), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10)
    assert stability((ids, positions), (ids, positions), 16) == 1.0
    other = (ids + 1) % 16  # a token's set shifted by one expert: overlap below 1
    assert 0 <= stability((ids, positions), (other, positions), 16) < 1
    kept = torch.tensor([1, 4, 7])  # a pruned layer: only the positions both saw count
    assert stability((ids, positions), (ids[kept], kept), 16) == 1.0
    text = torch.zeros(10, dtype=torch.bool)
    assert math.isnan(stability((ids, positions), (ids, positions), 16, text))


def test_concentration_distinct_and_cover_on_a_trace():
    ids, mask = affinity_whatif.route_prompt(0, 0.4, **SHAPE)
    full = affinity_whatif.prune(ids, mask, "none", 1.0, 1, 64)
    pruned = affinity_whatif.prune(ids, mask, "random", 0.3, 1, 64)
    for (a, _), (b, _) in zip(full[1:], pruned[1:]):
        assert distinct(a, 64) >= distinct(b, 64)  # keep 1.0 uses at least the experts keep 0.3 does
        assert 0 <= concentration(b, 64, 8) <= 1 and 1 <= cover(b, 64) <= distinct(b, 64)
    assert torch.equal(full[0][0], pruned[0][0])  # the prefix layer sees every token
    assert len(pruned[1][1]) == SHAPE["text"] + int(0.3 * SHAPE["visual"])
    rows = layer_figures(pruned, mask, 64, 8)
    assert len(rows) == 4 and "stability_visual" in rows[0] and "stability_visual" not in rows[-1]


def test_the_fit_recovers_a_known_strength():
    curve = affinity_whatif.gain_curve([0.0, 0.1, 0.2, 0.3, 0.4], 0.5, 1, SHAPE, requests=3)
    gains = [g for _, g in curve]
    assert all(a < b for a, b in zip(gains, gains[1:])), curve  # the gain grows with the strength up to 0.4
    known = 0.25  # "traces" generated with it, from seeds the curve did not use
    measured = affinity_whatif.gain(known, 0.5, 1, SHAPE, requests=3, first=100)
    fitted = affinity_whatif.fit_strength(measured, curve)
    assert fitted is not None and abs(fitted - known) <= 0.08, (fitted, curve)
    assert affinity_whatif.fit_strength(10.0, curve) is None  # never reached: said, not extrapolated


def test_the_sweep_labels_every_figure(tmp_path, capsys):
    assert affinity_whatif.main(["--strengths", "0,0.4", "--layers", "3", "--experts", "32", "--top-k", "4",
                                 "--visual", "48", "--text", "8", "--requests", "1", "--keeps", "0.5",
                                 "--ranks", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "synthetic:affinity=0.4" in out and "| synthetic |" in out and "fitted to the paper gain +32.0%" in out
    data = json.loads((tmp_path / "affinity_whatif.json").read_text())
    assert {r["routing"] for r in data["rows"]} == {"synthetic", "synthetic:affinity=0.4"}
    assert all(e["imbalance"] >= 1 for e in data["ep"])
    with pytest.raises(SystemExit):
        affinity_whatif.main(["--strengths", "0,1.5"])
    assert "affinity strength must be a number in [0, 1]" in capsys.readouterr().err


def test_the_study_on_the_demo_model(tmp_path):
    from vismmoe_kt import load
    from vismmoe_kt.demo.tiny import demo_model_dir

    model, processor = load(demo_model_dir(), "optimize_rules/qwen3vl.yaml", generate_device="cpu",
                            prefill_device="cpu", progress=False)
    result = study(model, processor, demo_requests(2), demo_requests(1, "train"), methods=("affinity", "random"),
                   keeps=(0.3,), depths=(1, 9), decode_tokens=1, epochs=1, work=tmp_path)
    assert result["depths_left_out"] == [9] and [r["compression"] for r in result["rows"]] == ["none", "affinity", "random"]
    none, affinity, random = result["rows"]
    for layer in range(1, result["layers"]):
        assert none["per_layer"][layer]["distinct"] >= random["per_layer"][layer]["distinct"]
    for row in result["rows"]:
        assert 0 <= row["later"]["concentration"] <= 1 and 0 <= row[f"hot_recall@{result['budget']}"] <= 1
    assert "distinct_minus_random" in affinity and result["fit"] is None  # no keep 0.5 case
    header, rows = table(result)
    assert header[-1] == "affinity - random distinct" and rows[1][-1].endswith(("(yes)", "(no)"))

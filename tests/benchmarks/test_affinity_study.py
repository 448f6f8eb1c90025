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


def test_the_study_on_a_trained_routing_model_with_scenes_prompts(tmp_path):
    """The command line on a routing-study model (routing-tiny, one training step): held-out scenes prompts at the
    spec's picture side, every row in the JSON, and pruning lowering the visual tokens that reach the later layers."""
    import importlib.util
    from pathlib import Path

    from benchmarks import affinity_study

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_routing_model.py"
    spec = importlib.util.spec_from_file_location("train_routing_model", script)
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    model_dir, out = tmp_path / "routing", tmp_path / "study"
    trainer.main(["--spec", "routing-tiny", "--out", str(model_dir), "--steps", "1", "--batch", "1", "--workers", "0",
                  "--threads", "1", "--eval_per_type", "0", "--no_progress"])
    assert affinity_study.scenes_size(str(model_dir)) == 128
    image, prompt = affinity_study.scenes_requests(1, size=128)[0]
    assert image.size == (128, 128) and prompt.endswith("?")
    assert affinity_study.main(["--task", "scenes", "--model", str(model_dir), "--out", str(out), "--prompts", "2",
                                "--train-prompts", "1", "--methods", "affinity,random", "--keeps", "0.5",
                                "--depths", "1", "--decode-tokens", "1", "--epochs", "1"]) == 0
    result = json.loads((out / "affinity_study.json").read_text())
    assert result["task"] == "scenes" and result["prompts"] == 2 and result["layers"] == 2 and result["experts"] == 8
    assert [(r["compression"], r["keep"], r["depth"]) for r in result["rows"]] == [
        ("none", 1.0, 1), ("affinity", 0.5, 1), ("random", 0.5, 1)]
    none, affinity, random = result["rows"]
    visual = none["per_layer"][1]["visual_tokens"]  # 128 px: 8 x 8 patches of 16, merged 2 x 2: 16 visual tokens
    assert visual == 16 and none["per_layer"][0]["visual_tokens"] == visual
    for row in (affinity, random):  # the prefix layer sees every token, the later one the kept half
        assert row["per_layer"][0]["visual_tokens"] == visual and row["per_layer"][1]["visual_tokens"] == visual // 2
        assert row["per_layer"][1]["tokens"] == none["per_layer"][1]["tokens"] - visual // 2
    assert result["fit"]["keep"] == 0.5 and math.isfinite(result["fit"]["gain"])
    assert not (out / "traces").exists()  # removed without --keep-traces
    assert "| affinity | 0.5 | 1 |" in (out / "affinity_study.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--task", "scenes"], "--task scenes needs --model DIR"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--keeps", "1.5"], "--keeps must lie in (0, 1)"),
])
def test_bad_study_arguments_are_clear_errors(tmp_path, capsys, flags, message):
    from benchmarks import affinity_study

    with pytest.raises(SystemExit) as stop:
        affinity_study.parse_args(["--out", str(tmp_path)] + flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err

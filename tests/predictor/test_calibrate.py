"""`vismmoe-kt calibrate` end to end on the demo model, and the trace format."""

import json

import pytest
import torch

from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.tiny import DEMO_SPEC, SPECS
from vismmoe_kt.predictor.traces import read_trace


def test_calibrate_on_the_demo_model(tmp_path, capsys):
    rc = main(["calibrate", "--demo", "--synthetic", "6", "--decode_tokens", "3", "--epochs", "4", "--out", str(tmp_path),
               "--window", "3", "--generate_device", "cpu", "--prefill_device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Hot Recall" in out and "predictor" in out and "random" in out
    traces = sorted((tmp_path / "traces").glob("request-*.safetensors"))
    assert len(traces) == 6 and (tmp_path / "predictor.pt").exists()
    steps = read_trace(traces[0])
    assert [s["phase"] for s in steps] == ["prefill", "decode", "decode"]
    active = steps[0]["active"]
    spec = SPECS[DEMO_SPEC]
    assert active.shape == (spec.layers, spec.experts) and active.dtype == torch.bool
    assert (active.sum(dim=1) >= spec.top_k).all()  # every layer used at least top-k experts in prefill
    assert (steps[1]["active"].sum(dim=1) == spec.top_k).all()  # one decoded token: exactly its top-k experts
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert set(report["predictor"]["all"]) == {"@10", "@20", "@30"}
    assert 0 <= report["random"]["decode"]["@20"] <= 1

    views = tmp_path / "views"
    assert main(["trace", "plot", "--traces", str(tmp_path / "traces"), "--out", str(views),
                 "--predictor", str(tmp_path / "predictor.pt")]) == 0
    for name in ("expert_heatmap.png", "layer_similarity.png", "hot_recall.png"):
        assert (views / name).read_bytes().startswith(b"\x89PNG")
    summary = json.loads((views / "trace_views.json").read_text())
    similarity = summary["layer_similarity"]["decode"]
    assert len(similarity) == spec.layers - 1 and all(0 <= v <= 1 for v in similarity)


def test_calibrate_input_errors(tmp_path, capsys):
    assert main(["calibrate", "--demo", "--out", str(tmp_path)]) == 2
    assert "calibrate needs --images" in capsys.readouterr().err
    assert main(["calibrate", "--demo", "--out", str(tmp_path), "--images", str(tmp_path)]) == 2
    assert "no image files found" in capsys.readouterr().err
    assert main(["trace", "plot", "--traces", str(tmp_path), "--out", str(tmp_path / "v")]) == 2
    assert "no request-*.safetensors trace files" in capsys.readouterr().err

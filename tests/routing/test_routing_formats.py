"""Routing trace files: the project format round trip, the vLLM and JSONL importers, clear errors."""

import gzip
import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vismmoe_kt.routing import Trace, TraceFormatError, from_vllm, load_trace, save_trace, synthetic_routing

T, L, K, E = 40, 3, 4, 32


@pytest.fixture(scope="module")
def routing():
    ids, weights = synthetic_routing(T, layers=L, experts=E, top_k=K, seed=3)
    return ids, weights


def optional_fields(full):
    if not full:
        return {}
    g = torch.Generator().manual_seed(0)
    return {"modality": torch.randint(0, 2, (T,), generator=g, dtype=torch.uint8),
            "phase": torch.cat([torch.zeros(30, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8)]),
            "request_ids": torch.cat([torch.zeros(25, dtype=torch.int32), torch.ones(15, dtype=torch.int32)])}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("full", [False, True])
def test_project_format_round_trips_exactly(tmp_path, routing, suffix, full):
    ids, weights = routing
    fields = optional_fields(full)
    path = save_trace(tmp_path / f"trace{suffix}", ids, weights=weights.half() if full else None, **fields)
    trace = load_trace(path, experts=E)
    assert isinstance(trace, Trace) and (trace.tokens, trace.layers, trace.top_k) == (T, L, K)
    assert torch.equal(trace.ids, ids)
    if full:
        assert trace.weights.dtype == torch.float16 and torch.equal(trace.weights, weights.half())
        for name, value in fields.items():
            assert torch.equal(getattr(trace, name), value), name
    else:
        assert trace.weights is None and trace.modality is None and trace.phase is None
        assert trace.request_ids is None


def test_save_trace_phase_string_and_unusual_name(tmp_path, routing):
    ids, _ = routing
    path = save_trace(tmp_path / "run.v2.npz", ids, phase="decode")
    assert path.exists() and not (tmp_path / "run.v2.npz.npz").exists()
    assert load_trace(path).phase.tolist() == [1] * T


def test_vllm_arrays_import(tmp_path, routing):
    ids, _ = routing
    as_int32 = ids.to(torch.int32)
    np.save(tmp_path / "routed.npy", as_int32.numpy())
    torch.save(as_int32, tmp_path / "routed.pt")
    save_file({"routed_experts": as_int32.contiguous()}, str(tmp_path / "routed.safetensors"))
    np.savez(tmp_path / "routed.npz", routed_experts=ids.numpy().astype(np.int16))
    for name in ("routed.npy", "routed.pt", "routed.safetensors", "routed.npz"):
        trace = load_trace(tmp_path / name, experts=E)
        assert torch.equal(trace.ids, ids), name
        assert trace.weights is None and trace.modality is None
    # the API's two fields: prompt tokens first (phase 0), then generated ones (phase 1)
    torch.save({"prompt_routed_experts": as_int32[:30], "routed_experts": as_int32[30:]}, tmp_path / "resp.pt")
    trace = load_trace(tmp_path / "resp.pt")
    assert torch.equal(trace.ids, ids) and trace.phase.tolist() == [0] * 30 + [1] * 10
    assert torch.equal(from_vllm(ids[30:], ids[:30]).ids, ids)
    # content sniffing when the extension says nothing
    (tmp_path / "routed.npy").rename(tmp_path / "routed.bin")
    assert torch.equal(load_trace(tmp_path / "routed.bin").ids, ids)


def write_jsonl(path, ids, weights, problems, shuffle=True, extra=None):
    records = []
    for problem, (a, b) in enumerate(problems):
        for token in range(a, b):
            for layer in range(ids.shape[1]):
                records.append({"dataset": "gsm8k", "problem_id": problem, "layer": layer,
                                "token_idx": token - a, "experts": ids[token, layer].tolist(),
                                "gating_probs": [round(float(w), 4) for w in weights[token, layer]],
                                **(extra or {})})
    if shuffle:  # dumps need not be ordered: the importer places records by (request, token, layer)
        order = list(range(len(records)))
        random.Random(0).shuffle(order)
        grouped = sorted(order, key=lambda i: records[i]["problem_id"])  # keep requests in first-seen order
        records = [records[i] for i in grouped]
    text = "\n".join(json.dumps(r) for r in records) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["routing.jsonl", "routing.jsonl.gz"])
def test_jsonl_import_round_trips(tmp_path, routing, name):
    ids, weights = routing
    path = write_jsonl(tmp_path / name, ids, weights, [(0, 25), (25, 40)])
    trace = load_trace(path, experts=E)
    assert torch.equal(trace.ids, ids)
    assert trace.request_ids.tolist() == [0] * 25 + [1] * 15
    assert torch.allclose(trace.weights.float(), weights, atol=1e-3)
    assert trace.phase is None  # the public dumps do not say


def test_jsonl_format_override_and_phase(tmp_path, routing):
    ids, weights = routing
    path = write_jsonl(tmp_path / "dump.txt", ids, weights, [(0, T)], extra={"phase": "decode"})
    trace = load_trace(path, format="jsonl")
    assert torch.equal(trace.ids, ids) and trace.request_ids is None and trace.phase.tolist() == [1] * T
    with pytest.raises(ValueError, match="format must be one of"):
        load_trace(path, format="csv")


def jsonl_lines(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def record(token, layer, experts=(1, 2), probs=(0.6, 0.4)):
    out = {"layer": layer, "token_idx": token, "experts": list(experts)}
    if probs is not None:
        out["gating_probs"] = list(probs)
    return out


def test_bad_files_raise_clear_errors(tmp_path):
    def raises(path, match, **kwargs):
        with pytest.raises(TraceFormatError, match=match) as info:
            load_trace(path, **kwargs)
        assert path.name in str(info.value) and isinstance(info.value, ValueError)

    np.save(tmp_path / "flat.npy", np.zeros((5, 8), dtype=np.int32))
    raises(tmp_path / "flat.npy", "3 dimensions")
    np.save(tmp_path / "range.npy", np.full((2, 2, 1), 130, dtype=np.int32))
    raises(tmp_path / "range.npy", r"expert id 130 .* out of range \[0, 128\)", experts=128)
    np.save(tmp_path / "negative.npy", np.full((2, 2, 1), -1, dtype=np.int32))
    raises(tmp_path / "negative.npy", "out of range")
    np.save(tmp_path / "dup.npy", np.array([[[3, 3]]], dtype=np.int32))
    raises(tmp_path / "dup.npy", "repeats an expert")
    np.save(tmp_path / "float.npy", np.full((2, 2, 1), 0.5))
    raises(tmp_path / "float.npy", "must be integers")

    ragged = [record(0, 0), record(0, 1, experts=(1, 2, 3), probs=(0.5, 0.3, 0.2))]
    raises(jsonl_lines(tmp_path / "ragged.jsonl", ragged), "ragged records: line 2")
    probs = [record(0, 0), record(0, 1, probs=(0.5,))]
    raises(jsonl_lines(tmp_path / "probs.jsonl", probs), "ragged records")
    lacking = [record(0, 0), record(0, 1), record(1, 0)]
    raises(jsonl_lines(tmp_path / "lacking.jsonl", lacking),
           r"missing layers: request 0, token_idx 1 lacks layers \[1\]")
    gap = [record(0, 0), record(0, 2)]
    raises(jsonl_lines(tmp_path / "gap.jsonl", gap), r"missing layers: \[1\] never appear")
    twice = [record(0, 0), record(0, 0)]
    raises(jsonl_lines(tmp_path / "twice.jsonl", twice), "several records")
    (tmp_path / "broken.jsonl").write_text(json.dumps(record(0, 0)) + "\n{not json\n")
    raises(tmp_path / "broken.jsonl", "line 2 is not JSON")
    raises(jsonl_lines(tmp_path / "nokey.jsonl", [{"layer": 0, "experts": [1]}]), r"line 1 lacks \['token_idx'\]")

    torch.save({"ids": torch.zeros(3, 2, 2, dtype=torch.int64), "weights": torch.zeros(3, 2, 2)},
               tmp_path / "two.pt")
    raises(tmp_path / "two.pt", "expected one")
    (tmp_path / "noise.bin").write_bytes(b"\x00\x01garbage, not a trace")
    raises(tmp_path / "noise.bin", "unrecognised file")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    raises(tmp_path / "bad.safetensors", "cannot read as safetensors")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.npz")


def test_save_trace_validates(tmp_path, routing):
    ids, weights = routing
    with pytest.raises(TraceFormatError, match="weights have shape"):
        save_trace(tmp_path / "t.npz", ids, weights=weights[:, :1])
    with pytest.raises(TraceFormatError, match="modality must have shape"):
        save_trace(tmp_path / "t.npz", ids, modality=torch.zeros(T + 1))
    with pytest.raises(TraceFormatError, match="contiguous"):
        save_trace(tmp_path / "t.npz", ids, request_ids=torch.arange(T) % 2)
    with pytest.raises(TraceFormatError, match=r"\.safetensors or \.npz"):
        save_trace(tmp_path / "t.json", ids)
    with pytest.raises(TraceFormatError, match="out of range"):
        save_trace(tmp_path / "t.npz", ids + 40000)

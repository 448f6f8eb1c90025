"""`python -m benchmarks.bench`: the CPU smoke run's output structure (not its speed), the configurations' rule
edits, and clear errors for bad flags."""

import json
import re

import pytest
import torch

from benchmarks.bench.configs import CONFIGS, COMPRESSION_OPERATORS, EXPERTS_OPERATOR
from benchmarks.bench.__main__ import main

ROW_KEYS = {"config", "budget", "image_size", "status", "reason", "prompt_tokens", "visual_tokens", "prefill_s",
            "decode_tok_s", "peak_gpu_bytes", "hit_rate_prefill", "hit_rate_decode", "bytes_per_decode_token",
            "copy_hidden_fraction", "cpu_expert_share", "copy_bound_prefill_s", "copy_bound_decode_tok_s"}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run, where CUDA configurations are skipped")
def test_demo_run_writes_table_json_png_and_profile(tmp_path, capsys):
    rc = main(["--demo", "--image-sizes", "64", "--decode-tokens", "2", "--warmup", "0", "--repeats", "1",
               "--budgets", "5MiB", "--cpu_infer", "2", "--output", str(tmp_path), "--profile"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {"model", "device", "date", "copy_bandwidth", "image_sizes", "decode_tokens", "repeats", "budgets",
            "command", "notes"} <= set(result["meta"])
    assert result["meta"]["copy_bandwidth"]["bytes_per_s"] > 0
    assert len({frozenset(row) for row in result["rows"]}) == 1  # skipped rows have every key too
    rows = {row["config"]: row for row in result["rows"]}
    assert set(rows) == set(CONFIGS)  # one budget and one image size: one row each
    for name, row in rows.items():
        assert ROW_KEYS <= set(row), name
        assert f"| {name} |" in out, f"no table row for {name}"
        if CONFIGS[name].needs_cuda:
            assert row["status"] == "skipped" and "CUDA" in row["reason"]
            assert f"skipped: {row['reason']}" in out
        elif CONFIGS[name].needs_group:  # expert parallel: only under torchrun (tests/parallel/test_torchrun.py)
            assert row["status"] == "skipped" and "needs a torchrun launch" in row["reason"]
        else:
            assert row["status"] == "ok", (name, row["reason"])
            assert row["prefill_s"]["min"] <= row["prefill_s"]["median"] <= row["prefill_s"]["max"]
            assert row["decode_tok_s"]["median"] > 0 and row["peak_gpu_bytes"] is None
    assert rows["lru"]["hit_rate_decode"] is not None and rows["lru"]["pinned_layers"] == 0
    assert rows["vismmoe+compress"]["visual_tokens_kept"] < rows["vismmoe+compress"]["visual_tokens"]
    assert rows["kt-cpu"]["cpu_expert_share"] == 1.0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert "model.language_model.orig_module.layers.3.mlp.experts" in profile["vismmoe-full @ 5MiB"]
    # configurations on the lean decode path also get its per-piece, per-layer breakdown of a step
    breakdown = rows["vismmoe-full"]["decode_profile"]["seconds_per_step"]
    assert set(breakdown["attention"]) == set(breakdown["experts"]) == {str(i) for i in range(4)}
    assert rows["vismmoe-base"]["decode_profile"] is not None
    assert set(rows["kt-cpu"]["decode_profile"]["seconds_per_step"]["experts"]) == {str(i) for i in range(4)}
    assert rows["all-on-gpu"]["decode_profile"] is None  # transformers' loop: no lean pieces to time

    # the parts of a long run merge into one table and chart (scripts/bench_h200.sh + merge_bench.py)
    from benchmarks.merge_bench import main as merge

    assert merge([str(tmp_path / "merged"), str(tmp_path / "bench.json"), str(tmp_path / "bench.json")]) == 0
    merged = json.loads((tmp_path / "merged" / "bench.json").read_text())
    assert len(merged["parts"]) == 2 and len(merged["rows"]) == 2 * len(CONFIGS)
    assert (tmp_path / "merged" / "bench.png").exists()


def _expert_kwargs(rules):
    return next(r["replace"]["kwargs"] for r in rules if r["replace"].get("class") == EXPERTS_OPERATOR)


@pytest.mark.slow
def test_synthetic_routing_rows_carry_the_belady_bound(tmp_path, capsys):
    rc = main(["--demo", "--configs", "all-pinned", "lru", "--image-sizes", "64", "--decode-tokens", "3",
               "--warmup", "0", "--repeats", "2", "--budgets", "5MiB", "--cpu_infer", "2", "--routing", "synthetic:5",
               "--output", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["routing"] == "synthetic:5" and "Belady decode" in capsys.readouterr().out
    lru = next(r for r in result["rows"] if r["config"] == "lru")
    pinned = next(r for r in result["rows"] if r["config"] == "all-pinned")
    assert 0 <= lru["hit_rate_decode"] <= 1 and 0 < lru["belady_hit_rate_decode"] <= 1
    assert pinned["belady_hit_rate_decode"] is None  # nothing offloaded: no cache to bound


@pytest.mark.slow
def test_concurrency_levels_report_batched_generation_against_batch_one(tmp_path, capsys):
    """`--concurrency N`: N requests with their own pictures decoded together, beside the configuration's
    batch-1 figures; a configuration off the lean decode path says why it has no such line."""
    rc = main(["--demo", "--configs", "lru", "all-on-gpu", "--image-sizes", "64", "--decode-tokens", "8",
               "--warmup", "0", "--repeats", "1", "--budgets", "5MiB", "--cpu_infer", "2", "--routing", "synthetic:5",
               "--concurrency", "2", "3", "--prefill-chunk", "16", "--output", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    rows = {row["config"]: row for row in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    levels = rows["lru"]["concurrency"]
    assert [level["requests"] for level in levels] == [2, 3] and all(level["status"] == "ok" for level in levels)
    for level in levels:
        assert level["aggregate_tok_s"] > 0 and level["full_batch_steps"] >= 1
        assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"] and 0 < level["itl_p50_s"] <= level["itl_p95_s"]
        assert level["decode_bytes_per_token"] >= 0 and level["steps"] >= 2 * (8 - 1)
        assert level["prefill_chunk"] == 16  # the demo's prompts (about 40 tokens) in chunks
    assert rows["all-on-gpu"]["concurrency"][0]["reason"] == "batched generation runs on the lean decode path"
    assert "| lru | 5MiB | 64 | 3 |" in out and "skipped: batched generation runs on the lean decode path" in out


def test_ablation_steps_add_one_thing_each():
    classes = lambda rules: {r["replace"].get("class") for r in rules}  # noqa: E731
    base, compress, predict, full = (CONFIGS[f"vismmoe{s}"].rules("24GB", "p.pt") for s in
                                     ("-base", "+compress", "+predict", "-full"))
    assert COMPRESSION_OPERATORS[0] not in classes(base) and set(COMPRESSION_OPERATORS) <= classes(compress)
    decoder = lambda rules: next(r["replace"]["kwargs"] for r in rules  # noqa: E731
                                 if r["replace"].get("class") == COMPRESSION_OPERATORS[1])
    assert decoder(base)["compression"] == "none" and decoder(compress)["compression"] == "affinity"
    # the decoder stays on every step (its forward lets the engine decode); decode options are not rule kwargs
    assert "decode" not in decoder(base) and "graphs" not in decoder(compress)
    assert _expert_kwargs(base)["prefetch_window"] == 0 and _expert_kwargs(base)["predictor"] is None
    assert _expert_kwargs(predict)["prefetch_window"] == 1 and _expert_kwargs(predict)["predictor"] == "p.pt"
    assert "prefetch_window" not in _expert_kwargs(full) and _expert_kwargs(full)["expert_budget"] == "24GB"
    assert {_expert_kwargs(r)["miss_policy"] for r in (base, compress, predict, full)} == {"wait"}
    assert _expert_kwargs(CONFIGS["hybrid-full"].rules("24GB"))["miss_policy"] == "auto"


@pytest.mark.parametrize("args, message", [
    (["--configs", "lru", "turbo"], "--configs: unknown configuration 'turbo'"),
    (["--budgets", "24 potatoes"], "--budgets '24 potatoes': not a byte size"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--layers", "2"], "--layers applies to --synthetic models only"),
    (["--profile"], "--profile writes profile.json into the --output directory"),
    (["--concurrency", "1"], "--concurrency must be at least 2"),
    (["--concurrency", "2", "--decode-tokens", "1"], "--decode-tokens must be at least 2"),
    (["--concurrency", "2", "--prefill-chunk", "1"], "--prefill-chunk must be 0 (whole prompts) or at least 2"),
])
def test_bad_input_gives_a_clear_error(args, message, capsys):
    assert main(["--demo", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_needs_exactly_one_model(capsys):
    assert main(["--decode-tokens", "2"]) == 2
    assert "give exactly one of --model_path DIR, --demo, --synthetic NAME or --gguf_path FILE" in capsys.readouterr().err


def test_accelerate_baseline_caps_the_gpu_by_whole_blocks(reference):
    """The AC placement (planned without a GPU): non-expert weights plus a budget of experts gets the
    first blocks on the GPU and leaves later decoder layers on the host."""
    from benchmarks.bench.accelerate_offload import non_expert_bytes, plan_device_map

    model, _ = reference
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    placement = plan_device_map(model, non_expert_bytes(model) + expert_bytes // 2)
    assert placement["model.language_model.layers.0"] == 0
    assert placement[max(k for k in placement if ".layers." in k)] == "cpu"


def test_an_unusable_predictor_stops_the_run_naming_the_flag(tmp_path, capsys):
    bad = tmp_path / "predictor.pt"
    bad.write_bytes(b"not a predictor")
    rc = main(["--demo", "--configs", "vismmoe-full", "--budgets", "10MiB", "--predictor", str(bad),
               "--image-sizes", "64", "--decode-tokens", "1", "--warmup", "0", "--repeats", "1"])
    assert rc == 2
    assert f"--predictor: predictor {bad}: unreadable" in capsys.readouterr().err


def test_a_budget_below_the_minimum_is_a_skipped_row_with_the_runtimes_reason(capsys):
    rc = main(["--demo", "--configs", "lru", "vismmoe-base", "--budgets", "4MiB", "--image-sizes", "64",
               "--decode-tokens", "1", "--warmup", "0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"\| lru \| 4MiB \| 64 \(\d+, \d+\) \|", out)  # one layer of slabs fits: it runs
    assert "| vismmoe-base | 4MiB | 64 (-) |" in out and "skipped: expert budget 4.0 MiB is too small" in out


@pytest.mark.slow
def test_the_demos_gguf_pair_alone_is_benchmarked_as_the_demo(tmp_path, monkeypatch, capsys):
    """`vismmoe-kt convert --demo`, then `bench --gguf_path FILE --mmproj_path FILE` with no --model_path: the
    model rebuilt from the two files' metadata runs the configuration, on the demo's prompt."""
    from vismmoe_kt.apps.cli import main as cli

    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path / "cache"))
    assert cli(["convert", "--demo", "--out", str(tmp_path / "files")]) == 0
    text, mmproj = tmp_path / "files" / "demo-4x32-BF16.gguf", tmp_path / "files" / "mmproj-demo-4x32-F16.gguf"
    run = ["--configs", "lru", "--budgets", "5MiB", "--image-sizes", "64", "--decode-tokens", "2", "--warmup", "0",
           "--repeats", "1", "--cpu_infer", "2"]
    rows = {}
    for name, source in (("demo", ["--demo"]), ("pair", ["--gguf_path", str(text), "--mmproj_path", str(mmproj)])):
        assert main([*source, *run, "--output", str(tmp_path / name)]) == 0
        result = json.loads((tmp_path / name / "bench.json").read_text())
        rows[name] = result["rows"][0]
    assert result["meta"]["model"] == f"{text} + {mmproj}"
    assert rows["pair"]["status"] == "ok" and rows["pair"]["decode_tok_s"]["median"] > 0
    assert (rows["pair"]["prompt_tokens"], rows["pair"]["visual_tokens"]) == (rows["demo"]["prompt_tokens"],
                                                                              rows["demo"]["visual_tokens"])
    capsys.readouterr()
    assert main(["--mmproj_path", str(mmproj), *run]) == 2
    assert "--mmproj_path goes with --gguf_path" in capsys.readouterr().err
    assert main(["--demo", "--gguf_path", str(text), *run]) == 2
    assert "--gguf_path goes with --model_path DIR or alone, not with --demo" in capsys.readouterr().err

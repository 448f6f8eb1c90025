"""The measurement scripts run end to end on tiny models (their numbers go to BENCHMARKS.md)."""

import json
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def test_compression_study_writes_rows_and_a_heatmap(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.compression_study", "--out", str(tmp_path), "--model", "tiny-4x16",
                             "--image-size", "96", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "compression_study.json").read_text())
    rows = {(r["compression"], r["keep_ratio"]): r for r in data["rows"]}
    assert len(rows) == 7 and rows[("none", 1.0)]["tokens_after_prefix"] == data["meta"]["prompt_tokens"]
    visual = data["meta"]["visual_tokens"]
    assert rows[("affinity", 0.5)]["tokens_after_prefix"] == data["meta"]["prompt_tokens"] - visual + visual // 2
    assert all(len(r["distinct_experts_per_layer"]) == 4 for r in rows.values())
    png = (tmp_path / "expert_heatmap.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_anchor_depth_study_sweeps_the_valid_depths(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.anchor_depth_study", "--out", str(tmp_path), "--model", "tiny-4x16",
                             "--budget-layers", "3", "--decode-tokens", "2", "--reps", "1", "--device", "cpu"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "anchor_depth.json").read_text())
    # Eq. 10 at 3 layers of budget, 1 layer of cache kept, from no layer (the default rule file's L_semantic 0)
    assert [r["pinned_layers"] for r in data["rows"]] == [0, 1, 2]
    assert data["auto_pinned_layers"] == 1  # no hit-rate curve for the tiny shape: one layer
    assert all(r["seconds_median"] > 0 for r in data["rows"])


def test_predictor_study_trains_evaluates_and_keeps_its_references(tmp_path):
    from benchmarks import predictor_study

    assert predictor_study.main(["--train-requests", "3", "--valid-requests", "1", "--test-requests", "1", "--tokens",
                                 "4", "--epochs", "1", "--ablations", "no-recent", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "predictor_study.json").read_text())
    results = data["results"]
    assert set(results) == {"calibrated", "no-recent", "router's own lookahead", "random guess"}
    assert all(0 <= r["@20"] <= 1 for r in results.values())
    assert results["router's own lookahead"]["@20"] > results["random guess"]["@20"]
    calibrated = data["details"]["calibrated"]
    assert calibrated["config"]["hidden_source"] == "synthetic" and calibrated["forward_ms_cpu_batch1"] > 0
    assert list(calibrated["by_position"]) == ["tokens 1-1", "tokens 2-4"]


def test_decode_bench_isolated_configurations_report_like_in_process_ones(tmp_path):
    """`--isolate` (what kt-kernel configurations always get) runs each configuration in a child
    process: its row comes back, and its greedy tokens are compared with `hf`'s from the parent."""
    common = ["--device", "cpu", "--tiny", "tiny-4x16", "--image-size", "96", "--decode-tokens", "4", "--reps", "1",
              "--configs", "hf", "offload:expert_budget=4MiB"]
    runs = {}
    for name, extra in (("inline", []), ("isolated", ["--isolate"])):
        out = tmp_path / name
        result = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out),
                                 *common, *extra], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "offload:expert_budget=4MiB: a prompt copied" in result.stdout  # the prompt's copies and reads
        runs[name] = {r["config"]: r for r in json.loads((out / "decode_bench.json").read_text())["rows"]}
    assert (tmp_path / "isolated" / "isolated" / "offload_expert_budget=4MiB" / "tokens.pt").exists()
    assert not (tmp_path / "inline" / "isolated").exists()
    for config in ("hf", "offload:expert_budget=4MiB"):
        inline, isolated = runs["inline"][config], runs["isolated"][config]
        assert isolated["tokens_agreeing_with_hf"] == inline["tokens_agreeing_with_hf"]
        assert isolated.get("decode_hit_rate") == inline.get("decode_hit_rate")
        assert isolated.get("prefill_gb_copied") == inline.get("prefill_gb_copied")
    offload = runs["isolated"]["offload:expert_budget=4MiB"]
    assert offload["tokens_agreeing_with_hf"] is not None
    # 4 MiB holds every expert of tiny-4x16, in since the warm-up request: the measured prompts copy nothing and
    # read no routing back
    assert offload["prefill_gb_copied"] == 0 and offload["routing_reads_per_request"] == 0
    # and so no expert of a prompt landed late, was fetched or was computed by the CPU (with a slab for every
    # expert, the layers run from the filled slabs without placing anything)
    placed = offload["prefill_placements"]
    assert set(placed) == {"hits", "late", "misses", "cpu", "cpu_seconds"}
    assert placed["late"] == placed["misses"] == placed["cpu"] == placed["cpu_seconds"] == 0
    assert runs["inline"]["offload:expert_budget=4MiB"]["prefill_placements"] == placed


def test_decode_bench_rows_say_how_a_prompts_experts_were_placed(tmp_path):
    """A budget of about one layer's experts: lru's prompts copy what they need (fetched, or streamed and landed
    late), while with every miss on the CPU (miss_policy cpu) the same prompt copies nothing and waits on the
    CPU's share instead."""
    out = tmp_path / "out"
    cpu = "vismmoe:expert_budget=17%,miss_policy=cpu,keep_ratio=1.0"
    result = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--device", "cpu",
                             "--tiny", "tiny-6x64", "--image-size", "96", "--decode-tokens", "3", "--reps", "1",
                             "--configs", "lru:expert_budget=17%", cpu], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads((out / "decode_bench.json").read_text())["rows"]}
    lru, on_cpu = rows["lru:expert_budget=17%"]["prefill_placements"], rows[cpu]["prefill_placements"]
    assert lru["cpu"] == 0 and lru["late"] + lru["misses"] > 0 and rows["lru:expert_budget=17%"]["prefill_gb_copied"] > 0
    assert on_cpu["cpu"] > 0 and on_cpu["misses"] == on_cpu["late"] == 0 and on_cpu["cpu_seconds"] > 0
    assert rows[cpu]["prefill_gb_copied"] == 0
    assert f"{on_cpu['cpu']:.0f} on the CPU" in result.stdout


def test_decode_bench_gguf_configurations_load_the_checkpoint_in_gguf(tmp_path):
    """`gguf_path=DIR` loads that checkpoint (here the synthetic writer's tiny one, Q4_K experts): its
    store keeps the file's format, the other configuration's is the model's dtype."""
    from benchmarks.models.synthetic_gguf import write_synthetic_checkpoint
    from vismmoe_kt.demo.tiny import SPECS, build_config, build_processor

    spec = SPECS["tiny-2x8"]
    processor = build_processor(spec)
    write_synthetic_checkpoint(tmp_path / "ckpt", build_config(spec, processor.tokenizer), processor, progress=False)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--device", "cpu",
               "--tiny", "tiny-2x8", "--image-size", "96", "--decode-tokens", "3", "--reps", "1", "--routing", "model",
               "--configs", "offload:expert_budget=24MiB"]
    gguf = f"offload:expert_budget=24MiB,gguf_path={tmp_path / 'ckpt'}"
    result = subprocess.run([*command, gguf], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads((out / "decode_bench.json").read_text())["rows"]}
    assert rows[gguf]["store"] == "q4_k" and rows["offload:expert_budget=24MiB"]["store"] == "model"
    assert rows[gguf]["load_s"] > 0 and rows[gguf]["rules"] == "optimize_rules/qwen3vl-offload.yaml"
    missing = subprocess.run([*command, f"offload:gguf_path={tmp_path / 'none'}"], capture_output=True, text=True,
                             timeout=600)  # refused before the first configuration loads
    assert missing.returncode == 2 and "cannot read the model's family from" in missing.stderr
    assert "Traceback" not in missing.stderr and not (out / "none").exists()


def test_decode_bench_concurrency_decodes_requests_together(tmp_path):
    """`--concurrency N`: the configuration's N requests through batched generation, reported beside
    the single request's rate; with a routing source and offloaded experts, also the PCIe bytes per
    generated token. The timed run prefills its prompts whole, together (not continuing the warm-up's
    KV, which the runner would keep for a next turn), and each request gets its tokens alone, under
    the routing source too (the same table it had in the timed run)."""
    command = [sys.executable, "-m", "benchmarks.decode_bench", "--out", str(tmp_path), "--device", "cpu",
               "--tiny", "tiny-4x16", "--image-size", "96", "--decode-tokens", "6", "--reps", "1", "--configs", "offload:expert_budget=1GiB",
               "--concurrency", "2", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    levels = json.loads((tmp_path / "decode_bench.json").read_text())["rows"][0]["batched"]
    assert [b["requests"] for b in levels] == [2, 3]
    for batched in levels:
        assert batched["full_batch_steps"] >= 1 and batched["full_batch_decode_tok_s"] > 0
        assert batched["graphed_steps"] == 0 and batched["steps"] >= 6  # graphs: auto is eager on the CPU
        assert batched["reused_prefixes"] == 0 and batched["grouped_prompts"] == batched["requests"]
        assert batched["tokens_agreeing_alone"] == [1.0] * batched["requests"]
    assert "3 requests together" in result.stdout and "2 requests together" in result.stdout
    offloaded = [*command[:command.index("--configs")], "--configs", "offload:expert_budget=1280KiB", "--routing", "synthetic",
                 "--concurrency", "3", "--out", str(tmp_path / "offloaded")]
    result = subprocess.run(offloaded, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "offloaded" / "decode_bench.json").read_text())["rows"][0]
    assert row["decode_bytes_per_token"] > 0 and row["batched"][0]["decode_bytes_per_token"] > 0
    assert row["batched"][0]["tokens_agreeing_alone"] == [1.0] * 3
    assert "MB over PCIe per token" in result.stdout


def test_decode_bench_splits_a_cpu_expert_prefill(tmp_path):
    """Every routed expert on kt-kernel: the row says how much of a prefill went to the vision tower and to the
    CPU experts' calls (their prefill calls only), and the GB/s of expert weights that implies."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(tmp_path),
                             "--device", "cpu", "--tiny", "tiny-6x64", "--image-size", "96", "--decode-tokens", "4",
                             "--reps", "1", "--configs", "kt-cpu:cpu_backend=kt-kernel"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "decode_bench.json").read_text())["rows"][0]
    assert row["prefill_vision_s"] > 0 and row["prefill_cpu_expert_s"] > 0 and row["prefill_cpu_expert_gb_s"] > 0
    assert re.search(r"kt-cpu:cpu_backend=kt-kernel: a prefill's [\d.]+ s: vision tower [\d.]+ s, CPU experts [\d.]+ s", result.stdout)


def test_decode_bench_reports_the_layerwise_gpu_prefill(tmp_path):
    """kt-cpu with gpu_prefill_tokens: the prompt's experts go through the host copy (here the CPU twin), a quarter of each
    layer's there and the rest on the CPU backend, and the row says so."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(tmp_path),
                             "--device", "cpu", "--tiny", "tiny-6x64", "--image-size", "96", "--decode-tokens", "4",
                             "--reps", "1", "--configs",
                             "kt-cpu:cpu_backend=kt-kernel,gpu_prefill_tokens=2,gpu_prefill_share=0.25"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "decode_bench.json").read_text())["rows"][0]
    assert row["gpu_prefill_prefills"] == 2  # the warm-up's and the measured one's
    assert row["gpu_prefill_gpu_share"] == 0.25 and row["gpu_prefill"].startswith("layerwise GPU prefill from 2 tokens: q8_0")
    assert "of the prefill layers' experts on the GPU" in result.stdout


def test_decode_rate_is_measured_from_the_tokens_arrivals(tiny_dir, image_inputs, monkeypatch):
    """A decode rate is the tokens' arrival times, not the device sync after the last one (which may wait on
    work queued for a later request, such as the layerwise prefill's copy of the next prompt's first layer)."""
    from vismmoe_kt import load
    from benchmarks.bench import timing

    model, _ = load(tiny_dir, "optimize_rules/qwen3vl-gpu.yaml", generate_device="cpu", prefill_device="cpu",
                    progress=False)
    syncs = []
    monkeypatch.setattr(timing, "_sync", lambda: syncs.append(time.sleep(0.05)))  # a slow device-wide sync
    timed = timing.timed_generate(model, dict(image_inputs), 5)
    assert len(syncs) == 2 and len(timed.gaps_s) == 5 and timed.tokens.shape == (6,)
    assert timed.decode_tok_s == pytest.approx(5 / sum(timed.gaps_s), rel=1e-9)
    assert timed.prefill_s > 0


def test_decode_bench_says_what_pruning_kept_and_what_the_prompts_copies_took(tmp_path):
    """The default rules prune visual tokens after the pinned prefix: the row says how many prompt tokens went on
    and the host's milliseconds choosing them; every offloaded row says its copies' seconds and the waits on them."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--out", str(tmp_path), "--device", "cpu",
                             "--tiny", "tiny-4x16", "--image-size", "96", "--decode-tokens", "4", "--reps", "1",
                             "--configs", "vismmoe:expert_budget=50%", "lru:expert_budget=50%"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads((tmp_path / "decode_bench.json").read_text())["rows"]}
    pruned, plain = rows["vismmoe:expert_budget=50%"], rows["lru:expert_budget=50%"]
    assert 0 < pruned["prompt_tokens_kept"] < pruned["prompt_tokens"] and pruned["compression_ms"] > 0
    assert "prompt_tokens_kept" not in plain  # lru prunes nothing
    for row in (pruned, plain):
        assert row["prefill_copy_s"] >= 0 and row["prefill_stall_s"] >= 0
    assert re.search(r"vismmoe:expert_budget=50%: .* \d+ of \d+ prompt tokens kept past the prefix, chosen in [\d.]+ ms",
                     result.stdout)

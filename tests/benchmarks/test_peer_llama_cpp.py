"""llama.cpp's llama-bench beside decode_bench (benchmarks/peers/llama_cpp.py): a GGUF's expert bytes per layer,
the -ncmoe split of a budget and back, llama-bench run and its JSON read (a fake llama-bench here), the
side-by-side table."""

import json
import os
import stat
import sys

import pytest
import torch

from benchmarks.configurations import parse_configuration
from benchmarks.peers.llama_cpp import (PEER_ROUTING, ExpertLayout, PeerError, bench_command, budget_bytes,
                                        find_llama_bench, gpu_expert_bytes, markdown, ncmoe_for_budget, parse_records,
                                        peer_report, read_expert_layout, run_llama_bench, side_by_side, split_for)

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from benchmarks.models.synthetic_gguf import write_synthetic_checkpoint
    from vismmoe_kt.demo.tiny import SPECS, build_config, build_processor

    spec = SPECS["tiny-2x8"]  # rows of 256 and 512: whole K-quant super-blocks
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    out = tmp_path_factory.mktemp("peer-gguf")
    info = write_synthetic_checkpoint(out, config, processor, qtype="Q4_K", rest="Q8_0", progress=False,
                                      dtype=torch.float32)
    return info, config.text_config


def test_the_expert_bytes_per_layer_are_the_expert_tensors_sizes(tiny_gguf):
    info, text = tiny_gguf
    layout = read_expert_layout(info["gguf_file"])
    assert layout.arch == "qwen3vlmoe" and layout.layers == text.num_hidden_layers == 2
    # Q4_K: 144 bytes per 256 weights; gate, up and down: experts x hidden x moe_intermediate each
    per_tensor = text.num_experts * text.hidden_size * text.moe_intermediate_size * 144 // 256
    assert layout.per_layer == (3 * per_tensor, 3 * per_tensor)
    assert layout.total == 6 * per_tensor
    # the other Q8_0 / F32 tensors (attention, router, norms) are not experts: the file is larger
    assert os.path.getsize(info["gguf_file"]) > layout.total


def test_a_file_that_is_not_a_moe_gguf_is_refused_by_name(tmp_path):
    pytest.importorskip("gguf")
    with pytest.raises(PeerError, match="no such file"):
        read_expert_layout(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(PeerError, match="not a readable GGUF"):
        read_expert_layout(junk)


PER_LAYER = (10, 10, 20, 30)  # llama.cpp keeps the FIRST N layers' experts on the CPU


@pytest.mark.parametrize("budget, ncmoe", [
    (0, 4),          # nothing fits: every layer's experts on the CPU
    (29, 4),         # one byte short of the last layer
    (30, 3),         # exactly the last layer
    (49, 3),
    (50, 2),         # exactly layers 2..3
    (60, 1), (69, 1),
    (70, 0),         # exactly everything
    (10**15, 0),     # a huge budget: every expert on the GPU
])
def test_ncmoe_for_budget_is_the_smallest_split_whose_last_layers_fit(budget, ncmoe):
    assert ncmoe_for_budget(PER_LAYER, budget) == ncmoe
    assert gpu_expert_bytes(PER_LAYER, ncmoe) <= budget
    if ncmoe > 0:  # one layer more on the GPU would not fit
        assert gpu_expert_bytes(PER_LAYER, ncmoe - 1) > budget


def test_a_split_s_gpu_bytes_map_back_to_the_same_split_and_layers_without_experts_are_free():
    for n in range(len(PER_LAYER) + 1):
        assert ncmoe_for_budget(PER_LAYER, gpu_expert_bytes(PER_LAYER, n)) == n
    assert gpu_expert_bytes(PER_LAYER, 0) == 70 and gpu_expert_bytes(PER_LAYER, 4) == 0
    assert ncmoe_for_budget((10, 10, 0), 0) == 2  # a dense last layer costs nothing on the GPU
    with pytest.raises(ValueError):
        gpu_expert_bytes(PER_LAYER, -1)


LAYOUT = ExpertLayout("model-Q4_K.gguf", "qwen3vlmoe", tuple([GiB // 2] * 48))  # 24 GiB of experts, 48 layers


def test_budgets_sizes_and_shares_map_to_splits_and_configurations_to_theirs():
    assert budget_bytes("6GiB", LAYOUT) == 6 * GiB and budget_bytes("25%", LAYOUT) == 6 * GiB
    assert ncmoe_for_budget(LAYOUT.per_layer, budget_bytes("6GiB", LAYOUT)) == 36  # 12 layers of 0.5 GiB
    assert split_for(parse_configuration("offload:expert_budget=6GiB,store_dtype=q4_k", "qwen3_vl_moe"), LAYOUT)[0] == 36
    assert split_for(parse_configuration("lru:expert_budget=1TiB", "qwen3_vl_moe"), LAYOUT)[0] == 0
    assert split_for(parse_configuration("offload", "qwen3_vl_moe"), LAYOUT)[0] == 16  # the rule's 16GiB default
    assert split_for(parse_configuration("kt-cpu:cpu_backend=kt-kernel", "qwen3_vl_moe"), LAYOUT) == \
        (48, "every routed expert on the CPU")
    assert split_for(parse_configuration("hf", "qwen3_vl_moe"), LAYOUT)[0] == 0
    with pytest.raises(PeerError, match="expert_budget"):
        budget_bytes("lots", LAYOUT)


RECORDS = [
    {"build_commit": "abc123", "gpu_info": "NVIDIA H200", "n_threads": 14, "n_cpu_moe": n, "n_prompt": p, "n_gen": g,
     "n_depth": d, "avg_ts": ts, "stddev_ts": 1.5, "samples_ts": [ts, ts]}
    for n, p, g, d, ts in [(0, 300, 0, 0, 9000.0), (0, 0, 31, 300, 250.0), (36, 300, 0, 0, 2000.0),
                           (36, 0, 31, 300, 80.0), (48, 300, 0, 0, 780.0), (48, 0, 31, 300, 40.0),
                           (36, 0, 31, 0, 95.0)]  # a tg at depth 0: not our decode's depth
]


def fake_llama_bench(tmp_path, body: str):
    """An executable that stands for llama-bench: a Python script that records its argv, then `body`."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_runner_builds_the_command_and_reads_the_json_records(tmp_path):
    binary = fake_llama_bench(tmp_path, f"print('warming up')\nprint(json.dumps({RECORDS!r}, indent=2))")
    command = bench_command(binary, "model-Q4_K.gguf", [36, 0, 48, 36], threads=14, prompt=300, gen=31,
                            depths=[0, 300], reps=3)
    assert run_llama_bench(command, timeout=60) == RECORDS  # the list after a line of other output
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == ["-m", "model-Q4_K.gguf", "-ngl", "99", "-ncmoe", "0,36,48", "-fa", "1", "-t", "14", "-p", "300",
                    "-n", "31", "-d", "0,300", "-r", "3", "-o", "json"]


def test_a_failing_or_garbled_llama_bench_is_a_clear_error(tmp_path, monkeypatch):
    failing = fake_llama_bench(tmp_path, "print('loading', file=sys.stderr)\n"
                                         "print('error: failed to load model', file=sys.stderr)\nsys.exit(1)")
    with pytest.raises(PeerError, match="(?s)status 1; its stderr ends:\nloading\nerror: failed to load model"):
        run_llama_bench([failing], timeout=60)
    garbage = fake_llama_bench(tmp_path, "print('| model | size | t/s |')")
    with pytest.raises(PeerError, match=r"no JSON list of records.*\| model \| size"):
        run_llama_bench([garbage], timeout=60)
    with pytest.raises(PeerError, match="lacks n_cpu_moe, avg_ts"):
        parse_records(json.dumps([{"n_prompt": 0, "n_gen": 31, "n_depth": 0, "stddev_ts": 1.0}]))
    slow = fake_llama_bench(tmp_path, "import time\ntime.sleep(30)")
    with pytest.raises(PeerError, match="ran past 0.5 s"):
        run_llama_bench([slow], timeout=0.5)


def test_a_missing_or_unexecutable_binary_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PeerError, match="no llama-bench: give --llama_bench PATH or set LLAMA_BENCH"):
        find_llama_bench(None)
    with pytest.raises(PeerError, match="--llama_bench .*nothing-here: no such file"):
        find_llama_bench(str(tmp_path / "nothing-here"))
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    monkeypatch.setenv("LLAMA_BENCH", str(plain))
    with pytest.raises(PeerError, match="LLAMA_BENCH .*plain: not executable"):
        find_llama_bench(None)
    binary = fake_llama_bench(tmp_path, "")
    assert find_llama_bench(binary) == binary


OUR_ROWS = [{"config": "offload:expert_budget=6GiB,store_dtype=q4_k", "decode_tok_s_median": 120.0,
             "prefill_s_median": 0.3, "prompt_tokens": 300},
            {"config": "kt-cpu:cpu_backend=kt-kernel", "decode_tok_s_median": 30.0, "prefill_s_median": 0.6,
             "prompt_tokens": 300}]
SPLITS = {OUR_ROWS[0]["config"]: (36, "expert_budget=6GiB"), OUR_ROWS[1]["config"]: (48, "every routed expert on the CPU")}


def test_the_side_by_side_table_matches_split_and_depth_and_adds_llama_cpp_s_unmatched_splits():
    table = side_by_side(OUR_ROWS, SPLITS, RECORDS, LAYOUT, "synthetic", gen=31, extra_splits=(0, 48))
    offload, ktcpu, resident = table
    assert offload["ncmoe"] == 36 and offload["peer_tg_tok_s"] == 80.0  # depth 300, not the depth-0 tg's 95
    assert offload["decode_ratio"] == pytest.approx(1.5) and offload["peer_pp_tok_s"] == 2000.0
    assert offload["prefill_tok_s"] == pytest.approx(1000.0) and offload["prefill_ratio"] == pytest.approx(0.5)
    assert offload["peer_gpu_expert_bytes"] == 6 * GiB and offload["peer_gpu_layers"] == 12
    assert ktcpu["ncmoe"] == 48 and ktcpu["decode_ratio"] == pytest.approx(0.75) and ktcpu["peer_gpu_expert_bytes"] == 0
    # ncmoe 0 matched no configuration: llama.cpp's row alone
    assert resident["config"] == "llama.cpp -ncmoe 0" and resident["decode_tok_s"] is None
    assert resident["peer_tg_tok_s"] == 250.0 and resident["decode_ratio"] is None
    assert all(e["peer_routing"] == PEER_ROUTING for e in table)
    assert [e["routing"] for e in table] == ["synthetic", "synthetic", None]
    text = markdown(table, {"decode_tokens": 31, "layers": 48, "routing": "synthetic", "command": ["llama-bench"]})
    lines = text.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 11
    assert "| offload:expert_budget=6GiB,store_dtype=q4_k | synthetic | 120.00 | 36 (12 of 48 layers, 6.0 GiB) " \
           "| 80.00 ± 1.50 | 1.50 | 1000 | pp300: 2000 | 0.50 | random weights' own router, static per layer |" in lines
    assert "random weights' own router" in text and "statically per layer" in text
    assert "the image prompt's (vision tower included)" in text  # meta names no prompt: an image's, as before
    text_prompt = markdown(table, {"decode_tokens": 31, "layers": 48, "routing": "synthetic", "command": ["x"],
                                   "our_prompt": "text"})
    assert "Both prefills are text prompts" in text_prompt and "vision tower" not in text_prompt


def test_peer_report_runs_the_splits_and_writes_json_and_markdown(tmp_path):
    binary = fake_llama_bench(tmp_path, f"print(json.dumps({RECORDS!r}))")
    configs = [parse_configuration(r["config"], "qwen3_vl_moe") for r in OUR_ROWS]
    layout = ExpertLayout(str(tmp_path / "model.gguf"), "qwen3vlmoe", LAYOUT.per_layer)
    table = peer_report(configs, OUR_ROWS, layout, binary, tmp_path / "out", routing="trace", decode_tokens=32,
                        threads=4, reps=2)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-ncmoe") + 1] == "0,36,48" and argv[argv.index("-n") + 1] == "31"
    assert argv[argv.index("-d") + 1] == "0,300" and argv[argv.index("-p") + 1] == "300"
    written = json.loads((tmp_path / "out" / "peer_llama_cpp.json").read_text())
    assert written["table"] == table and written["records"] == RECORDS
    assert written["meta"]["build_commit"] == "abc123" and written["meta"]["layers"] == 48
    assert "| trace |" in (tmp_path / "out" / "peer_llama_cpp.md").read_text()
    assert written["meta"]["our_prompt"] == "text"  # the rows carry no vision tower's time


def test_a_failed_peer_run_writes_nothing(tmp_path):
    binary = fake_llama_bench(tmp_path, "sys.exit(2)")
    configs = [parse_configuration(r["config"], "qwen3_vl_moe") for r in OUR_ROWS]
    with pytest.raises(PeerError, match="status 2"):
        peer_report(configs, OUR_ROWS, LAYOUT, binary, tmp_path / "out", routing="synthetic", decode_tokens=32, threads=4)
    assert not (tmp_path / "out").exists()


# a llama-bench that answers the tests it is asked for: a pp and a tg record per split and depth
ANSWERING = """args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
records = [{"n_cpu_moe": int(n), "n_prompt": p, "n_gen": g, "n_depth": int(d), "avg_ts": 100.0 + int(n),
            "stddev_ts": 0.5, "build_commit": "fake"}
           for n in value("-ncmoe").split(",") for d in value("-d").split(",")
           for p, g in ((int(value("-p")), 0), (0, int(value("-n"))))]
print(json.dumps(records, indent=2))"""


@pytest.mark.slow
def test_decode_bench_runs_llama_bench_beside_its_configurations(tmp_path, tiny_gguf):
    import subprocess

    info, text = tiny_gguf
    checkpoint = os.path.dirname(info["gguf_file"])
    binary = fake_llama_bench(tmp_path, ANSWERING)
    out = tmp_path / "out"
    config = f"offload:expert_budget=10MiB,gguf_path={checkpoint}"  # the file's Q4_K experts fit: -ncmoe 0
    command = [sys.executable, "-m", "benchmarks.decode_bench", "--out", str(out), "--device", "cpu",
               "--tiny", "tiny-2x8", "--image-size", "96", "--decode-tokens", "3", "--reps", "1", "--routing", "model",
               "--configs", config, "--peer", "llama.cpp", "--peer_gguf", info["gguf_file"]]
    done = subprocess.run([*command, "--llama_bench", binary], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = json.loads((out / "decode_bench.json").read_text())["rows"][0]
    peer = json.loads((out / "peer_llama_cpp.json").read_text())
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-ncmoe") + 1] == "0,2" and argv[argv.index("-n") + 1] == "2"
    assert argv[argv.index("-p") + 1] == str(ours["prompt_tokens"])
    row, all_cpu = peer["table"]
    assert row["config"] == config and row["ncmoe"] == 0 and row["peer_tg_tok_s"] == 100.0
    assert row["decode_ratio"] == pytest.approx(ours["decode_tok_s_median"] / 100.0)
    assert all_cpu["ncmoe"] == 2 and all_cpu["peer_tg_tok_s"] == 102.0 and all_cpu["decode_tok_s"] is None
    assert "| model |" in (out / "peer_llama_cpp.md").read_text()
    # refused before anything loads, without a traceback: no model file, a binary that is not there
    no_file = subprocess.run(command[:-4] + ["--peer", "llama.cpp"], capture_output=True, text=True, timeout=600)
    assert no_file.returncode == 2 and "--peer llama.cpp needs --peer_gguf FILE" in no_file.stderr
    no_binary = subprocess.run([*command, "--llama_bench", str(tmp_path / "absent")], capture_output=True, text=True,
                               timeout=600)
    assert no_binary.returncode == 2 and "absent: no such file" in no_binary.stderr
    assert "Traceback" not in no_file.stderr + no_binary.stderr
    # llama-bench failing after our rows: they are written, its error said, status 1
    failing = fake_llama_bench(tmp_path, "print('CUDA error: out of memory', file=sys.stderr)\nsys.exit(1)")
    done = subprocess.run([*command, "--llama_bench", failing, "--out", str(tmp_path / "failed")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1 and "CUDA error: out of memory" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "failed" / "decode_bench.json").exists() and not (tmp_path / "failed" / "peer_llama_cpp.json").exists()

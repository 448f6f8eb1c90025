"""benchmarks/vision_tower_bench.py: kernel names sorted into kinds, the tower's GEMM work counted from its config,
and a tiny model's tower timed on the CPU (replayed through the graph's CPU twin), an sdpa backend as an
alternative compared with the committed run's output."""
import json
import types

import pytest

from benchmarks import vision_tower_bench as bench


def test_kernel_names_fall_into_kinds():
    assert bench.kind_of("nvjet_sm90_tst_64x112_64x9_2x1_v_bz_bias_TNT") == "gemm"
    assert bench.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert bench.kind_of("void at::native::vectorized_layer_norm_kernel<c10::BFloat16>") == "norm"
    assert bench.kind_of("void at::native::CatArrayBatchedCopy<OpaqueType<4u>>") == "copy"
    assert bench.kind_of("triton_poi_fused_gelu_1") == "element-wise"


def test_the_towers_products_counted_from_its_config():
    import torch

    config = types.SimpleNamespace(hidden_size=1152, intermediate_size=4304, depth=27)
    flops = bench.tower_flops(torch.tensor([[1, 28, 28]]), config)  # a 448 px picture: 784 patches
    assert flops == 2.0 * 784 * 27 * (4 * 1152 * 1152 + 2 * 1152 * 4304)
    assert 0.63e12 < flops < 0.66e12


def test_a_tiny_towers_run_on_the_cpu_with_a_backend_alternative(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--tiny", "tiny-2x8", "--device", "cpu", "--image-sizes", "96",
                       "--reps", "2", "--attention-backends", "math"]) == 0
    result = json.loads((tmp_path / "vision_tower_bench.json").read_text())
    committed, alternative = result["committed"]["96 px"], result["sdpa math"]["96 px"]
    assert len(committed["replay_ms"]) == 2 and all(t > 0 for t in committed["replay_ms"])
    # the graph's counters run on over the process: the alternative captured the size anew and replayed it
    assert committed["graph"]["captures"] >= 1 and committed["graph"]["replays"] >= 2
    assert alternative["graph"]["captures"] == committed["graph"]["captures"] + 1
    assert alternative["graph"]["replays"] >= committed["graph"]["replays"] + 2
    assert alternative["max_difference"] <= 1e-2 * alternative["reference_max"]
    assert "sdpa math, 96 px: replay" in capsys.readouterr().out


def test_bad_flags_say_why():
    with pytest.raises(SystemExit):
        bench.main(["--out", "x", "--reps", "0", "--tiny", "tiny-2x8", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench.main(["--out", "x", "--attention-backends", "nope", "--tiny", "tiny-2x8", "--device", "cpu"])

"""prefill_kernel_bench's --adopt: the sweep's fastest tiles written into a tuning table's entry for the GPU,
where tuning.prefill_tiles then finds them for a prompt of that length."""

import json

import pytest

from benchmarks import prefill_kernel_bench as bench
from vismmoe_kt.runtime.kernels import tuning


def sweep_rows() -> list[dict]:
    return [{"part": "gate_up", "block_m": 32, "tiles": (64, 4, 1, 256), "us_per_layer": 630.0},
            {"part": "gate_up", "block_m": 16, "tiles": (128, 4, 1, 64, "weights"), "us_per_layer": 410.0},
            {"part": "gate_up", "block_m": 16, "tiles": (256, 8, 1, 64, "weights"), "error": "out of resources"},
            {"part": "down", "block_m": 32, "tiles": (128, 4, 3, 64), "us_per_layer": 380.0},  # another block M
            {"part": "down", "block_m": 16, "tiles": (64, 4, 1, 64, "weights"), "us_per_layer": 450.0},
            {"part": "down", "block_m": 16, "tiles": (128, 4, 1, 64, "weights"), "us_per_layer": 420.0}]


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({
        "default": {"quantized_prefill": {"block_m": 32, "gate_up": [64, 4, 1], "down": [128, 4, 1]}},
        "GPU A": {"quantized_prefill": {"block_m": 32, "gate_up": [64, 4, 1], "down": [128, 4, 1],
                                        "long": {"from_pairs_per_expert": 32, "block_m": 64,
                                                 "gate_up": [64, 4, 2, 64], "down": [128, 4, 2, 64]}}}}))
    monkeypatch.setattr(tuning, "TABLE", path)
    tuning.entry.cache_clear()
    yield path
    tuning.entry.cache_clear()


def test_the_fastest_gate_up_and_the_fastest_down_at_its_block_are_adopted(table):
    prefill = bench.adopt(sweep_rows(), 236, "GPU A", table)   # 236 x 8 / 128: 14.75 pairs an expert, short
    assert (prefill["block_m"], prefill["gate_up"], prefill["down"]) == \
        (16, [128, 4, 1, 64, "weights"], [128, 4, 1, 64, "weights"])
    assert prefill["long"]["block_m"] == 64                      # the long prompts' tiles untouched
    tuning.entry.cache_clear()
    short = tuning.entry("GPU A")["quantized_prefill"]
    assert short["gate_up"] == (128, 4, 1, 64, "weights") and short["block_m"] == 16


def test_a_long_prompts_sweep_lands_in_the_long_tiles_and_a_new_gpu_gets_an_entry(table):
    bench.adopt(sweep_rows(), 512, "GPU A", table)               # 32 pairs an expert: the long tiles
    data = json.loads(table.read_text())
    assert data["GPU A"]["quantized_prefill"]["long"]["block_m"] == 16
    assert data["GPU A"]["quantized_prefill"]["gate_up"] == [64, 4, 1]
    bench.adopt(sweep_rows(), 236, "GPU B", table)               # no entry yet: the default's, then the sweep's
    assert json.loads(table.read_text())["GPU B"]["quantized_prefill"]["down"] == [128, 4, 1, 64, "weights"]
    assert json.loads(table.read_text())["default"]["quantized_prefill"]["block_m"] == 32


def test_a_sweep_with_nothing_timed_adopts_nothing(table):
    before = table.read_text()
    with pytest.raises(ValueError, match="nothing to adopt"):
        bench.adopt([r for r in sweep_rows() if r["part"] == "down"], 236, "GPU A", table)
    assert table.read_text() == before

"""The kernels' tuned configurations as data (runtime/kernels/tuning.py, tuning.json): the default
entry serves the CPU and unknown devices, a device's entry overrides it key by key, and a block can
override values for every device."""

import json

import pytest
import torch

from vismmoe_kt.runtime.kernels import tuning


def test_the_cpu_and_unknown_devices_get_the_default_entry():
    assert tuning.device_name(None) == tuning.device_name("cpu") == tuning.device_name(torch.device("cpu")) == "default"
    assert tuning.entry("a GPU nobody measured") == tuning.entry("default")
    assert tuning.get("bf16_gemv", "cpu") == {"gate_up": (4, 512, 2), "down": (16, 256, 2)}


def test_the_h200_values_are_the_measured_ones():
    """The values benchmarks/results/kernel-tuning.md gives the evidence for."""
    h200 = tuning.entry("NVIDIA H200")
    assert h200["bf16_gemv"] == {"gate_up": (1, 1024, 1), "down": (8, 256, 1)}
    assert h200["quantized_gemv"] == {"q8_0": (2, 1, "tile"), "q4_0": (2, 1, "tile"), "q4_k": (4, 1, "shared"),
                                      "q5_k": (2, 1, "tile"), "q6_k": (8, 1, "loop")}
    assert h200["q4_k_word_loads"] is True
    assert h200["expert_major"] == {"gate_up": (64, 128, 4, 4), "down": (64, 128, 4, 4)}
    assert h200["quantized_major"] == {"gate_up": (64, 4, 1), "down": (64, 2, 1)}
    assert h200["quantized_prefill"] == {"block_m": 32, "gate_up": (64, 4, 1), "down": (128, 4, 1)}
    assert h200["prefetch_programs"] == 32


def test_the_h100_takes_the_dp4a_form_and_every_device_the_batched_gemvs_crossover():
    """Measured on an H100 (kernel-tuning.md): the dp4a form 18.0 us a layer against the shared form's 22.1, and
    one launch of GEMVs beat the expert-major kernels at every batch to 16 tokens (128 pairs)."""
    h100 = tuning.entry("NVIDIA H100 80GB HBM3")
    assert h100["quantized_gemv"]["q4_k"] == (8, 2, "dp4a")
    assert h100["quantized_gemv"]["q8_0"] == (2, 2, "tile")
    assert {tuning.entry(name)["quantized_batch_gemv_pairs"] for name in ("default", "NVIDIA H200",
                                                                           "NVIDIA H100 80GB HBM3")} == {128}


def test_a_device_entry_overrides_the_default_key_by_key(tmp_path, monkeypatch):
    table = json.loads(tuning.TABLE.read_text())
    table["Some GPU"] = {"prefetch_programs": 8}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TABLE", path)
    tuning.entry.cache_clear()
    try:
        some = tuning.entry("Some GPU")
        assert some["prefetch_programs"] == 8
        assert some["bf16_gemv"] == tuning.entry("default")["bf16_gemv"]
    finally:
        tuning.entry.cache_clear()


def test_overridden_values_hold_inside_the_block_only():
    with tuning.overridden(q4_k_word_loads=False):
        assert tuning.get("q4_k_word_loads", "cpu") is False
        with tuning.overridden(prefetch_programs=4):
            assert tuning.get("prefetch_programs") == 4 and tuning.get("q4_k_word_loads") is False
        assert tuning.get("prefetch_programs") == 32
    assert tuning.get("q4_k_word_loads") is True
    with pytest.raises(KeyError):
        tuning.get("no such key")


def test_a_long_prompt_takes_the_long_prefill_tiles_where_the_device_has_them():
    """The H100's entry adds blocks of 64 pairs from 32 pairs per expert (measured there at 512 and 824 tokens), both
    with the weights first (530.9 against 628.1 us a layer at 236 tokens, 702.4 against 759.6 at 512); the H200 and
    the default have none, so every prompt keeps quantized_prefill's own tiles."""
    h100 = "NVIDIA H100 80GB HBM3"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "device_name", lambda device: h100 if device == "h100" else "NVIDIA H200")
        short, long = tuning.prefill_tiles("h100", 236 * 8 / 128), tuning.prefill_tiles("h100", 512 * 8 / 128)
        weights_first = (128, 4, 1, 64, "weights")
        assert short["block_m"] == 32 and short["gate_up"] == short["down"] == weights_first
        assert long["block_m"] == 64 and long["gate_up"] == long["down"] == weights_first
        assert tuning.prefill_tiles("h200", 10_000) == tuning.entry("NVIDIA H200")["quantized_prefill"]
    assert tuning.prefill_tiles("cpu", 10_000)["block_m"] == 32

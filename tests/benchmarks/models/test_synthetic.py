"""Synthetic full-size models per family (benchmarks/models/synthetic.py): DeepSeek-OCR-2's published shapes (checked
on the meta device: nothing is made), its CPU-sized narrow variant loaded through the family's stock and
offload rule files, synthetic routing weighed as DeepSeek's router weighs, and decode_bench's configurations
run end to end on it."""

import json

import pytest
import torch

from benchmarks.bench.inputs import count_tokens, make_request
from vismmoe_kt.core.loader import _build_on_meta
from benchmarks.models.synthetic import (SYNTHETIC_MODELS, load_synthetic, routed_expert_bytes, synthetic_config,
                                       synthetic_processor)
from vismmoe_kt.operators.source_router import install_routing
from vismmoe_kt.models import adapter_for

CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False, dtype="float32")
EXPERT = 3 * 1280 * 896 * 2  # one DeepSeek-OCR-2 expert in BF16: gate, up and down, 1280 x 896 each


@pytest.fixture(scope="module")
def processor():
    return synthetic_processor("deepseek-ocr2")


def test_deepseek_ocr2_has_its_published_shapes(processor):
    config = synthetic_config("deepseek-ocr2", processor.tokenizer)
    shape = adapter_for(config.model_type).moe_shape(config)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter) == (64, 6, 1280, 896)
    assert shape.moe_layers == tuple(range(1, 12))  # layer 0 is the dense one
    text = config.text_config
    assert (text.n_shared_experts, text.vocab_size, text.intermediate_size, text.num_attention_heads) == (2, 129280, 6848, 10)
    meta = _build_on_meta(adapter_for(config.model_type), config)
    assert 3.3e9 < sum(p.numel() for p in meta.parameters()) < 3.5e9  # "about 3B": 2.9B text, 0.46B vision
    assert routed_expert_bytes(config) == 11 * 64 * EXPERT  # 4.84 GB: one H200 holds it all


def test_a_layer_cut_and_the_narrow_variant_keep_the_layout(processor):
    cut = synthetic_config("deepseek-ocr2", processor.tokenizer, layers=2)
    assert cut.text_config.mlp_layer_types == ["dense", "sparse"]
    narrow = synthetic_config("deepseek-ocr2", processor.tokenizer, narrow=True)
    shape = adapter_for(narrow.model_type).moe_shape(narrow)
    assert (shape.num_experts, shape.top_k, shape.moe_layers) == (64, 6, tuple(range(1, 12)))
    assert shape.hidden < 1280 and narrow.text_config.n_shared_experts == 2


def test_a_448_px_picture_is_one_global_view(processor):
    """DeepSeek-OCR-2's processor pads a picture no wider than a 768 px tile into the 1024 px global view:
    16 x 16 visual tokens and the view separator."""
    request = make_request(processor, 448, "cpu")
    config = synthetic_config("deepseek-ocr2", processor.tokenizer)
    assert tuple(request["pixel_values"].shape) == (1, 3, 1024, 1024)
    assert count_tokens(request, config.image_token_id)[1] == 16 * 16 + 1


def test_ernie_4_5_vl_has_its_published_shapes():
    """ERNIE-4.5-VL-28B-A3B: text experts (decode's) and narrower vision experts in every MoE layer; a 448 px
    picture is 32 x 32 patches merged 2 x 2, and its tokens with their start/end markers are the vision set's."""
    processor = synthetic_processor("ernie-4.5-vl-28b-a3b")
    config = synthetic_config("ernie-4.5-vl-28b-a3b", processor.tokenizer)
    adapter = adapter_for(config.model_type)
    text, vision = adapter.moe_shape(config), adapter.expert_set_shape(config, "vision")
    assert (text.num_experts, text.top_k, text.hidden, text.inter) == (64, 6, 2560, 1536)
    assert vision.inter == 512 and text.moe_layers == vision.moe_layers == tuple(range(1, 28))
    meta = _build_on_meta(adapter, config)
    assert 29.3e9 < sum(p.numel() for p in meta.parameters()) < 29.8e9  # 29.4B published, + the untied head
    assert routed_expert_bytes(config) == 27 * 64 * 3 * 2560 * 1536 * 2  # 40.8 GB of text experts in BF16
    request = make_request(processor, 448, "cpu")
    assert count_tokens(request, config.image_token_id)[1] == 16 * 16
    assert int(request["moe_mm_token_type_ids"].sum()) == 16 * 16 + 2  # and the image's start and end markers


def test_llama_4_scout_has_its_published_shapes():
    """Llama 4 Scout: every layer MoE with 16 experts of 8192, one a token; 109B parameters; the context we
    serve is its attention chunk; a 448 px picture is a 2 x 2 grid of 336 px tiles and the global one, 144
    visual tokens each; a cut keeps every 4th layer without rotary."""
    processor = synthetic_processor("llama-4-scout")
    config = synthetic_config("llama-4-scout", processor.tokenizer)
    adapter = adapter_for(config.model_type)
    shape = adapter.moe_shape(config)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter, len(shape.moe_layers)) == (16, 1, 5120, 8192, 48)
    assert adapter.context_length(config) == 8192
    meta = _build_on_meta(adapter, config)
    assert 108e9 < sum(p.numel() for p in meta.parameters()) < 110e9
    request = make_request(processor, 448, "cpu")
    assert tuple(request["pixel_values"].shape) == (5, 3, 336, 336)
    assert count_tokens(request, config.image_token_id)[1] == 5 * 144
    cut = synthetic_config("llama-4-scout", processor.tokenizer, layers=16)
    assert routed_expert_bytes(cut) == 16 * 16 * 3 * 5120 * 8192 * 2  # 64.4 GB: the H200 run's cut
    assert cut.text_config.no_rope_layers[:8] == [1, 1, 1, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("name, kwargs, message", [
    ("nope", {}, "unknown synthetic model 'nope'; choose one of qwen3-vl-30b-a3b, deepseek-ocr2, glm-4.5v, ernie-4.5-vl-28b-a3b, llama-4-scout"),
    ("deepseek-ocr2", {"layers": 13}, r"layers must be in \[1, 12\] for deepseek-ocr2"),
    ("qwen3-vl-30b-a3b", {"narrow": True}, "has no narrow variant"),
])
def test_bad_choices_are_clear_errors(processor, name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_config(name, processor.tokenizer, **kwargs)


def test_narrow_deepseek_ocr2_loads_through_its_stock_and_offload_rules():
    """The stock rules keep transformers' modules; the offload file at 30% of the experts pins one layer
    (Eq. 10's smallest depth) and keeps slabs for the rest of 30%: 211 of the 704 experts' bytes. Synthetic
    routing then weighs its top-6 as DeepSeek's router does (softmax over all 64, not renormalised)."""
    stock, _ = load_synthetic("deepseek-ocr2", "optimize_rules/deepseek-ocr2-gpu.yaml", narrow=True, **CPU)
    assert stock.vismmoe.context.offload_runtime is None
    model, processor = load_synthetic("deepseek-ocr2", "optimize_rules/deepseek-ocr2-offload.yaml", narrow=True,
                                      expert_budget="30%", **CPU)
    runtime = model.vismmoe.context.offload_runtime
    assert runtime.pinned == {1} and runtime.num_slabs == int(0.3 * 704) - 64
    source = install_routing(model, "synthetic")
    request = make_request(processor, 448, "cpu")
    source.begin(request["input_ids"], 2)
    sums = source.weights[:request["input_ids"].shape[1] + 2].sum(-1)
    assert source.ids.shape[1:] == (11, 6) and bool((sums < 1).all()) and bool((sums > 0).all())


def decode_bench(out, monkeypatch, tokens, *configs) -> dict:
    """decode_bench --model deepseek-ocr2 --narrow on the CPU (synthetic routing, its default), in process."""
    import sys

    from benchmarks import decode_bench

    monkeypatch.setattr(sys, "argv", ["decode_bench", "--out", str(out), "--model", "deepseek-ocr2", "--narrow",
                                      "--dtype", "float32", "--device", "cpu", "--image-size", "448", "--reps", "1",
                                      "--decode-tokens", str(tokens), "--configs", *configs])
    assert decode_bench.main() == 0
    result = json.loads((out / "decode_bench.json").read_text())
    assert result["meta"]["family"] == "deepseek_ocr2" and "deepseek-ocr2 shapes" in result["meta"]["model"]
    assert result["meta"]["routing"] == "synthetic"
    return {row["config"]: row for row in result["rows"]}


def test_decode_bench_lru_misses_and_decodes_what_all_resident_does(tmp_path, monkeypatch):
    """Stock transformers with every expert resident against LRU at 30% of the experts: LRU misses (expert
    bytes cross every decode token) and, with features off, decodes the same tokens."""
    rows = decode_bench(tmp_path, monkeypatch, 3, "hf", "lru:expert_budget=30%")
    assert set(rows) == {"hf", "lru:expert_budget=30%"}
    assert rows["hf"]["prompt_tokens"] == rows["lru:expert_budget=30%"]["prompt_tokens"] > 257  # 257 image tokens + the text
    lru = rows["lru:expert_budget=30%"]
    assert lru["rules"] == "optimize_rules/deepseek-ocr2-lru.yaml" and rows["hf"]["rules"] is None
    assert lru["decode_tok_s_median"] > 0 and lru["decode_bytes_per_token"] > 0 and lru["decode_hit_rate"] < 1
    assert lru["pinned_layers"] == 0 and lru["slabs"] == int(0.3 * 704)
    assert lru["tokens_agreeing_with_hf"] == 3


def test_decode_bench_vismmoe_pins_a_prefix_and_misses_beyond_it(tmp_path, monkeypatch):
    rows = decode_bench(tmp_path, monkeypatch, 2, "offload:expert_budget=30%")
    row = rows["offload:expert_budget=30%"]
    assert row["pinned_layers"] == 1 and row["slabs"] == int(0.3 * 704) - 64
    assert row["decode_bytes_per_token"] > 0 and row["decode_hit_rate"] < 1 and row["tokens_agreeing_with_hf"] is None


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "--model 'nope': unknown synthetic model; choose one of qwen3-vl-30b-a3b, deepseek-ocr2"),
    (["--model", "deepseek-ocr2", "--layers", "13"], "--layers must be in 1..12 for deepseek-ocr2"),
    (["--model", "glm-4.5v", "--narrow"], "--narrow: glm-4.5v has no narrow variant"),
])
def test_decode_bench_bad_model_flags_are_clear_errors(args, message, tmp_path, monkeypatch, capsys):
    import sys

    from benchmarks import decode_bench

    monkeypatch.setattr(sys, "argv", ["decode_bench", "--out", str(tmp_path), "--device", "cpu", *args])
    with pytest.raises(SystemExit):
        decode_bench.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("offload:expert_budgt=30%", "--configs offload:expert_budgt=30%: override 'expert_budgt' is not a kwarg of any "
                                 "rule; known kwargs: batch_experts, batch_table_pairs, compression, eviction, expert_budget"),
    ("lru:pinned_layers=2", "override 'pinned_layers' is not a kwarg of any rule"),  # lru pins nothing
    ("lean:30%", "unknown configuration 'lean': hf, a placement (vismmoe, gpu, offload"),
    ("offload:graphs=sometimes", "graphs 'sometimes' is not one of: auto, cuda, replay, off"),
    ("offload:expert_budget", "'expert_budget' is not key=value"),
])
def test_decode_bench_bad_configurations_are_usage_errors_before_anything_loads(spec, message, tmp_path, monkeypatch,
                                                                                capsys):
    """A configuration is checked as `--set` checks its keys, every one before the first loads: a usage
    error (status 2) naming the configuration and the key, no traceback, no row written."""
    with pytest.raises(SystemExit) as exit_:
        decode_bench(tmp_path, monkeypatch, 2, "hf", spec)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "decode_bench.json").exists()

"""Benchmark configurations (`NAME[:key=value,...]`): a placement resolved for the model's family as
`--placement` resolves it, the kwargs read and checked as `--set` reads and checks them."""

import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks.configurations import parse_configuration
from vismmoe_kt.core.placements import placement_rules
from vismmoe_kt.errors import InputError


def test_a_placement_resolves_to_the_family_s_generated_rules_with_the_settings_as_set_reads_them():
    qwen = parse_configuration("offload:expert_budget=16GiB,store_dtype=q4_k,pinned_layers=3,"
                               "prefetch_min_probability=0.5,graphs=off", "qwen3_vl_moe")
    assert qwen.rule_file == "optimize_rules/qwen3vl-offload.yaml" and qwen.rules == placement_rules("qwen3vl", "offload")
    assert qwen.settings == {"expert_budget": "16GiB", "store_dtype": "q4_k", "pinned_layers": 3,
                             "prefetch_min_probability": 0.5, "graphs": False}  # YAML's `off`, as --graphs off
    assert qwen.label == "offload:expert_budget=16GiB,store_dtype=q4_k,pinned_layers=3,prefetch_min_probability=0.5," \
                         "graphs=off" and not qwen.is_reference
    ocr = parse_configuration("lru:expert_budget=30%", "deepseek_ocr2")
    assert ocr.rule_file == "optimize_rules/deepseek-ocr2-lru.yaml" and ocr.rules == placement_rules("deepseek-ocr2", "lru")
    assert ocr.settings == {"expert_budget": "30%"}
    glm = parse_configuration("hybrid", "glm4v_moe")
    assert glm.rule_file == "optimize_rules/glm4v-hybrid.yaml" and glm.settings == {}


def test_hf_and_rule_file_paths():
    hf = parse_configuration("hf", "qwen3_vl_moe")
    assert hf.is_reference and hf.rules is None and hf.rule_file is None and hf.settings == {}
    path = parse_configuration("optimize_rules/glm4v-lru.yaml:expert_budget=8GiB", "qwen3_vl_moe")
    assert path.rules == path.rule_file == "optimize_rules/glm4v-lru.yaml" and path.settings == {"expert_budget": "8GiB"}
    with pytest.raises(InputError, match="no such rule file optimize_rules/nope.yaml"):
        parse_configuration("optimize_rules/nope.yaml", "qwen3_vl_moe")


@pytest.mark.parametrize("spec, message", [
    ("offload:expert_budgt=16GiB", "--configs offload:expert_budgt=16GiB: override 'expert_budgt' is not a kwarg of "
                                   "any rule; known kwargs: batch_experts, batch_table_pairs"),
    ("hf:expert_budget=16GiB", "override 'expert_budget' is not a kwarg of any rule; known kwargs: none"),
    ("kt-cpu:store_dtype=q4_k", "override 'store_dtype' is not a kwarg of any rule"),  # kt-cpu has no host store
    ("gpu", None),
    ("lean:16GiB", "unknown configuration 'lean': hf, a placement (vismmoe, gpu, offload, lru, hybrid, kt-cpu, realb, "
                   "ep) or a rule file's path, then :key=value,... (the old spellings, e.g. lean:16GiB+q4k, and their "
                   "translations: benchmarks/results/README.md)"),
    ("lru:16GiB", "'16GiB' is not key=value (the old spellings"),
    ("offload:expert_budget=16GiB,store_dtype=[", "--configs store_dtype=[: the value is not valid YAML"),
    ("offload:decode=fast", "decode 'fast' is not one of: lean, hf"),
    ("offload:expert_budget=16GiB,", None),  # a trailing comma is no setting
])
def test_bad_keys_are_input_errors_naming_them(spec, message):
    if message is None:
        parse_configuration(spec, "qwen3_vl_moe")
        return
    with pytest.raises(InputError) as error:
        parse_configuration(spec, "qwen3_vl_moe")
    assert message in str(error.value) and str(error.value).startswith(f"--configs {spec}: ")


def test_a_family_without_the_placement_is_an_input_error():
    with pytest.raises(InputError, match="kimi-k25 has no gpu placement"):
        parse_configuration("gpu", "kimi_k25")


def test_kt_kernel_configurations_are_the_ones_whose_cpu_backend_may_be_kt_kernel():
    assert parse_configuration("kt-cpu", "qwen3_vl_moe").uses_kt_kernel()  # cpu_backend auto
    assert not parse_configuration("kt-cpu:cpu_backend=torch", "qwen3_vl_moe").uses_kt_kernel()
    assert not parse_configuration("hybrid", "qwen3_vl_moe").uses_kt_kernel()  # its rule file's torch backend
    assert parse_configuration("hybrid:cpu_backend=kt-kernel,cpu_dtype=int8", "qwen3_vl_moe").uses_kt_kernel()
    assert not parse_configuration("offload", "qwen3_vl_moe").uses_kt_kernel()
    assert not parse_configuration("hf", "qwen3_vl_moe").uses_kt_kernel()


def test_batch_experts_reaches_the_offload_settings_through_the_kwargs(tiny_dir):
    """No assignment on the runtime after load: `batch_experts` is a rule kwarg the configuration sets,
    as `--set batch_experts=...` does for chat and serve."""
    from benchmarks.decode_bench import load_model, runtime_of

    args = SimpleNamespace(device="cpu", tiny_dir=tiny_dir, routing="model", tiny="tiny-4x16")
    for spec, mode, pairs in (("offload:expert_budget=4MiB,batch_experts=expert-major,batch_table_pairs=8",
                               "expert-major", 8), ("offload:expert_budget=4MiB", "auto", 32)):
        model, _ = load_model(args, parse_configuration(spec, "qwen3_vl_moe"))
        settings = runtime_of(model).settings
        assert (settings.batch_experts, settings.batch_table_pairs) == (mode, pairs)
        runtime_of(model).close()


def test_a_bad_configuration_stops_decode_bench_before_the_tiny_model_is_made(tmp_path, monkeypatch, capsys):
    from benchmarks import decode_bench

    monkeypatch.setattr(sys, "argv", ["decode_bench", "--out", str(tmp_path), "--device", "cpu", "--tiny", "tiny-4x16",
                                      "--configs", "hf", "offload:batch_expert=table"])
    monkeypatch.setattr(decode_bench, "save_tiny_model", lambda *a, **k: pytest.fail("the model was made"))
    with pytest.raises(SystemExit) as exit_:
        decode_bench.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "override 'batch_expert' is not a kwarg of any rule" in err
    assert "Traceback" not in err


def test_a_text_prompt_is_the_longest_that_fits_and_has_no_picture():
    """`decode_bench --text_tokens N`: a text-only prompt of at most N tokens, one more word over N (what
    llama.cpp's pp N compares with), seeded: the same every run."""
    from benchmarks.bench.inputs import text_request
    from vismmoe_kt.demo.tiny import build_tiny_model

    _, processor = build_tiny_model("tiny-4x16", seed=0)
    for tokens in (64, 200):
        request = text_request(processor, tokens, "cpu")
        length = request["input_ids"].shape[1]
        assert tokens - 8 <= length <= tokens and "pixel_values" not in request
        assert torch.equal(text_request(processor, tokens, "cpu")["input_ids"], request["input_ids"])
    with pytest.raises(ValueError, match="the chat template alone takes more"):
        text_request(processor, 3, "cpu")


def test_a_text_prompt_goes_with_single_requests_only(tmp_path, monkeypatch, capsys):
    from benchmarks import decode_bench

    monkeypatch.setattr(sys, "argv", ["decode_bench", "--out", str(tmp_path), "--device", "cpu", "--tiny", "tiny-4x16",
                                      "--configs", "hf", "--text_tokens", "64", "--concurrency", "1", "4"])
    monkeypatch.setattr(decode_bench, "save_tiny_model", lambda *a, **k: pytest.fail("the model was made"))
    with pytest.raises(SystemExit) as exit_:
        decode_bench.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--text_tokens must be a count >= 0, and goes with batch-1 requests only" in err

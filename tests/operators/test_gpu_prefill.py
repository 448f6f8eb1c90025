"""KTransformers' dual prefill on the KTransformers-style rule: a prompt of at least `gpu_prefill_tokens`
tokens runs each layer's experts from a host copy on the model's device (all of them, or a share while
the CPU backend computes the rest); shorter calls, decode among them, stay on the CPU."""

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.errors import RuleError
from vismmoe_kt.runtime.layerwise_prefill import LayerwisePrefill, resolve_format

from conftest import tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
KT_CPU = "optimize_rules/qwen3vl-kt-cpu.yaml"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_case(tmp_path_factory, "tiny-4x16", 0, "Describe the image.", (150, 100), 0)


def logits_and_stats(model_dir, inputs, **overrides):
    model, _ = load(model_dir, KT_CPU, cpu_backend="torch", **overrides, **CPU)
    with torch.no_grad():
        logits = model(**inputs).logits
    return logits, collect_stats(model)["operators"]["CpuExperts"], model


def test_model_format_is_the_cpu_rules_arithmetic(case):
    """With the model's own dtype as the host copy, every layer's experts of the prompt run through the
    layerwise path and give the reference's logits."""
    model_dir, ref, inputs = case
    with torch.no_grad():
        expected = ref(**inputs).logits
    tokens = inputs["input_ids"].shape[1]
    logits, stats, _ = logits_and_stats(model_dir, inputs, gpu_prefill_tokens=tokens, gpu_prefill_format="model")
    assert (logits - expected).abs().max().item() <= 1e-5
    layers = SPECS["tiny-4x16"].layers
    assert stats["gpu_prefill_layers"] == layers and stats["gpu_prefill_prefills"] == 1
    assert stats["gpu_prefill_gpu_experts"] == layers * SPECS["tiny-4x16"].experts
    assert stats["calls"] == 0  # the CPU backend computed nothing


def test_below_the_threshold_the_cpu_computes(case):
    model_dir, _, inputs = case
    tokens = inputs["input_ids"].shape[1]
    _, stats, _ = logits_and_stats(model_dir, inputs, gpu_prefill_tokens=tokens + 1, gpu_prefill_format="model")
    assert stats["gpu_prefill_layers"] == 0 and stats["calls"] == SPECS["tiny-4x16"].layers


def test_a_share_splits_each_layer_between_the_copy_and_the_cpu(case):
    model_dir, ref, inputs = case
    with torch.no_grad():
        expected = ref(**inputs).logits
    logits, stats, _ = logits_and_stats(model_dir, inputs, gpu_prefill_tokens=2, gpu_prefill_format="model",
                                        gpu_prefill_share=0.25)
    assert (logits - expected).abs().max().item() <= 1e-5
    layers, experts = SPECS["tiny-4x16"].layers, SPECS["tiny-4x16"].experts
    assert stats["gpu_prefill_gpu_experts"] == layers * experts // 4
    assert stats["gpu_prefill_cpu_experts"] == layers * experts * 3 // 4
    assert stats["gpu_prefill_cpu_seconds"] > 0


def test_decode_stays_on_the_cpu(case):
    from vismmoe_kt.engine.generation import generate

    model_dir, ref, inputs = case
    model, _ = load(model_dir, KT_CPU, cpu_backend="torch", gpu_prefill_tokens=2, gpu_prefill_format="model", **CPU)
    with torch.no_grad():
        tokens = generate(model, dict(inputs), 6, min_new_tokens=6)
        expected = ref.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected)
    stats = collect_stats(model)["operators"]["CpuExperts"]
    layers = SPECS["tiny-4x16"].layers
    assert stats["gpu_prefill_layers"] == layers  # the prompt
    assert stats["calls"] == 5 * layers and stats["tokens"] == 5 * layers  # five decode steps of one token


def test_quantized_copy_is_the_dequantized_weights_arithmetic(tmp_path_factory):
    """tiny-2x8's widths take Q4_K (`auto`): the prompt's experts are the dequantized Q4_K weights' (a
    model whose experts are those gives the same logits), near the reference's but not equal to them."""
    model_dir, ref, inputs = tiny_case(tmp_path_factory, "tiny-2x8", 0, "What is this?", (96, 64), 1)
    with torch.no_grad():
        expected = ref(**inputs).logits
    logits, stats, model = logits_and_stats(model_dir, inputs, gpu_prefill_tokens=2)
    assert model.vismmoe.context.gpu_prefill.fmt == "q4_k" and stats["gpu_prefill_layers"] == 2
    store = model.vismmoe.context.gpu_prefill.store
    for layer, block in enumerate(ref.model.language_model.layers):  # the reference, on Q4_K's weights
        gate_up, down = store.dequantized(store.layers[layer], layer)
        experts = block.mlp.experts
        experts.gate_up_proj.data.copy_(gate_up.transpose(1, 2) if experts.gate_up_proj.shape != gate_up.shape
                                        else gate_up)
        experts.down_proj.data.copy_(down.transpose(1, 2) if experts.down_proj.shape != down.shape else down)
    with torch.no_grad():
        on_quantized = ref(**inputs).logits
    assert (logits - on_quantized).abs().max().item() <= 1e-4
    error = ((logits - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.3  # 4.5 bits a weight on a random tiny model: 0.13 here


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_copy_computes_in_the_models_dtype(case, dtype):
    """The bank and its GEMMs take the dtype the model computes in (the checkpoint's, or `dtype`'s), not
    the float32 of the meta-device module the rule replaced: a BF16 model's prefill once ran its
    experts in float32, off torch's BF16 grouped GEMM and with a host sync a layer."""
    model_dir, _, inputs = case
    overrides = {"dtype": dtype} if dtype else {}
    logits, stats, model = logits_and_stats(model_dir, inputs, gpu_prefill_tokens=2, gpu_prefill_format="model",
                                            **overrides)
    computes_in = next(model.model.language_model.embed_tokens.parameters()).dtype
    assert computes_in == (torch.bfloat16 if dtype else torch.float32)
    assert model.vismmoe.context.gpu_prefill.dtype == computes_in
    assert stats["gpu_prefill_layers"] == SPECS["tiny-4x16"].layers and torch.isfinite(logits).all()


def test_activations_in_another_dtype_are_named():
    prefill = LayerwisePrefill(4, 64, 32, torch.float32, torch.device("cpu"), "model", 8)
    prefill.fill_layer(0, torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    with pytest.raises(ValueError, match="torch.bfloat16 activations.*torch.float32"):
        prefill.run(0, torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 1, dtype=torch.long),
                    torch.ones(8, 1), torch.nn.functional.silu)


def test_formats_and_bad_kwargs_are_named():
    assert resolve_format("auto", 2048, 768) == "q4_k"
    assert resolve_format("auto", 96, 64) == "q8_0"
    assert resolve_format("auto", 64, 48) == "model"
    with pytest.raises(ValueError, match="gpu_prefill_format q4_k: .*multiple of 256.*hidden 64"):
        resolve_format("q4_k", 64, 48)
    with pytest.raises(ValueError, match="gpu_prefill_format 'int3' is not one of"):
        resolve_format("int3", 64, 48)
    prefill = LayerwisePrefill(4, 64, 32, torch.float32, torch.device("cpu"), "model", 8)
    with pytest.raises(RuntimeError, match="layer 3 has no experts"):
        prefill.run(3, torch.zeros(8, 64), torch.zeros(8, 1, dtype=torch.long), torch.ones(8, 1), torch.nn.functional.silu)


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_prefill_tokens": -1}, "gpu_prefill_tokens must be 0 \\(off\\) or a token count"),
    ({"gpu_prefill_share": 0}, "gpu_prefill_share must be in \\(0, 1\\] or auto"),
    ({"gpu_prefill_share": "half"}, "gpu_prefill_share must be in \\(0, 1\\] or auto"),
    ({"gpu_prefill_format": "int3"}, "gpu_prefill_format 'int3' is not one of"),
])
def test_bad_rule_kwargs_are_clear_errors(case, kwargs, message):
    model_dir, _, _ = case
    with pytest.raises(RuleError, match=message):
        load(model_dir, KT_CPU, cpu_backend="torch", **kwargs, **CPU)

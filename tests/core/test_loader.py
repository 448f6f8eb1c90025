"""vismmoe_kt.load: round trip of saved tiny models, checkpoint layouts, overrides, and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vismmoe_kt import load
from vismmoe_kt.errors import LoadError, RuleError
from vismmoe_kt.operators.cpu_experts import CpuExperts
from vismmoe_kt.operators.vis_experts import VisExperts
from vismmoe_kt.demo.tiny import SPECS, TinySpec, build_tiny_model, save_tiny_model

CPU = {"generate_device": "cpu", "prefill_device": "cpu"}
RULES = "optimize_rules/qwen3vl-kt-cpu.yaml"


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def assert_same_logits(model, ref, inputs):
    """The reference tolerance for fp32 on CPU (docs/design.md "Testing and measuring")."""
    assert (logits(model, inputs) - logits(ref, inputs)).abs().max().item() <= 1e-5


def copy_model_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_round_trip_gives_the_reference_logits(tiny_dir, reference, image_inputs):
    model, processor = load(tiny_dir, None, progress=False, **CPU)
    assert_same_logits(model, reference[0], image_inputs)
    assert type(processor).__name__ == "Qwen3VLImageTextProcessor"
    assert model.dtype == torch.float32  # the checkpoint's dtype is kept
    assert not any(p.is_meta for p in model.parameters())
    assert model.vismmoe.plan[""]["kwargs"]["generate_device"] == "cpu"


def test_rule_file_operators_are_loaded_with_weights(tiny_dir, reference, image_inputs):
    model, _ = load(tiny_dir, RULES, progress=False, **CPU)
    experts = [m for m in model.modules() if isinstance(m, CpuExperts)]
    assert len(experts) == SPECS["tiny-4x16"].layers
    assert all(m.layer in m.backend.layers for m in experts)  # the weights went to the CPU backend
    assert_same_logits(model, reference[0], image_inputs)


def test_sharded_checkpoint_loads(tmp_path, reference, image_inputs):
    model_dir = save_tiny_model(tmp_path / "sharded", "tiny-4x16", seed=0, max_shard_size="200KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 1 and (model_dir / "model.safetensors.index.json").exists()
    model, _ = load(model_dir, None, progress=False, **CPU)
    assert_same_logits(model, reference[0], image_inputs)


def test_hub_layout_with_transposed_experts_loads(tmp_path, tiny_dir, reference, image_inputs):
    """Hub checkpoints store fused experts as (E, H, 2I) and (E, I, H); transformers transposes them on load."""
    model_dir = copy_model_dir(tiny_dir, tmp_path / "hub")
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    model, _ = load(model_dir, None, progress=False, **CPU)
    assert_same_logits(model, reference[0], image_inputs)


def test_dtype_flag_converts_weights(tiny_dir, image_inputs):
    model, _ = load(tiny_dir, None, dtype="bfloat16", progress=False, **CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = model.generate(**image_inputs, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == image_inputs["input_ids"].shape[1] + 2


def test_tied_embeddings_are_loaded_once(tmp_path, image_inputs):
    spec = TinySpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=24, tie_embeddings=True)
    model_dir = save_tiny_model(tmp_path / "tied", spec, seed=3)
    ref, _ = build_tiny_model(spec, seed=3)
    model, _ = load(model_dir, None, progress=False, **CPU)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert_same_logits(model, ref, image_inputs)


def test_overrides_replace_rule_kwargs(tiny_dir):
    offload = "optimize_rules/qwen3vl-offload.yaml"
    model, _ = load(tiny_dir, offload, progress=False, pinned_layers=2, **CPU)
    runtime = next(m for m in model.modules() if isinstance(m, VisExperts)).runtime
    assert len(runtime.pinned) == 2  # the override replaced the rule's "auto"
    with pytest.raises(RuleError, match=r"override 'pinned_layer' is not a kwarg of any rule; known kwargs: batch_experts, batch_table_pairs, compression, eviction, expert_budget, pinned_layers"):
        load(tiny_dir, offload, progress=False, pinned_layer=2, **CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_rules_without_cuda_say_what_to_do(tiny_dir):
    with pytest.raises(LoadError, match=r"places modules on cuda:0 but this machine has no CUDA device; pass --generate_device cpu"):
        load(tiny_dir, RULES, progress=False)


def test_missing_directory():
    with pytest.raises(LoadError, match="model path /no/such/model does not exist"):
        load("/no/such/model", None)


def test_directory_without_config(tmp_path):
    with pytest.raises(LoadError, match="no config.json"):
        load(tmp_path, None)


def test_unsupported_architecture_lists_supported_ones(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "llama"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"unsupported architecture model_type='llama'; supported: deepseek_ocr2, ernie4_5_vl_moe, glm4v_moe, kimi_k25, llama4, qwen3_vl_moe"):
        load(model_dir, None)


def test_missing_shard_is_named(tmp_path):
    model_dir = save_tiny_model(tmp_path / "sharded", "tiny-4x16", seed=0, max_shard_size="200KB")
    victim = sorted(model_dir.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(LoadError, match=f"shards listed in model.safetensors.index.json are missing: {victim.name}"):
        load(model_dir, None, **CPU)


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "holes")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.language_model.layers.2.mlp.gate.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"checkpoint has no tensor 'model.language_model.layers.2.mlp.gate.weight'"):
        load(model_dir, None, **CPU)


def test_wrong_shape_is_named(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "shape")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.language_model.norm.weight"] = torch.ones(7)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"'model.language_model.norm.weight' has shape \(7,\), the model config wants \(64,\)"):
        load(model_dir, None, **CPU)


def test_corrupt_checkpoint_file(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "corrupt")
    (model_dir / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(LoadError, match="not a readable safetensors file"):
        load(model_dir, None, **CPU)


def test_no_checkpoint_at_all(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "empty")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no safetensors checkpoint"):
        load(model_dir, None, **CPU)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_integer_dtype_in_the_config_is_named(tmp_path, tiny_dir, key):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "int8")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("dtype", None)
    config[key] = "int8"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"config\.json: dtype int8 is not a floating-point type; vismmoe-kt loads float models"):
        load(model_dir, None, **CPU)


def test_config_dtype_that_is_no_dtype_is_named(tmp_path, tiny_dir):
    model_dir = copy_model_dir(tiny_dir, tmp_path / "banana")
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "banana"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"config\.json: dtype 'banana' is not a torch dtype"):
        load(model_dir, None, **CPU)


def test_integer_tensor_where_a_float_weight_belongs_is_named(tmp_path, tiny_dir):
    """Stored int8 would load into the Parameter without complaint and compute nonsense (or fail in the forward)."""
    model_dir = copy_model_dir(tiny_dir, tmp_path / "int-tensor")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.language_model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"model\.safetensors: tensor 'model.language_model.norm.weight' is int8, "
                                        r"not a floating-point type"):
        load(model_dir, None, progress=False, **CPU)


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_a_bad_cpu_worker_count_is_a_clear_error(tiny_dir, value):
    with pytest.raises(LoadError, match=r"cpu_infer must be a whole number of threads >= 1, got"):
        load(tiny_dir, RULES, cpu_infer=value, generate_device="cpu", prefill_device="cpu", progress=False)


def test_the_cpu_worker_count_reaches_the_model_context(tiny_dir):
    before = torch.get_num_threads()
    model, _ = load(tiny_dir, RULES, cpu_infer=3, generate_device="cpu", prefill_device="cpu", progress=False)
    assert model.vismmoe.context.cpu_threads == 3 and model.vismmoe.context.model_device == "cpu"
    assert torch.get_num_threads() == before  # a CPU model keeps torch's threads (it computes with them)


def test_the_public_stats_function_works_every_time(tiny_dir):
    """#26: `vismmoe_kt.stats` once failed on its second call, the `stats` submodule having replaced the
    function on the package. The statistics live in `vismmoe_kt.core.stats`, so importing that module
    leaves the package's function in place."""
    import vismmoe_kt
    import vismmoe_kt.core.stats  # noqa: F401  (what the chat, the server and eval import)

    model, _ = load(tiny_dir, RULES, progress=False, **CPU)
    first, second = vismmoe_kt.stats(model), vismmoe_kt.stats(model)
    assert callable(vismmoe_kt.stats) and first["rules"] == second["rules"] == RULES
    assert second["operators"]["CpuExperts"]["count"] == SPECS["tiny-4x16"].layers

"""ERNIE-4.5-VL (transformers ernie4_5_vl_moe): what only it has. Each MoE layer holds two expert sets
chosen per token by modality (text experts for text tokens and decode, smaller vision experts for image
tokens); the original checkpoint keeps both in one per-expert list with transposed routers and stacked
correction biases. Equality with the transformers reference under every rule file: test_families.py and
test_family_operators.py, over every family."""

import pytest
import torch
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS, build_tiny_model, save_tiny_model
from vismmoe_kt.errors import RuleError
from vismmoe_kt.models import adapter_for
from vismmoe_kt.models.base import VISION_SET
from vismmoe_kt.core.stats import collect_stats

from conftest import tiny_case

NAME = "tiny-ernie-4x16"
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 6


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, ref, inputs = tiny_case(tmp_path_factory, NAME, 1, "What is in the picture?", (160, 128), 2)
    with torch.no_grad():
        expected = ref.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return model_dir, ref, inputs, expected


def test_two_expert_sets_and_the_modality_ids(case):
    """The text experts are the primary set (decode's); the vision set is named, narrower, and the image
    tokens with their start/end markers are the rows the processor marks for it."""
    _, ref, inputs, _ = case
    adapter, spec = adapter_for(ref.config.model_type), SPECS[NAME]
    assert adapter.position_rows() == 3
    assert adapter.experts_key(1).endswith(".text_moe.experts") and adapter.expert_set(adapter.experts_key(1)) is None
    assert adapter.expert_set("model.language_model.layers.1.mlp.vision_moe.experts") == VISION_SET
    primary, vision = adapter.moe_shape(ref.config), adapter.expert_set_shape(ref.config, VISION_SET)
    assert primary.inter == spec.moe_intermediate and vision.inter == spec.moe_intermediate // 3
    assert vision.moe_layers == primary.moe_layers and vision.num_experts == primary.num_experts
    with pytest.raises(ValueError, match="no expert set 'audio'"):
        adapter.expert_set_shape(ref.config, "audio")
    ids, modality = inputs["input_ids"][0], inputs[adapter.modality_argument()][0]
    image = ids == ref.config.image_token_id
    markers = (ids == ref.config.image_start_token_id) | (ids == ref.config.image_end_token_id)
    assert image.any() and torch.equal(modality.bool(), image | markers)
    layer = ref.model.language_model.layers[1]
    assert adapter.router(layer) is layer.mlp.text_moe.gate and adapter.visual_router(layer) is layer.mlp.vision_moe.gate


def test_original_checkpoint_layout_is_mapped(case):
    """Both sets in one per-expert list (vision after text), routers stored transposed (`weight_1` the
    vision one), the two correction biases one (2, E) tensor: the loader rebuilds transformers' layout."""
    model_dir, ref, _, _ = case
    experts = SPECS[NAME].experts
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        router = f.get_tensor("model.layers.1.mlp.gate.weight_1")
        biases = f.get_tensor("model.layers.1.mlp.moe_statics.e_score_correction_bias")
    assert f"model.layers.1.mlp.experts.{2 * experts - 1}.down_proj.weight" in names
    assert not any(".text_moe." in n or ".vision_moe." in n or "language_model" in n for n in names)
    assert router.shape == (SPECS[NAME].hidden, experts) and biases.shape == (2, experts)
    model, _ = load(model_dir, None, **CPU)
    got, want = model.model.language_model.layers[1].mlp, ref.model.language_model.layers[1].mlp
    for block in ("text_moe", "vision_moe"):
        for tensor in ("experts.gate_up_proj", "experts.down_proj", "gate.weight", "gate.moe_statics.e_score_correction_bias"):
            mine, theirs = got.get_submodule(block).get_parameter(tensor), want.get_submodule(block).get_parameter(tensor)
            assert torch.equal(mine, theirs), f"{block}.{tensor}"
    text_bias, vision_bias = (want.get_submodule(b).gate.moe_statics.e_score_correction_bias for b in ("text_moe", "vision_moe"))
    assert not torch.equal(text_bias, vision_bias)  # each set got its own row


def test_vision_experts_stream_in_the_prefill_and_never_in_decode(case, tmp_path):
    """The offload rule gives the vision experts a runtime of their own: an image prompt streams them
    through a budget of one layer's slabs while decode (text tokens only) never reads them, and the text
    experts' runtime sees none of their traffic; a text-only prompt does not touch them at all. Greedy
    tokens stay the reference's."""
    model_dir, ref, inputs, expected = case
    spec = SPECS[NAME]
    vision_layer = spec.experts * 3 * (spec.moe_intermediate // 3) * spec.hidden * 4  # fp32
    rules = tmp_path / "offload.yaml"
    shipped = open("optimize_rules/ernie45vl-offload.yaml").read()
    assert 'expert_budget: "2GiB"' in shipped
    rules.write_text(shipped.replace('expert_budget: "2GiB"', f"expert_budget: {vision_layer}"))
    model, _ = load(model_dir, str(rules), **CPU)
    context = model.vismmoe.context
    assert context.expert_set_runtimes[VISION_SET] is not context.offload_runtime
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    assert torch.equal(tokens, expected)
    stats = collect_stats(model)["operators"]
    text, vision = stats["VisExperts"], stats["VisionExperts"]
    assert text["count"] == vision["count"] == 3 and vision["pinned_layers"] == 0
    assert vision["prefill_misses"] > 0 and vision["bytes_copied_prefill"] > 0 and vision["prefill_evictions"] > 0
    assert vision["decode_hits"] == vision["decode_misses"] == vision["bytes_copied_decode"] == 0
    assert text["bytes_copied"] == 0  # the text experts' 24 GiB holds them all: nothing of the vision set's moves there

    processor = build_tiny_model(NAME, seed=1)[1]
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                           add_generation_prompt=True, tokenize=False)
    text_only = processor(text=[prompt], return_tensors="pt")
    model, _ = load(model_dir, str(rules), **CPU)
    with torch.no_grad():
        tokens = model.generate(**text_only, max_new_tokens=TOKENS, do_sample=False)
        assert torch.equal(tokens, ref.generate(**text_only, max_new_tokens=TOKENS, do_sample=False))
    vision = collect_stats(model)["operators"]["VisionExperts"]
    assert vision["prefill_hits"] == vision["prefill_misses"] == vision["bytes_copied"] == 0


def test_a_vision_rule_on_the_text_experts_is_refused(case, tmp_path):
    model_dir = case[0]
    rules = tmp_path / "wrong.yaml"
    rules.write_text(
        "- match:\n    name: \"^model\\\\.language_model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.text_moe\\\\.experts$\"\n"
        "  replace:\n    class: vismmoe_kt.operators.vis_experts.VisionExperts\n"
        "    kwargs: {generate_device: cpu, prefill_device: cpu}\n  recursive: False\n"
        "- match:\n    name: \".*\"\n  replace:\n    class: default\n"
        "    kwargs: {generate_device: cpu, prefill_device: cpu}\n")
    with pytest.raises(RuleError, match=r"text_moe\.experts holds the primary experts of its layer: match it with VisExperts"):
        load(model_dir, str(rules), **CPU)


def test_saved_tiny_model_is_reproducible(tmp_path):
    """The same seed writes the same checkpoint (the shared suites' references rely on it)."""
    a, b = save_tiny_model(tmp_path / "a", NAME, seed=3), save_tiny_model(tmp_path / "b", NAME, seed=3)
    with safe_open(str(a / "model.safetensors"), framework="pt") as fa, safe_open(str(b / "model.safetensors"), framework="pt") as fb:
        name = "model.layers.2.mlp.experts.20.up_proj.weight"
        assert torch.equal(fa.get_tensor(name), fb.get_tensor(name))

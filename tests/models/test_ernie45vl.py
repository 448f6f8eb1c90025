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
from vismmoe_kt.engine.generation import generate
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


@pytest.mark.parametrize("together", [1, 2])
def test_the_runner_begins_each_expert_sets_runtime_with_the_tokens_its_routers_see(case, tmp_path, together):
    """Through the engine (a prompt alone, and two prefilled together): the text experts' runtime is begun with the
    tokens of text modality, padding included, and the vision experts' runtime with the image tokens (counted
    together, a prompt of few text tokens streamed a layer of text experts its routers barely used); the vision
    experts' first offloaded layer has its slabs when the vision tower starts; greedy tokens are the reference's."""
    from vismmoe_kt.engine.inputs import build_inputs, user_turn
    from vismmoe_kt.engine.runner import BatchRequest, ModelRunner
    from vismmoe_kt.engine.sampling import Sampling
    from conftest import make_image

    model_dir, ref, inputs, _ = case
    spec = SPECS[NAME]
    vision_layer = spec.experts * 3 * (spec.moe_intermediate // 3) * spec.hidden * 4  # fp32
    rules = tmp_path / "offload.yaml"
    rules.write_text(open("optimize_rules/ernie45vl-offload.yaml").read().replace(
        'expert_budget: "2GiB"', f"expert_budget: {2 * vision_layer}"))
    model, processor = load(model_dir, str(rules), **CPU)
    context = model.vismmoe.context
    text, vision = context.offload_runtime, context.expert_set_runtimes[VISION_SET]
    begun = {"text": [], "vision": []}
    for name, runtime in (("text", text), ("vision", vision)):
        real = runtime.begin_prompt
        runtime.begin_prompt = lambda tokens, name=name, real=real: (begun[name].append(tokens), real(tokens))[1]
    first = vision.offloaded_layers()[0]
    seen = []
    adapter_for(model.config.model_type).vision_tower(model).register_forward_pre_hook(lambda *_: seen.append(
        {e for layer, e in vision.residency.cache.where if layer == first}))
    prompts = [build_inputs(processor, [user_turn(question, 1)], [make_image(*size, seed=seed)])
               for question, size, seed in (("What is in the picture?", (160, 128), 1), ("Two?", (128, 128), 3))]
    runner = ModelRunner(model, max_batch=together, capacity=512, max_queue=2)
    requests = [BatchRequest(p, TOKENS, Sampling(), min_new_tokens=TOKENS) for p in prompts]
    for request in requests:
        runner.add(request)
    with torch.no_grad():
        while not runner.idle:
            runner.step()
    kinds = [p["moe_mm_token_type_ids"][0] for p in prompts]
    images = [int((k != 0).sum()) for k in kinds]
    if together == 2:  # one forward, right-padded to the longer prompt: the padding is text
        width = max(len(k) for k in kinds)
        assert begun == {"text": [2 * width - sum(images)], "vision": [sum(images)]}
    else:
        assert begun == {"text": [len(k) - n for k, n in zip(kinds, images)], "vision": images}
    assert all(n > 0 for n in begun["vision"])  # picture prompts: the vision runtime is begun with their image tokens
    assert seen and seen[0] == set(range(spec.experts))
    with torch.no_grad():
        for prompt, request in zip(prompts, requests):
            want = ref.generate(**prompt, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
            assert request.sequence.generated == want[0, prompt["input_ids"].shape[1]:].tolist()


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


@pytest.mark.parametrize("decode", ["lean", "hf"])
def test_synthetic_routing_reaches_the_text_experts_at_the_text_positions(case, monkeypatch, decode):
    """The text router sees only the text tokens of an image prompt: `--routing synthetic` gives each of
    them its own position's row of the table (not the first rows in order), and decode steps the rows
    after the prompt. The vision experts keep the model's own routing."""
    from vismmoe_kt.operators.source_router import install_routing
    from vismmoe_kt.runtime.offload import OffloadRuntime

    model_dir, ref, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/ernie45vl-offload.yaml", decode=decode, graphs="off", **CPU)
    text_runtime = model.vismmoe.context.offload_runtime
    seen, original = [], OffloadRuntime.run_layer

    def spy(self, layer, hidden, top_k_index, top_k_weights, act):
        if self is text_runtime:
            seen.append((layer, top_k_index.detach().clone()))
        return original(self, layer, hidden, top_k_index, top_k_weights, act)
    monkeypatch.setattr(OffloadRuntime, "run_layer", spy)
    source = install_routing(model, "synthetic:5")
    with torch.no_grad():
        generate(model, inputs, TOKENS)
    table = source.history[0]["ids"]
    modality = inputs[adapter_for(ref.config.model_type).modality_argument()][0]
    text_positions = torch.nonzero(modality == 0, as_tuple=True)[0]
    prompt = modality.numel()
    assert 0 < text_positions.numel() < prompt
    prefill = [(layer, rows) for layer, rows in seen if rows.shape[0] > 1]
    steps = [(layer, rows) for layer, rows in seen if rows.shape[0] == 1]
    assert len(prefill) == 3 and len(steps) == 3 * (TOKENS - 1)
    for index, (layer, rows) in enumerate(prefill):
        assert torch.equal(rows, table[text_positions, index])
    for step, (layer, rows) in enumerate(steps):
        assert torch.equal(rows[0], table[prompt + step // 3, step % 3])


def test_synthetic_routing_under_batching_gives_each_request_its_tokens_alone(case):
    """Prompts prefilled together (right-padded, one forward): the text router's rows are the text tokens
    of every prompt, each mapped to its own slot's table."""
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.engine.inputs import build_inputs, user_turn
    from vismmoe_kt.operators.source_router import install_routing

    from conftest import make_image

    model_dir = case[0]
    model, processor = load(model_dir, "optimize_rules/ernie45vl-offload.yaml", graphs="off", **CPU)
    routing = install_routing(model, "synthetic:3")
    # in this order no request alone reuses a cached prefix of the one before (another image, or a held
    # image the next prompt lacks), which the table of an earlier request would have routed
    requests = [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)]),
                build_inputs(processor, [user_turn("Two shapes?", 1)], [make_image(96, 64, seed=3)]),
                build_inputs(processor, [user_turn("Hello there", 0)], [])]
    budgets = [6, 5, 4]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        routing.requests, stats = 0, {}  # the same seeds again, in the same order
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=3,
                                  min_new_tokens=max(budgets), stats=stats)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert (stats["prefill_groups"], stats["grouped_prompts"]) == (1, 3)

"""GLM-4.5V (transformers glm4v_moe), the second family: its adapter finds the parts (shared experts
too), the loader assembles the fused experts from the per-expert tensors `save_pretrained` writes and
reads the router's correction bias, and with our features off the injected model gives the
transformers fp32 reference's logits (max abs diff <= 1e-5) and greedy tokens: transformers' decode
loop, the lean decode step (shared experts in its attention piece), and expert offloading at a budget
that misses."""

import pytest
import torch
import yaml
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.models import adapter_for

from conftest import layer_bytes, tiny_case

NAME = "tiny-glm-4x16"
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, ref, inputs = tiny_case(tmp_path_factory, NAME, 1, "What is in the picture?", (160, 128), 2)
    with torch.no_grad():
        expected = (ref(**inputs).logits, ref.generate(**inputs, max_new_tokens=TOKENS, do_sample=False))
    return model_dir, ref, inputs, expected


def test_structure_of_the_tiny_model(case):
    _, ref, inputs, _ = case
    adapter = adapter_for(ref.config.model_type)
    spec = SPECS[NAME]
    layers = adapter.decoder_layers(ref)
    assert adapter.moe_layers_from_config(ref.config) == [1, 2, 3]  # layer 0 is dense
    assert [i for i, layer in enumerate(layers) if adapter.experts(layer) is not None] == [1, 2, 3]
    assert adapter.shared_experts(layers[0]) is None and adapter.router(layers[0]) is None
    layer = layers[1]
    assert adapter.router(layer) is layer.mlp.gate and adapter.shared_experts(layer) is layer.mlp.shared_experts
    assert adapter.experts(layer).gate_up_proj.shape == (spec.experts, 2 * spec.moe_intermediate, spec.hidden)
    shape = adapter.moe_shape(ref.config)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter) == (spec.experts, spec.top_k, spec.hidden,
                                                                             spec.moe_intermediate)
    mask = adapter.image_token_mask(ref.config, inputs["input_ids"])
    assert int(mask.sum()) == int(inputs["image_grid_thw"][0].prod()) // 4 > 0  # merge 2x2


def test_checkpoint_stores_experts_one_by_one_and_the_loader_fuses_them(case):
    model_dir, ref, _, _ = case
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    prefix = "model.language_model.layers.1.mlp."
    assert f"{prefix}experts.0.gate_proj.weight" in names and f"{prefix}experts.gate_up_proj" not in names
    assert f"{prefix}gate.e_score_correction_bias" in names
    model, _ = load(model_dir, None, **CPU)
    got, want = model.model.language_model.layers[1].mlp, ref.model.language_model.layers[1].mlp
    assert torch.equal(got.experts.gate_up_proj, want.experts.gate_up_proj)
    assert torch.equal(got.experts.down_proj, want.experts.down_proj)
    bias = got.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0 and torch.equal(bias, want.gate.e_score_correction_bias)


def check(model, inputs, expected, lean: bool):
    ref_logits, ref_tokens = expected
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = generate(model, inputs, TOKENS) if lean else model.generate(**inputs, max_new_tokens=TOKENS,
                                                                              do_sample=False)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, ref_tokens)
    assert tokens.shape[1] - inputs["input_ids"].shape[1] == TOKENS  # no early end: every step compared


@pytest.mark.parametrize("decode,graphs", [("hf", "off"), ("lean", "off"), ("lean", "replay")])
def test_lean_rules_match_the_reference(case, decode, graphs):
    model_dir, _, inputs, expected = case
    model, _ = load(model_dir, "optimize_rules/glm4v.yaml", decode=decode, graphs=graphs, **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    if decode == "lean":
        assert model.model.language_model.stats()["decode_steps"] == TOKENS - 1  # the lean step decoded


@pytest.mark.parametrize("decode", ["hf", "lean"])
def test_offloaded_experts_at_a_budget_that_misses_match_the_reference(case, decode):
    model_dir, _, inputs, expected = case
    spec = SPECS[NAME]
    budget = layer_bytes(spec) * 2  # the minimum: one pinned MoE layer and one layer of slabs for two
    model, _ = load(model_dir, "optimize_rules/glm4v-offload.yaml", expert_budget=budget, decode=decode,
                    graphs="off", **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["count"] == 3 and stats["pinned_layers"] == 1
    assert stats["bytes_copied"] > 0 and stats["evictions"] > 0 and stats["decode_misses"] > 0


def test_the_text_model_sees_the_image_tokens(case):
    """Glm4vMoeModel passes its text model no visual mask: the adapter's hooks hand it on, so features
    that treat visual tokens apart (ReaLB's modality, pruning, the predictor's summary) see them."""
    model_dir, ref, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/glm4v.yaml", **CPU)
    with torch.no_grad():
        model(**inputs)
    visual = model.vismmoe.context.token_is_visual
    assert torch.equal(visual, (inputs["input_ids"] == ref.config.image_token_id).reshape(-1))


SALIENCY = {"match": {"name": "^model\\.visual$"},
            "replace": {"class": "vismmoe_kt.operators.vis_decoder.VisionSaliency", "kwargs": {}}}


@pytest.mark.parametrize("compression,source", [("random", "vision"), ("affinity", "vision"), ("affinity", "llm")])
def test_pruned_prefill_decodes_alike_on_both_paths(case, compression, source):
    """Visual tokens pruned after layer 1 (random; affinity by the vision tower's attention or FastV-style
    by the last token's attention in layer 0, GLM's partial-rotary attention without q/k norms): the lean
    path gives the tokens of transformers' loop over the same pruned model."""
    model_dir, _, inputs, _ = case
    rules = yaml.safe_load(open("optimize_rules/glm4v.yaml"))
    rules[0]["replace"]["kwargs"].update(compression=compression, keep_ratio=0.5, prune_layer=1, saliency_source=source)
    if compression == "affinity" and source == "vision":
        rules.insert(0, SALIENCY)
    hf, _ = load(model_dir, rules, decode="hf", **CPU)
    lean, _ = load(model_dir, rules, graphs="off", **CPU)
    with torch.no_grad():
        expected = generate(hf, inputs, TOKENS)
        tokens = generate(lean, inputs, TOKENS)
    for model in (hf, lean):
        counters = model.model.language_model.text_forward.counters
        assert counters.pruned_prefills == 1 and counters.visual_tokens_after < counters.visual_tokens_before
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("rules,layers", [("glm4v", None), ("glm4v-offload", 2)])
def test_batched_greedy_tokens_equal_each_request_alone(case, rules, layers):
    """Batched decode (engine/batched.py: the lean step's pieces over several rows, shared experts
    included) gives each request the tokens it gets alone; prompts of different lengths, with and
    without images, prefilled together."""
    from vismmoe_kt.engine.batched import generate_batch
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    from conftest import make_image

    model_dir = case[0]
    extra = {"expert_budget": layer_bytes(SPECS[NAME]) * layers} if layers else {}
    model, processor = load(model_dir, f"optimize_rules/{rules}.yaml", graphs="off", **extra, **CPU)
    requests = [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)]),
                build_inputs(processor, [user_turn("Hello there", 0)], []),
                build_inputs(processor, [user_turn("Two shapes?", 1)], [make_image(96, 64, seed=3)])]
    budgets = [8, 5, 6]
    with torch.no_grad():
        alone = [generate(model, dict(r), n, min_new_tokens=n) for r, n in zip(requests, budgets)]
        sizes = []
        together = generate_batch(model, [dict(r) for r in requests], budgets, max_batch=3,
                                  min_new_tokens=max(budgets), on_step=sizes.append)
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    assert max(sizes) == 3


def test_last_token_attention_equals_the_eager_attention_weights(case):
    """FastV-style saliency recomputed by the adapter (partial rotary, no q/k norms) equals the attention
    probabilities transformers' eager attention forms in the same layer."""
    _, ref, inputs, _ = case
    adapter = adapter_for(ref.config.model_type)
    attn = adapter.attention(adapter.decoder_layers(ref)[1])
    seen = {}

    def hook(module, args, kwargs, output):
        seen.update(hidden=kwargs["hidden_states"], pe=kwargs["position_embeddings"], weights=output[1])
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    previous = ref.config._attn_implementation
    ref.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            ref(**inputs)
    finally:
        handle.remove()
        ref.set_attn_implementation(previous)
    positions = torch.nonzero(adapter.image_token_mask(ref.config, inputs["input_ids"])[0], as_tuple=True)[0]
    with torch.no_grad():
        got = adapter.last_token_attention(attn, seen["hidden"], seen["pe"], positions)
    want = seen["weights"].mean(dim=1)[0, -1, positions]
    assert torch.allclose(got, want, atol=1e-6)

"""DeepSeek-OCR-2 (transformers deepseek_ocr2), the third family: 1-D RoPE (the engine builds one row
of positions where M-RoPE families get three), a softmax top-k router without renormalisation (run as
the module, not the fused router), shared experts, a dense first layer, and checkpoints in the original
layout (`save_pretrained` writes `model.layers.N`, `model.sam_model`, per-expert tensors), which the
adapter's `checkpoint_name` / `checkpoint_sources` map. With our features off the injected model gives
the transformers fp32 reference's logits (max abs diff <= 1e-5) and greedy tokens: transformers' decode
loop, the lean decode step (graphs off and replayed), and expert offloading at a budget that misses."""

import pytest
import torch
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.models import adapter_for

from conftest import layer_bytes, tiny_case

NAME = "tiny-dsocr2-4x16"
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 8
GLOBAL_TOKENS, TILE_TOKENS = 256, 144  # the vision encoder's learned queries per global view and per tile


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    # wider than a tile (192 px): a global view and local tiles
    model_dir, ref, inputs = tiny_case(tmp_path_factory, NAME, 1, "What is in the picture?", (320, 256), 2)
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
    assert adapter.fused_router(layer.mlp.gate) is None  # no renormalisation: the module routes
    assert adapter.experts(layer).gate_up_proj.shape == (spec.experts, 2 * spec.moe_intermediate, spec.hidden)
    shape = adapter.moe_shape(ref.config)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter) == (spec.experts, spec.top_k, spec.hidden,
                                                                             spec.moe_intermediate)
    assert adapter.position_rows() == 1
    tiles = int(inputs["num_local_patches"][0])
    assert tiles >= 2 and inputs["pixel_values_local"].shape[0] == tiles
    mask = adapter.image_token_mask(ref.config, inputs["input_ids"])
    assert int(mask.sum()) == GLOBAL_TOKENS + TILE_TOKENS * tiles + 1  # + the view separator


def test_checkpoint_keeps_the_original_layout_and_the_loader_maps_it(case):
    model_dir, ref, _, _ = case
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names and "model.sam_model.pos_embed" in names
    assert not any(name.startswith("model.language_model.") for name in names)
    model, _ = load(model_dir, None, **CPU)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_the_processor_takes_text_without_images(case):
    model_dir, _, _, _ = case
    _, processor = load(model_dir, None, **CPU)
    inputs = processor(text=["Hello there"], return_tensors="pt")
    assert inputs["input_ids"].shape == (1, len("Hello there")) and "pixel_values" not in inputs


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
    model, _ = load(model_dir, "optimize_rules/deepseek-ocr2.yaml", decode=decode, graphs=graphs, **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    if decode == "lean":
        assert model.model.language_model.stats()["decode_steps"] == TOKENS - 1  # the lean step decoded


@pytest.mark.parametrize("decode", ["hf", "lean"])
def test_offloaded_experts_at_a_budget_that_misses_match_the_reference(case, decode):
    model_dir, _, inputs, expected = case
    budget = layer_bytes(SPECS[NAME]) * 2  # the minimum: one pinned MoE layer and one layer of slabs for two
    model, _ = load(model_dir, "optimize_rules/deepseek-ocr2-offload.yaml", expert_budget=budget, decode=decode,
                    graphs="off", **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["count"] == 3 and stats["pinned_layers"] == 1
    assert stats["bytes_copied"] > 0 and stats["evictions"] > 0 and stats["decode_misses"] > 0


def test_the_text_model_sees_the_image_tokens(case):
    """DeepseekOcr2Model passes its text model embeddings only: the adapter's hooks hand it the mask."""
    model_dir, ref, inputs, _ = case
    model, _ = load(model_dir, "optimize_rules/deepseek-ocr2.yaml", **CPU)
    with torch.no_grad():
        model(**inputs)
    visual = model.vismmoe.context.token_is_visual
    assert torch.equal(visual, (inputs["input_ids"] == ref.config.image_token_id).reshape(-1))


def test_last_token_attention_equals_the_eager_attention_weights(case):
    """FastV-style saliency recomputed by the adapter (full 1-D rotary, no q/k norms) equals the attention
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


def test_a_held_prefix_is_kept_for_the_same_image_only(case):
    """The lean engine keeps a cached prefix across requests: for DeepSeek-OCR-2's inputs (no per-image
    grids) only when the images are the very same, so the same prompt with another image of the same
    size decodes as a fresh model does, and a next turn over the same image continues the cache."""
    from conftest import make_image

    model_dir, ref, inputs, expected = case
    model, processor = load(model_dir, "optimize_rules/deepseek-ocr2.yaml", graphs="off", **CPU)
    engine_stats = model.model.language_model.stats
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    other = processor(text=[prompt], images=[make_image(320, 256, seed=7)], return_tensors="pt")
    assert torch.equal(other["input_ids"], inputs["input_ids"]) and not torch.equal(other["pixel_values"],
                                                                                       inputs["pixel_values"])
    with torch.no_grad():
        assert torch.equal(generate(model, inputs, TOKENS), expected[1])
        want = ref.generate(**other, max_new_tokens=TOKENS, do_sample=False)
        assert torch.equal(generate(model, other, TOKENS), want)  # not the first image's keys and values
        turn = dict(other, input_ids=torch.cat([want, other["input_ids"][:, -3:]], dim=1))
        turn["attention_mask"] = torch.ones_like(turn["input_ids"])
        want_turn = ref.generate(**turn, max_new_tokens=TOKENS, do_sample=False)
        assert engine_stats()["decode_reused_prefixes"] == 0  # the other image: prefilled whole
        assert torch.equal(generate(model, turn, TOKENS), want_turn)
    stats = engine_stats()
    assert stats["decode_reused_prefixes"] == 1 and stats["decode_reused_tokens"] >= want.shape[1] - 1


@pytest.mark.parametrize("compression", ["random", "affinity"])
def test_pruned_prefill_decodes_alike_on_both_paths(case, compression):
    """Visual tokens pruned after layer 1 (random, or FastV-style by the last token's attention in layer 0:
    the adapter's 1-D rotary attention read): the lean path gives the tokens of transformers' loop over
    the same pruned model (1-D positions sliced with the kept tokens)."""
    import yaml

    model_dir, _, inputs, _ = case
    rules = yaml.safe_load(open("optimize_rules/deepseek-ocr2.yaml"))
    rules[0]["replace"]["kwargs"].update(compression=compression, keep_ratio=0.5, prune_layer=1, saliency_source="llm")
    hf, _ = load(model_dir, rules, decode="hf", **CPU)
    lean, _ = load(model_dir, rules, graphs="off", **CPU)
    with torch.no_grad():
        expected = generate(hf, inputs, TOKENS)
        tokens = generate(lean, inputs, TOKENS)
    for model in (hf, lean):
        counters = model.model.language_model.text_forward.counters
        assert counters.pruned_prefills == 1 and counters.visual_tokens_after < counters.visual_tokens_before
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("rules,layers", [("deepseek-ocr2", None), ("deepseek-ocr2-offload", 2)])
def test_batched_greedy_tokens_equal_each_request_alone(case, rules, layers):
    """Batched decode (engine/batched.py over several rows, one row of 1-D positions each) gives each
    request the tokens it gets alone; prompts of different lengths, with and without images."""
    from vismmoe_kt.engine.batched import generate_batch
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    from conftest import make_image

    model_dir = case[0]
    extra = {"expert_budget": layer_bytes(SPECS[NAME]) * layers} if layers else {}
    model, processor = load(model_dir, f"optimize_rules/{rules}.yaml", graphs="off", **extra, **CPU)
    requests = [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(320, 256, seed=1)]),
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

"""VisDecoder: mid-model visual-token pruning after the pinned prefix."""

import math

import pytest
import torch

from vismmoe_kt import load
from vismmoe_kt.errors import RuleError
from vismmoe_kt.engine.text_forward import causal_mask
from vismmoe_kt.operators.vis_decoder import VisDecoder
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS

from conftest import layer_bytes

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
HYBRID = "optimize_rules/qwen3vl.yaml"


def rules(**decoder):
    kwargs = {"generate_device": "cpu", "prefill_device": "cpu", "compression": "affinity", "keep_ratio": 0.5,
              "prune_layer": 2, **decoder}
    return [
        {"match": {"name": r"^model\.visual$"}, "replace": {"class": "vismmoe_kt.operators.vis_decoder.VisionSaliency"}},
        {"match": {"name": r"^model\.language_model$"},
         "replace": {"class": "vismmoe_kt.operators.vis_decoder.VisDecoder", "kwargs": kwargs}},
    ]


def decoder_of(model):
    return next(m for m in model.modules() if isinstance(m, VisDecoder))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # causal by the kernel's flag, or by our explicit mask
def test_keep_ratio_one_gives_the_reference_exactly(tiny_dir, reference, image_inputs, attention):
    model, _ = load(tiny_dir, rules(keep_ratio=1.0), **CPU)
    decoder_of(model).orig_module.config._attn_implementation = attention
    with torch.no_grad():
        logits, tokens = model(**image_inputs).logits, model.generate(**image_inputs, max_new_tokens=32, do_sample=False)
        ref_logits = reference[0](**image_inputs).logits
        ref_tokens = reference[0].generate(**image_inputs, max_new_tokens=32, do_sample=False)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, ref_tokens)
    assert decoder_of(model).text_forward.counters.pruned_prefills == 0


def test_half_the_visual_tokens_continue_with_their_original_positions(tiny_dir, image_inputs):
    model, _ = load(tiny_dir, rules(), **CPU)
    decoder = decoder_of(model)
    text = decoder.orig_module
    seen = {}
    text.layers[2].register_forward_pre_hook(lambda m, a, k: seen.update(cos=k["position_embeddings"][0]), with_kwargs=True)
    with torch.no_grad():
        out = model(**image_inputs, use_cache=True)
    visual = image_inputs["input_ids"][0] == model.config.image_token_id
    n = int(visual.sum())
    keep = model.vismmoe.context.pruning.keep
    assert int(visual[keep].sum()) == math.floor(0.5 * n)          # exactly floor(beta * N) visual tokens
    assert int((~visual[keep]).sum()) == int((~visual).sum())       # every text token
    full_positions, _ = model.model.get_rope_index(image_inputs["input_ids"], image_inputs["mm_token_type_ids"],
                                                   image_grid_thw=image_inputs["image_grid_thw"])
    cos_full, _ = text.rotary_emb(torch.zeros(1, 1, dtype=torch.float32), full_positions)
    assert torch.equal(seen["cos"], cos_full[:, keep])              # kept tokens keep their M-RoPE positions
    cache = out.past_key_values
    lengths = [cache.layers[i].keys.shape[-2] for i in range(len(text.layers))]
    assert lengths[:2] == [visual.numel()] * 2 and lengths[2:] == [keep.numel()] * 2
    assert out.logits.shape[1] == visual.numel()                    # the output keeps the input's length


@pytest.mark.parametrize("pinned", [None, 0])
def test_generation_with_pruning_and_the_offload_runtime(tiny_dir, image_inputs, pinned):
    """The prune follows the pinned prefix, and with none (the default rules' L_semantic 0 allows it) still
    comes after the first layer, whose routing Algorithm 1 ranks by."""
    layer = layer_bytes(SPECS["tiny-4x16"])
    depth = {} if pinned is None else {"pinned_layers": pinned, "min_pinned_layers": 0}
    model, _ = load(tiny_dir, HYBRID, expert_budget=2 * layer, miss_policy="wait", **depth, **CPU)
    with torch.no_grad():
        tokens = model.generate(**image_inputs, max_new_tokens=32, do_sample=False)
    assert tokens.shape[1] == image_inputs["input_ids"].shape[1] + 32
    stats = collect_stats(model)["operators"]
    decoder = stats["VisDecoder"]
    assert decoder["pruned_prefills"] == 1 and decoder["visual_tokens_after"] == decoder["visual_tokens_before"] // 2
    assert stats["VisExperts"]["pinned_layers"] == (1 if pinned is None else 0)
    assert decoder_of(model).text_forward._prune_at() == 1


def test_with_no_pinned_layer_the_prune_follows_the_first_moe_layer_of_a_dense_first_family(tmp_path):
    """GLM-4.5V's first decoder layer is dense: with no pinned layer the prune still waits for its first MoE
    layer, so Algorithm 1 ranks the visual tokens by routing it has seen, not by empty expert sets."""
    import yaml

    from conftest import make_image
    from vismmoe_kt.demo.tiny import save_tiny_model
    from vismmoe_kt.engine.generation import generate
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    directory = save_tiny_model(tmp_path / "glm", "tiny-glm-4x16", seed=0)
    rules_list = yaml.safe_load(open("optimize_rules/glm4v-offload.yaml"))
    rules_list[0]["replace"]["kwargs"].update(compression="affinity", keep_ratio=0.5, prune_layer="auto",
                                              saliency_source="llm")
    for rule in rules_list:  # the offload file keeps one pinned layer at least; this test asks for none
        if rule["replace"].get("class", "").endswith("VisExperts"):
            rule["replace"]["kwargs"]["min_pinned_layers"] = 0
    model, processor = load(directory, rules_list, expert_budget=2 * layer_bytes(SPECS["tiny-glm-4x16"]),
                            pinned_layers=0, graphs="off", **CPU)
    runtime = model.vismmoe.context.offload_runtime
    forward = decoder_of(model).text_forward
    assert runtime.moe_layers[0] == 1 and not runtime.pinned  # layer 0 dense, nothing pinned
    seen = {}
    keep = forward._keep
    forward._keep = lambda visual, prefix, host: (seen.update(routed=[i for i in prefix if i in forward._routes]),
                                                  keep(visual, prefix, host))[1]
    inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(160, 128, seed=1)])
    with torch.no_grad():
        generate(model, inputs, 2)
    assert forward._prune_at() == 2 and seen["routed"] == [1]
    assert forward._expert_counts.sum() > 0  # the ranking's expert sets are not empty
    assert forward.counters.pruned_prefills == 1


@pytest.mark.parametrize("method,source", [("saliency", "vision"), ("random", "vision"), ("affinity", "llm"),
                                           ("saliency", "llm")])
def test_baselines_and_saliency_sources_run(tiny_dir, image_inputs, method, source):
    model, _ = load(tiny_dir, rules(compression=method, saliency_source=source), **CPU)
    with torch.no_grad():
        model.generate(**image_inputs, max_new_tokens=4, do_sample=False)
    assert decoder_of(model).text_forward.counters.pruned_prefills == 1


def test_batch_of_two_images_is_a_clear_error(tiny_dir, reference):
    from conftest import make_image

    _, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[prompt, prompt], images=[make_image(), make_image(seed=1)], return_tensors="pt")
    model, _ = load(tiny_dir, rules(), **CPU)
    with pytest.raises(ValueError, match="batch size 1 without padding"):
        model(**batch)


def test_rule_errors(tiny_dir):
    with pytest.raises(RuleError, match="keep_ratio must be in"):
        load(tiny_dir, rules(keep_ratio=0.0), **CPU)
    with pytest.raises(RuleError, match="compression 'zip' is not one of"):
        load(tiny_dir, rules(compression="zip"), **CPU)
    with pytest.raises(RuleError, match="needs the vision tower's saliency"):
        load(tiny_dir, rules()[1:], **CPU)


def test_causal_mask():
    assert causal_mask(1, 5, torch.float32, torch.device("cpu")) is None
    m = causal_mask(3, 2, torch.float32, torch.device("cpu"))[0, 0]
    assert m.shape == (3, 5)
    assert (m == 0).tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    # a prefill from an empty cache: the kernel's own causal flag where it has one, else the mask
    assert causal_mask(4, 0, torch.float32, torch.device("cpu"), implicit_causal=True) is None
    assert causal_mask(4, 0, torch.float32, torch.device("cpu"))[0, 0].shape == (4, 4)


def test_llm_saliency_is_the_last_tokens_attention(tiny_dir, image_inputs):
    """FastV-style saliency against eager attention's own probabilities in the same layer."""
    model, _ = load(tiny_dir, rules(keep_ratio=1.0), **CPU)
    last_token_attention = model.vismmoe.adapter.last_token_attention
    text = decoder_of(model).orig_module
    layer = text.layers[1]
    captured = {}
    layer.self_attn.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    text.config._attn_implementation = "eager"
    layer.self_attn.register_forward_hook(lambda m, a, out: captured.update(weights=out[1]))
    with torch.no_grad():
        model(**image_inputs)
        visual = torch.nonzero(image_inputs["input_ids"][0] == model.config.image_token_id, as_tuple=True)[0]
        mine = last_token_attention(layer.self_attn, captured["hidden_states"], captured["position_embeddings"], visual)
    expected = captured["weights"][0, :, -1, visual].mean(dim=0)
    assert torch.allclose(mine, expected, atol=1e-6)

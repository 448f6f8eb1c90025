"""Every family beyond Qwen3-VL-MoE (families.py: GLM-4.5V, DeepSeek-OCR-2, Kimi K2.5, ERNIE-4.5-VL, Llama 4)
through its own
rule files, with our features off: the injected model gives the transformers fp32 reference's logits
(max abs diff <= 1e-5) and greedy tokens on transformers' decode loop, on the lean decode step (graphs off
and through the CPU twin of the captured graphs) and with its experts offloaded at the smallest budget,
which misses. What the families differ in is their adapters': M-RoPE or 1-D positions, softmax or
sigmoid grouped routers (run as the module), shared experts in the lean step's attention piece, GLM's
partial rotary, Kimi's MLA attention over a cache of compressed latents, Llama 4's input-scaled experts and
packed complex rotary. Hybrid mode (misses on the CPU) and the lookahead predictor's prefetches change no
token either. Also: the adapter's hooks hand
the text model the image-token mask; FastV-style saliency recomputed by the adapter equals transformers'
eager attention weights; pruned prefills and batched decode give the tokens of the unbatched loop."""

import pytest
import torch
import yaml

from vismmoe_kt import load
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.models import adapter_for

from conftest import layer_bytes, make_image, run_eager
from families import CPU, FAMILIES, TOKENS, family_case


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    family = FAMILIES[request.param]
    return (family, *family_case(tmp_path_factory, family, 1, "What is in the picture?", family.image, 2))


def test_structure_of_the_tiny_model(case):
    """The adapter finds the parts: layer 0 dense (no router, no shared experts), the others MoE layers with
    the router beside their (primary) experts, `mlp.gate` (ERNIE's text experts': `mlp.text_moe.gate`; Llama 4's
    `feed_forward.router`, its dense and MoE layers interleaved; none
    of these families' is the fused softmax-top-k-renormalise one: the module routes), fused experts of the
    spec's shape and shared experts."""
    family, _, ref, _, _ = case
    adapter = adapter_for(ref.config.model_type)
    spec, layers = SPECS[family.spec], adapter.decoder_layers(ref)
    moe = [i for i in range(len(layers)) if i not in family.dense_layers]
    assert len(moe) == family.moe_layers and adapter.moe_layers_from_config(ref.config) == moe
    assert [i for i, layer in enumerate(layers) if adapter.experts(layer) is not None] == moe
    assert adapter.shared_experts(layers[0]) is None and adapter.router(layers[0]) is None
    layer, modules = layers[moe[0]], dict(ref.named_modules())
    key = adapter.experts_key(moe[0])  # the experts' module, whose sibling router routes to them
    assert key.startswith(f"{family.text_model}.layers.{moe[0]}.") and key.endswith(".experts")
    assert modules[family.text_model] is adapter.text_model(ref)
    assert modules[key] is adapter.experts(layer) and adapter.expert_set(key) is None
    assert adapter.router(layer) is modules[key.removesuffix("experts") + family.router]
    assert adapter.shared_experts(layer) is modules[f"{family.text_model}.layers.{moe[0]}.{family.shared}"]
    assert adapter.fused_router(adapter.router(layer)) is None
    gate_up, down = adapter.expert_weights(adapter.experts(layer))  # in our operators' layout
    assert gate_up.shape == (spec.experts, 2 * spec.moe_intermediate, spec.hidden)
    assert down.shape == (spec.experts, spec.hidden, spec.moe_intermediate)
    shape = adapter.moe_shape(ref.config)
    assert (shape.num_experts, shape.top_k, shape.hidden, shape.inter, shape.moe_layers) == (
        spec.experts, spec.top_k, spec.hidden, spec.moe_intermediate, tuple(moe))


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
    family, model_dir, _, inputs, expected = case
    model, _ = load(model_dir, f"optimize_rules/{family.rules}.yaml", decode=decode, graphs=graphs, **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    if decode == "lean":
        stats = model.vismmoe.adapter.text_model(model).stats()
        assert stats["decode_steps"] == TOKENS - 1  # the lean step decoded
        assert stats["decode_graphed_steps"] == (TOKENS - 1 if graphs == "replay" else 0)


@pytest.mark.parametrize("decode", ["hf", "lean"])
def test_offloaded_experts_at_a_budget_that_misses_match_the_reference(case, decode):
    family, model_dir, _, inputs, expected = case
    budget = layer_bytes(SPECS[family.spec]) * 2  # the minimum: one pinned MoE layer and one layer of slabs for two
    model, _ = load(model_dir, f"optimize_rules/{family.rules}-offload.yaml", expert_budget=budget, decode=decode,
                    graphs="off", **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["count"] == family.moe_layers and stats["pinned_layers"] == 1
    assert stats["bytes_copied"] > 0 and stats["evictions"] > 0 and stats["decode_misses"] > 0


def offload_rules(family, **kwargs):
    """The family's offload rule file with `kwargs` set on its (primary) VisExperts rules."""
    rules = yaml.safe_load(open(f"optimize_rules/{family.rules}-offload.yaml"))
    for rule in rules:
        if rule["replace"].get("class") == "vismmoe_kt.operators.vis_experts.VisExperts":
            rule["replace"].setdefault("kwargs", {}).update(kwargs)
    return rules


@pytest.mark.parametrize("decode", ["hf", "lean"])
def test_hybrid_misses_computed_on_the_cpu_match_the_reference(case, decode):
    """Hybrid mode (`miss_policy: cpu`) at the smallest budget: each miss runs on the CPU backend, reading the
    host store in place, in the family's expert layout, routing weights and (Llama 4) input scaling."""
    family, model_dir, _, inputs, expected = case
    rules = offload_rules(family, expert_budget=layer_bytes(SPECS[family.spec]) * 2, miss_policy="cpu")
    model, _ = load(model_dir, rules, decode=decode, graphs="off", **CPU)
    check(model, inputs, expected, lean=decode == "lean")
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["decode_cpu_experts"] > 0 and stats["prefill_cpu_experts"] > 0
    assert stats["decode_misses"] == stats["prefill_misses"] == 0  # nothing waited on a fetch


def test_the_lookahead_predictor_prefetches_and_changes_no_token(case, tmp_path):
    """A lookahead predictor of the family's shape (its MoE layers, experts and hidden size; untrained, so
    every pair it ranks is prefetched at probability 0) drives decode prefetches at the smallest budget; what
    is copied when changes, the tokens do not."""
    from vismmoe_kt.predictor.model import LookaheadPredictor, PredictorConfig

    family, model_dir, ref, inputs, expected = case
    shape = adapter_for(ref.config.model_type).moe_shape(ref.config)
    config = PredictorConfig(num_layers=len(shape.moe_layers), num_experts=shape.num_experts, hidden_size=shape.hidden,
                             visual_size=shape.hidden, window=2, width=32, history_dim=16)
    torch.manual_seed(0)
    LookaheadPredictor(config).save(tmp_path / "predictor.pt")
    rules = offload_rules(family, expert_budget=layer_bytes(SPECS[family.spec]) * 2, predictor=str(tmp_path / "predictor.pt"),
                          prefetch_topk=6, prefetch_min_probability=0.0)
    model, _ = load(model_dir, rules, graphs="off", **CPU)
    check(model, inputs, expected, lean=True)
    stats = collect_stats(model)["operators"]["VisExperts"]
    assert stats["decode_prefetches"] > 0 and stats["evictions"] > 0


def test_the_text_model_sees_the_image_tokens(case):
    """None of these families' models pass their text model a visual mask: the adapter's hooks hand it on,
    so features that treat visual tokens apart (ReaLB's modality, pruning, the predictor's summary) see them."""
    family, model_dir, ref, inputs, _ = case
    model, _ = load(model_dir, f"optimize_rules/{family.rules}.yaml", **CPU)
    with torch.no_grad():
        model(**inputs)
    visual = model.vismmoe.context.token_is_visual
    assert visual.any() and torch.equal(visual, (inputs["input_ids"] == ref.config.image_token_id).reshape(-1))


def test_last_token_attention_equals_the_eager_attention_weights(case):
    """FastV-style saliency recomputed by the adapter (GLM's partial rotary, DeepSeek-OCR-2's full 1-D
    rotary, Kimi's MLA: queries from the low-rank projection, keys expanded from the latents) equals the
    attention probabilities transformers' eager attention forms in the same layer."""
    _, _, ref, inputs, _ = case
    adapter = adapter_for(ref.config.model_type)
    attn = adapter.attention(adapter.decoder_layers(ref)[1])
    seen = {}

    def hook(module, args, kwargs, output):
        seen.update(hidden=kwargs["hidden_states"], pe=kwargs["position_embeddings"], weights=output[1])
    run_eager(ref, inputs, attn, hook)
    positions = torch.nonzero(adapter.image_token_mask(ref.config, inputs["input_ids"])[0], as_tuple=True)[0]
    with torch.no_grad():
        got = adapter.last_token_attention(attn, seen["hidden"], seen["pe"], positions)
    want = seen["weights"].mean(dim=1)[0, -1, positions]
    assert torch.allclose(got, want, atol=1e-6)


PRUNING = [(name, compression, source) for name, family in FAMILIES.items()
           for compression, source in [("random", "vision"), ("affinity", "llm")]
           + ([("affinity", "vision")] if family.vision_saliency else [])]


@pytest.mark.parametrize("case,compression,source", PRUNING, indirect=["case"])
def test_pruned_prefill_decodes_alike_on_both_paths(case, compression, source):
    """Visual tokens pruned after layer 1 (random; affinity FastV-style by the last token's attention in
    layer 0, through the adapter's attention read, or by the vision tower's attention where the adapter
    reads it): the lean path gives the tokens of transformers' loop over the same pruned model."""
    family, model_dir, _, inputs, _ = case
    rules = yaml.safe_load(open(f"optimize_rules/{family.rules}.yaml"))
    rules[0]["replace"]["kwargs"].update(compression=compression, keep_ratio=0.5, prune_layer=1, saliency_source=source)
    if compression == "affinity" and source == "vision":
        rules.insert(0, {"match": {"name": family.vision_saliency},
                         "replace": {"class": "vismmoe_kt.operators.vis_decoder.VisionSaliency", "kwargs": {}}})
    hf, _ = load(model_dir, rules, decode="hf", **CPU)
    lean, _ = load(model_dir, rules, graphs="off", **CPU)
    with torch.no_grad():
        expected = generate(hf, inputs, TOKENS)
        tokens = generate(lean, inputs, TOKENS)
    for model in (hf, lean):
        counters = model.vismmoe.adapter.text_model(model).text_forward.counters
        assert counters.pruned_prefills == 1 and counters.visual_tokens_after < counters.visual_tokens_before
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("offload", [False, True])
def test_batched_greedy_tokens_equal_each_request_alone(case, offload):
    """Batched decode (engine/runner.py: the decode step's pieces over several rows of the slot cache, shared
    experts included, MLA latents in the slots) gives each request the tokens it gets alone; prompts of
    different lengths, with and without images."""
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.engine.inputs import build_inputs, user_turn

    family, model_dir = case[:2]
    extra = {"expert_budget": layer_bytes(SPECS[family.spec]) * 2} if offload else {}
    rules = f"optimize_rules/{family.rules}{'-offload' if offload else ''}.yaml"
    model, processor = load(model_dir, rules, graphs="off", **extra, **CPU)
    requests = [build_inputs(processor, [user_turn("Describe the image.", 1)], [make_image(*family.image, seed=1)]),
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

"""Llama 4 (transformers llama4), the sixth family: dense and MoE layers interleaved, one expert per token whose
*input* the router's sigmoid score scales, a shared expert, complex rotary (none in every fourth layer, whose
queries get temperature tuning instead), chunked attention, and a tiled vision tower with pixel shuffle. What
only it has: the adapter's own MoE blocks (our operators' experts layout and call; checkpoints keep
transformers' transposed one), the input-scaling pre-hook on expert operators, the rotary packed as (cos, sin)
with a position column, the context capped at the attention chunk, and our PIL port of its image processor
(transformers' needs torchvision). Equality with the transformers reference under every rule file:
test_families.py and test_family_operators.py, over every family."""

import dataclasses

import pytest
import torch
from safetensors import safe_open
from torch import nn

from vismmoe_kt import load
from vismmoe_kt.demo.tiny import SPECS, save_tiny_model
from vismmoe_kt.demo.tiny_llama4 import CHUNK, MAX_TILES, TILE
from vismmoe_kt.errors import InputError, LoadError
from vismmoe_kt.models import adapter_for
from vismmoe_kt.models.llama4 import Llama4FusedExperts, Llama4MoeBlock, Llama4PackedRopeAttention, scale_expert_input
from vismmoe_kt.models.llama4_images import (Llama4ImageProcessorPil, best_canvas, fit_without_distortion,
                                             supported_canvases)

from conftest import make_image, run_eager, tiny_case

NAME = "tiny-llama4-6x16"
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_case(tmp_path_factory, NAME, 1, "What is in the picture?", (160, 128), 2)


def test_structure_of_the_tiny_model(case):
    """What only Llama 4 has (the parts every family has: test_families.py): MoE layers by the interleave step,
    layer 3 without rotary, 1-D positions, the context capped at the attention chunk, the adapter's model
    built with its own MoE blocks and attention, 112 px tiles of 16 visual tokens (a global tile beside 2 x 2)."""
    _, ref, inputs = case
    adapter = adapter_for(ref.config.model_type)
    text = ref.config.text_config
    assert text.interleave_moe_layer_step == 2 and adapter.moe_layers_from_config(ref.config) == [1, 3, 5]
    assert [adapter.attention(layer).use_rope for layer in adapter.decoder_layers(ref)] == [1, 1, 1, 0, 1, 1]
    assert adapter.position_rows() == 1 and adapter.context_length(ref.config) == CHUNK
    assert adapter.vision_merge_size(ref.config) == 2
    built = adapter.build(ref.config)
    layers = adapter.decoder_layers(built)
    assert all(isinstance(adapter.attention(layer), Llama4PackedRopeAttention) for layer in layers)
    assert [isinstance(adapter.feed_forward(layer), Llama4MoeBlock) for layer in layers] == [False, True] * 3
    assert inputs["pixel_values"].shape == (5, 3, TILE, TILE)  # 2 x 2 tiles and the global one
    assert int(adapter.image_token_mask(ref.config, inputs["input_ids"]).sum()) == 5 * (TILE // 14) ** 2 // 4


def test_routing_is_not_degenerate(case):
    """The random router spreads the prompt's tokens over many experts in every MoE layer."""
    _, ref, inputs = case
    adapter = adapter_for(ref.config.model_type)
    routes = []
    handles = [adapter.router(layer).register_forward_hook(lambda m, a, out: routes.append(adapter.routed_experts(out)))
               for layer in adapter.decoder_layers(ref) if adapter.router(layer) is not None]
    with torch.no_grad():
        ref(**inputs)
    for handle in handles:
        handle.remove()
    assert len(routes) == 3 and all(ids.unique().numel() >= 8 for ids in routes)


def test_checkpoint_keeps_transformers_layout_and_the_loader_transposes_it(case):
    model_dir, ref, _ = case
    spec = SPECS[NAME]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        stored = f.get_slice("language_model.model.layers.1.feed_forward.experts.gate_up_proj").get_shape()
    assert tuple(stored) == (spec.experts, spec.hidden, 2 * spec.moe_intermediate)  # (E, H, 2I)
    model, _ = load(model_dir, None, **CPU)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = tensor.transpose(1, 2) if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else tensor
        assert torch.equal(got[name], expected), name


class WeightedExperts(nn.Module):
    """Our operators' contract: sum_k weights_k * expert_k(x), over the fused (E, 2I, H) / (E, H, I) tensors."""

    def __init__(self, gate_up, down):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for k in range(top_k_index.shape[1]):
            gate, up = torch.einsum("th,tih->ti", hidden, self.gate_up[top_k_index[:, k]]).chunk(2, dim=-1)
            out += top_k_weights[:, k, None] * torch.einsum("ti,thi->th", nn.functional.silu(gate) * up,
                                                            self.down[top_k_index[:, k]])
        return out


def test_input_scaling_pre_hook_gives_transformers_moe(case):
    """An operator with the usual contract (the routed output scaled by the weight) behind the adapter's
    pre-hook gives transformers' Llama4TextMoe (the input scaled); without the hook it does not. Our own
    MoE block gives it too."""
    _, ref, inputs = case
    adapter = adapter_for(ref.config.model_type)
    stock = adapter.feed_forward(adapter.decoder_layers(ref)[3])
    hidden = torch.randn(1, 12, ref.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    flat = hidden.view(-1, hidden.shape[-1])
    with torch.no_grad():
        want, want_logits = stock(hidden)
        gate_up, down = adapter.expert_weights(stock.experts)
        ours = Llama4MoeBlock(ref.config.text_config)
        ours.router.weight.copy_(stock.router.weight)
        ours.shared_expert.load_state_dict(stock.shared_expert.state_dict())
        ours.experts.gate_up_proj.copy_(gate_up)
        ours.experts.down_proj.copy_(down)
        block, block_logits = ours(hidden)
        logits, weights, ids = ours.router(flat)
        assert torch.equal(logits, want_logits) and weights.min() > 0 and ids.shape == (12, 1)
        operator = WeightedExperts(gate_up, down)
        unscaled = stock.shared_expert(flat) + operator(flat, ids, weights)
        operator.register_forward_pre_hook(scale_expert_input, with_kwargs=True)
        scaled = stock.shared_expert(flat) + operator(flat, ids, weights)
    assert (scaled - want).abs().max() <= 1e-5 and (block - want).abs().max() <= 1e-5
    assert torch.equal(block_logits, want_logits)
    assert (unscaled - want).abs().max() > 1e-3


@pytest.mark.parametrize("layer_index", [1, 3])  # rotary and L2 q/k norm; no rotary, temperature tuning
def test_packed_rotary_gives_transformers_attention(case, layer_index):
    """The adapter's (cos, sin) pair unpacks to transformers' complex rotary; our attention given it equals
    transformers' given the complex tensor, for a prefill and a decode step after it (where transformers
    reads the temperature-tuning positions from the cache's length, ours from the pair's position column)."""
    from transformers.cache_utils import DynamicCache

    _, ref, _ = case
    adapter = adapter_for(ref.config.model_type)
    text = adapter.text_model(ref)
    stock = adapter.attention(adapter.decoder_layers(ref)[layer_index])
    ours = Llama4PackedRopeAttention.__new__(Llama4PackedRopeAttention)
    ours.__dict__ = stock.__dict__  # the same module, our forward
    hidden = torch.randn(1, 20, ref.config.text_config.hidden_size, generator=torch.Generator().manual_seed(1))
    caches = DynamicCache(config=ref.config.text_config), DynamicCache(config=ref.config.text_config)
    for start, end in ((0, 19), (19, 20)):  # prefill, then one decode step
        positions = torch.arange(start, end)[None]
        freqs = text.rotary_emb(hidden, positions)
        cos, sin = adapter.rotary(text, hidden, positions[None])
        assert torch.equal(torch.complex(cos[..., :-1], sin[..., :-1]), freqs) and torch.equal(cos[..., -1], positions.float())
        mask = None if end - start == 1 else torch.full((end - start, end - start), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            want, _ = stock(hidden[:, start:end], freqs, mask, past_key_values=caches[0])
            got, _ = ours(hidden[:, start:end], (cos, sin), mask, past_key_values=caches[1])
        assert (got - want).abs().max() <= 1e-6
    if layer_index == 3:  # the tuning matters here: positions >= floor_scale - 1 get larger queries
        assert ref.config.text_config.floor_scale < 20 and stock.attn_temperature_tuning and not stock.use_rope


def test_prompt_longer_than_the_attention_chunk_is_refused(case):
    model_dir, _, _ = case
    model, processor = load(model_dir, "optimize_rules/llama4.yaml", graphs="off", **CPU)
    inputs = processor(text=["x" * (CHUNK + 1)], return_tensors="pt")
    with pytest.raises(InputError, match=rf"context of {CHUNK + 1} tokens.*attention_chunk_size = {CHUNK}"):
        with torch.no_grad():
            model(**inputs)
    inputs = processor(text=["x" * 8], return_tensors="pt")
    with torch.no_grad():
        assert model(**inputs).logits.shape[1] == 8


@pytest.mark.parametrize("batched", [False, True])
def test_decoding_past_the_attention_chunk_is_refused_before_any_work(case, batched):
    """A prompt that fits but a token budget that would decode past the chunk: our decode step computes
    plain causal attention, which chunked attention leaves behind there, so the request is refused whole."""
    from vismmoe_kt.engine.generation import generate_batch
    from vismmoe_kt.engine.generation import generate

    model_dir, _, _ = case
    model, processor = load(model_dir, "optimize_rules/llama4.yaml", graphs="off", **CPU)
    inputs = dict(processor(text=["x" * 1000], return_tensors="pt"))
    prompt = inputs["input_ids"].shape[1]
    message = rf"a prompt of {prompt} tokens plus max_new_tokens={CHUNK} is over this model's context of {CHUNK}"
    with pytest.raises(InputError, match=message), torch.no_grad():
        if batched:
            generate_batch(model, [inputs], CHUNK)
        else:
            generate(model, inputs, CHUNK)
    with torch.no_grad():  # within the chunk, and nothing left behind by the refusal
        assert generate(model, inputs, CHUNK - prompt).shape[1] == CHUNK


@pytest.mark.parametrize("change,message", [({"top_k": 2}, r"num_experts_per_tok=2: .*one expert per token"),
                                            ({"moe_intermediate": 64}, r"hidden_size 64 and intermediate_size 64")])
def test_configs_the_adapter_cannot_serve_are_refused_at_load(tmp_path, change, message):
    model_dir = save_tiny_model(tmp_path / "m", dataclasses.replace(SPECS[NAME], **change), seed=0)
    with pytest.raises(LoadError, match=message):
        load(model_dir, "optimize_rules/llama4.yaml", **CPU)


def test_image_processor_follows_transformers_tiling():
    """transformers' own examples for its tiling helpers (image_processing_llama4.py's docstrings), then the
    processor's output: a small picture is one tile, a wide one a 1 x 2 grid plus the global tile, pixels in
    [-1, 1] at BF16 precision, the padding black."""
    assert set(supported_canvases(5, 224)) == {(224, 896), (448, 448), (224, 224), (896, 224), (224, 672), (672, 224),
                                               (224, 448), (448, 224), (224, 1120), (1120, 224)}
    assert best_canvas(200, 300, [(224, 672), (672, 224), (224, 448), (448, 224), (224, 224)]) == (224, 448)
    # transformers' code floors (its docstring's examples say 134 and 338)
    assert fit_without_distortion(200, 300, 450, 200) == (133, 200)
    assert fit_without_distortion(800, 600, 450, 1300) == (450, 337)
    processor = Llama4ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES)
    small = processor(images=[make_image(64, 48)], return_tensors="pt")
    assert small["pixel_values"].shape == (1, 3, TILE, TILE) and small["aspect_ratios"].tolist() == [[1, 1]]
    wide = processor(images=[make_image(200, 90, seed=3)], return_tensors="pt")
    pixels = wide["pixel_values"]
    assert pixels.shape == (3, 3, TILE, TILE) and wide["aspect_ratios"].tolist() == [[1, 2]]
    assert pixels.abs().max() <= 1 and torch.equal(pixels, pixels.to(torch.bfloat16).float())
    # 200 x 90 px fits a 224 x 112 canvas unscaled: padded (zeros, -1 once normalised) below and to the right
    assert (pixels[0, :, 90:] == -1).all() and (pixels[1, :, :, 88:] == -1).all()
    assert (pixels[0, :, :90] != -1).float().mean() > 0.9 and (pixels[1, :, :90, :88] != -1).float().mean() > 0.9


def test_vision_saliency_equals_the_eager_attention_weights(case):
    """The attention each patch receives in the vision tower's last layer, recomputed by the adapter, equals
    transformers' eager weights averaged over heads and queries, class token left out, in pixel shuffle's
    order (each visual token's four patches consecutive)."""
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle

    _, ref, inputs = case
    adapter = adapter_for(ref.config.model_type)
    tower = adapter.vision_tower(ref)
    attn, seen = adapter.vision_last_attention(tower), {}
    run_eager(ref, inputs, attn, lambda m, args, kwargs, out: seen.update(hidden=args[0], weights=out[1]))
    with torch.no_grad():
        got = adapter.attention_received(attn, seen["hidden"], None, None)
    received = seen["weights"].mean(dim=(1, 2))[:, :-1]  # (tiles, patches)
    want = pixel_shuffle(received[..., None], ref.config.vision_config.pixel_shuffle_ratio).reshape(-1)
    assert got.shape == (5 * (TILE // 14) ** 2,) and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("rules", ["llama4-gpu", "llama4"])
def test_a_bfloat16_model_takes_the_processors_float32_pixels(case, rules):
    """Published Llama 4 checkpoints are BF16 and its processor gives float32 pixels, which transformers' model
    hands its vision tower uncast: the adapter's hook casts them (stock modules and ours alike)."""
    model_dir, _, inputs = case
    model, _ = load(model_dir, f"optimize_rules/{rules}.yaml", dtype="bfloat16", graphs="off", **CPU)
    assert inputs["pixel_values"].dtype == torch.float32
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()

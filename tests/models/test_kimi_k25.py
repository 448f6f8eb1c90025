"""Kimi K2.5 (transformers kimi_k25), the fourth family: DeepSeek-V3's text model (MLA attention, a dense
first layer, sigmoid routers with a correction bias over expert groups, a shared expert, 1-D RoPE) behind
MoonViT. What only it has: checkpoints in the original layout (`save_pretrained` writes
`language_model.model.blocks.N`, the vision tower's fused and rotary-permuted `wqkv`, per-expert tensors),
which the adapter maps; a decode cache of MLA's compressed latents, not per-head keys and values; and our
PIL port of its image processor (transformers' needs torchvision). Equality with the transformers reference
under every rule file: test_families.py and test_family_operators.py, over every family."""

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.engine.decoding import decode_engine
from vismmoe_kt.models import adapter_for
from vismmoe_kt.models.kimi_k25 import KimiK25ImageProcessorPil, navit_resize

from conftest import make_image, tiny_case

NAME = "tiny-kimi-4x16"
CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_case(tmp_path_factory, NAME, 1, "What is in the picture?", (160, 128), 2)


def test_structure_of_the_tiny_model(case):
    """What only Kimi K2.5 has (the parts every family has: test_families.py): grouped routing, 1-D
    positions, MLA's cache shape and norms, MoonViT's padded raster patches pooled 2 x 2."""
    _, ref, inputs = case
    adapter = adapter_for(ref.config.model_type)
    text, layer = ref.config.text_config, adapter.decoder_layers(ref)[1]
    assert layer.mlp.gate.num_group == 4 and layer.mlp.gate.topk_group == 2
    assert adapter.position_rows() == 1
    assert adapter.kv_cache_shape(text) == (1, text.kv_lora_rank, text.qk_rope_head_dim)  # MLA's latents
    attn = adapter.attention(layer)
    assert adapter.attention_norms(attn) == (attn.q_a_layernorm, attn.kv_a_layernorm)
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 12]]  # 128 x 160 px padded to 140 x 168: 14 px patches
    mask = adapter.image_token_mask(ref.config, inputs["input_ids"])
    assert int(mask.sum()) == 10 * 12 // 4  # 2 x 2 windows pooled


def test_checkpoint_keeps_the_original_layout_and_the_loader_maps_it(case):
    model_dir, ref, _ = case
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "language_model.model.blocks.1.mlp.experts.0.gate_proj.weight" in names
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names and "mm_projector.proj.0.weight" in names
    assert not any(name.startswith("model.language_model.") for name in names)
    model, _ = load(model_dir, None, **CPU)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():  # the vision q/k from the fused wqkv, unpermuted; the correction bias
        assert torch.equal(got[name], tensor), name
    bias = got["model.language_model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0


def test_the_decode_cache_holds_mla_latents(case):
    """The lean engine's static cache is made in the adapter's shape: per layer one head of kv_lora_rank
    normed latent dims and qk_rope_head_dim rotary key dims, which the attention expands after reading;
    the latent written for the prompt's last token is the one the attention module computes."""
    model_dir, ref, inputs = case
    text = ref.config.text_config
    model, _ = load(model_dir, "optimize_rules/kimi-k25.yaml", graphs="off", **CPU)
    with torch.no_grad():
        generate(model, inputs, 2)
    cache = decode_engine(model).cache
    assert cache.keys[0].shape[1::2] == (1, text.kv_lora_rank) and cache.values[0].shape[1::2] == (1, text.qk_rope_head_dim)
    per_position = 4 * text.num_hidden_layers * cache.capacity  # fp32
    assert cache.nbytes() == per_position * (text.kv_lora_rank + text.qk_rope_head_dim)
    per_head_keys_and_values = text.num_attention_heads * (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim)
    assert cache.nbytes() < per_position * per_head_keys_and_values / 3  # 40 of 160 values a position here
    seen = {}
    attn = ref.model.language_model.layers[2].self_attn
    handle = attn.kv_a_layernorm.register_forward_hook(lambda m, args, out: seen.setdefault("latent", out))
    with torch.no_grad():
        ref(**inputs)
    handle.remove()
    last = inputs["input_ids"].shape[1] - 1
    assert torch.allclose(cache.keys[2][0, 0, last], seen["latent"][0, last], atol=1e-5)


def test_the_processor_takes_text_without_images(case):
    model_dir = case[0]
    _, processor = load(model_dir, None, **CPU)
    inputs = processor(text=["Hello there"], return_tensors="pt")
    assert inputs["input_ids"].shape == (1, len("Hello there")) and "pixel_values" not in inputs


def test_the_loaded_processor_gives_the_builders_inputs(case):
    model_dir, _, inputs = case
    _, processor = load(model_dir, None, **CPU)
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                            "text": "What is in the picture?"}]}], add_generation_prompt=True, tokenize=False)
    again = processor(text=[prompt], images=[make_image(160, 128, seed=2)], return_tensors="pt")
    assert set(again) == set(inputs) and all(torch.equal(again[k], inputs[k]) for k in inputs)


def test_image_processor_pads_to_whole_merge_windows_and_cuts_raster_patches():
    """A white 30 x 20 px image: not resized (within every budget), padded with black to 56 x 28 (whole 2 x 2
    windows of 14 px patches), rescaled and normalised (white 1.0, the padding -1.0), cut into 2 x 4
    patches in raster order."""
    processor = KimiK25ImageProcessorPil(size={"max_height": 224, "max_width": 224})
    out = processor(images=[Image.fromarray(np.full((20, 30, 3), 255, dtype=np.uint8))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 2, 4]] and out["pixel_values"].shape == (8, 3, 14, 14)
    patches = out["pixel_values"]
    assert torch.all(patches[0] == 1.0) and torch.all(patches[1] == 1.0) and torch.all(patches[7] == -1.0)
    assert torch.all(patches[2][:, :, :2] == 1.0) and torch.all(patches[2][:, :, 2:] == -1.0)  # columns 28.. padded
    assert torch.all(patches[4][:, :6] == 1.0) and torch.all(patches[4][:, 6:] == -1.0)  # rows 20.. padded


def test_navit_resize_scales_down_within_the_patch_budgets():
    assert navit_resize(100, 60, 14, 2, 16384, 16) == ((100, 60), (112, 84))  # small: padded only
    (h, w), (ph, pw) = navit_resize(1000, 500, 14, 2, 16384, 16)  # taller than 16 patches: scaled to fit
    assert h <= 16 * 14 and abs(h / w - 2) < 0.05 and ph % 28 == pw % 28 == 0 and ph // 14 <= 16
    (h, w), _ = navit_resize(2000, 2000, 14, 2, 64, 512)  # at most 64 patches
    assert (h // 14) * (w // 14) <= 64

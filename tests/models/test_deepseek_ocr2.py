"""DeepSeek-OCR-2 (transformers deepseek_ocr2), the third family: 1-D RoPE (the engine builds one row
of positions where M-RoPE families get three), a softmax top-k router without renormalisation (run as
the module, not the fused router), shared experts, a dense first layer, and checkpoints in the original
layout (`save_pretrained` writes `model.layers.N`, `model.sam_model`, per-expert tensors), which the
adapter's `checkpoint_name` / `checkpoint_sources` map. Equality with the transformers reference under
every rule file: test_families.py and test_family_operators.py, over every family."""

import pytest
import torch
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.models import adapter_for

from conftest import tiny_case

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
    """What only DeepSeek-OCR-2 has (the parts every family has: test_families.py): 1-D positions, a
    global view and local tiles of fixed token counts, and a view separator."""
    _, ref, inputs, _ = case
    adapter = adapter_for(ref.config.model_type)
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

"""GLM-4.5V (transformers glm4v_moe), the second family: its adapter finds the parts (shared experts
too), and the loader assembles the fused experts from the per-expert tensors `save_pretrained` writes and
reads the router's correction bias. Equality with the transformers reference under every rule file:
test_families.py and test_family_operators.py, over every family."""

import pytest
import torch
from safetensors import safe_open

from vismmoe_kt import load
from vismmoe_kt.models import adapter_for

from conftest import tiny_case

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
    """What only GLM has (the parts every family has: test_families.py): M-RoPE's three position rows, an
    image's tokens its 2 x 2 merged patches."""
    _, ref, inputs, _ = case
    adapter = adapter_for(ref.config.model_type)
    assert adapter.position_rows() == 3
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

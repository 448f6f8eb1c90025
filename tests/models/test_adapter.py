"""The Qwen3-VL-MoE adapter finds the parts operators need, and the registry rejects unknown families."""

import pytest
import torch

from vismmoe_kt.errors import LoadError
from vismmoe_kt.models import adapter_for, supported_model_types
from vismmoe_kt.demo.tiny import SPECS


def test_structure_of_the_tiny_model(reference):
    model, processor = reference
    adapter = adapter_for(model.config.model_type)
    spec = SPECS["tiny-4x16"]
    layers = adapter.decoder_layers(model)
    assert len(layers) == spec.layers
    assert [i for i, layer in enumerate(layers) if adapter.experts(layer) is not None] == adapter.moe_layers_from_config(model.config)
    layer = layers[1]
    assert adapter.router(layer) is layer.mlp.gate and adapter.router(layer).top_k == spec.top_k
    assert adapter.experts(layer).gate_up_proj.shape == (spec.experts, 2 * spec.moe_intermediate, spec.hidden)
    assert adapter.vision_tower(model) is model.model.visual
    assert adapter.text_config(model.config).num_experts == spec.experts


def test_image_token_mask(reference, image_inputs):
    model, processor = reference
    adapter = adapter_for(model.config.model_type)
    mask = adapter.image_token_mask(model.config, image_inputs["input_ids"])
    grid = image_inputs["image_grid_thw"][0]
    assert mask.dtype == torch.bool and int(mask.sum()) == int(grid.prod()) // 4  # merge 2x2


def test_hub_layout_fix_only_touches_expert_tensors(reference):
    adapter = adapter_for("qwen3_vl_moe")
    stored = torch.randn(4, 8, 6)
    fixed = adapter.to_model_layout("model.language_model.layers.0.mlp.experts.gate_up_proj", stored, torch.Size([4, 6, 8]))
    assert torch.equal(fixed, stored.transpose(1, 2))
    other = adapter.to_model_layout("model.visual.blocks.0.attn.qkv.weight", stored, torch.Size([4, 6, 8]))
    assert other is stored


def test_unknown_family_lists_supported():
    assert supported_model_types() == ["deepseek_ocr2", "ernie4_5_vl_moe", "glm4v_moe", "kimi_k25", "llama4", "qwen3_vl_moe"]
    with pytest.raises(LoadError, match=r"unsupported architecture model_type='deepseek_vl_v2'; supported: deepseek_ocr2, ernie4_5_vl_moe, glm4v_moe, kimi_k25, llama4, qwen3_vl_moe"):
        adapter_for("deepseek_vl_v2")


def test_vision_saliency_of_one_picture_reads_nothing_back_and_several_stay_apart(reference, monkeypatch):
    """The attention each patch receives, head-averaged, within its own picture, against each picture's own
    softmax: one picture's bounds are its patches (nothing read back from the device), several pictures'
    are read once and computed apart."""
    model, _ = reference
    adapter = adapter_for(model.config.model_type)
    attn = model.model.visual.blocks[-1].attn
    torch.manual_seed(0)
    length, dim = 24, attn.qkv.in_features
    hidden = torch.randn(length, dim)
    angles = torch.randn(length, attn.head_dim // 2)
    position_embeddings = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))

    def per_picture(bounds):
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

        q, k, _ = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            qs, ks = q[start:end].transpose(0, 1).float(), k[start:end].transpose(0, 1).float()
            probs = torch.softmax(qs @ ks.transpose(1, 2) * attn.scaling, dim=-1)  # (heads, n, n)
            out.append(probs.mean(dim=1).mean(dim=0))
        return torch.cat(out)

    with torch.no_grad():
        for bounds, read_back in (([0, length], 0), ([0, 8, 20, length], 1)):
            reads.clear()
            got = adapter.attention_received(attn, hidden, torch.tensor(bounds, dtype=torch.int32), position_embeddings)
            assert len(reads) == read_back and got.shape == (length,)
            torch.testing.assert_close(got, per_picture(bounds), rtol=1e-5, atol=1e-6)
            sums = [float(got[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
            assert sums == pytest.approx([1.0] * (len(bounds) - 1), abs=1e-5)  # each picture's attention sums to 1

"""Kimi K2.5 in llama.cpp's files (models/kimi_k25_gguf.py): the tensors llama.cpp's converter splits or
permutes are written as it writes them from the published layout (its DeepseekV2Model's kv_b_proj split and
KimiK25Model's wqkv permutation, restated here from convert_hf_to_gguf.py and applied to the saved
checkpoint), in the shapes llama.cpp's deepseek2 loader creates; YaRN's keys read back as written."""

import pytest
import torch
from safetensors.torch import load_file

from vismmoe_kt import load
from vismmoe_kt.core.gguf_model import GgufMetadata
from vismmoe_kt.demo.gguf_export import export_gguf, export_mmproj
from vismmoe_kt.demo.tiny import build_tiny_model, save_tiny_model
from vismmoe_kt.models import adapter_for
from vismmoe_kt.models.kimi_k25_gguf import _rope

gguf = pytest.importorskip("gguf")
CPU = dict(generate_device="cpu", prefill_device="cpu", progress=False, dtype="float32")


def converter_kv_b(kv_b, heads, nope, v):
    """llama.cpp's DeepseekV2Model.modify_tensors for kv_b_proj: per head, k_b transposed and v_b."""
    k_b, v_b = torch.split(kv_b.view(heads, nope + v, kv_b.shape[-1]), [nope, v], dim=1)
    return k_b.transpose(1, 2), v_b


def converter_wqkv(wqkv, heads):
    """llama.cpp's KimiK25Model.modify_tensors for wqkv (weight or bias): q and k rows permuted per head."""
    q, k, v = wqkv.chunk(3, dim=0)
    permute = lambda w: w.reshape(heads, w.shape[0] // heads // 4, 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # noqa: E731
    return torch.cat([permute(q), permute(k), v], dim=0)


def read_tensors(path):
    """GGUF name -> (values in numpy order, ggml's dims innermost first)."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        dims = [int(d) for d in t.shape.tolist()]
        out[t.name] = (torch.from_numpy(t.data.copy()).reshape(list(reversed(dims))), dims)
    return out


def test_the_files_hold_what_llama_cpps_converter_writes_from_the_checkpoint(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", "tiny-kimi-4x16", seed=0)
    model, processor = load(hf_dir, **CPU)  # as `vismmoe-kt convert` does: the loaded model's layout
    config, adapter = model.config, adapter_for("kimi_k25")
    export_gguf(model.state_dict(), adapter, tmp_path / "m.gguf", "F32", config=config, processor=processor)
    export_mmproj(model.state_dict(), adapter, config, tmp_path / "mm.gguf", "F32", processor=processor)
    text, mmproj, stored = read_tensors(tmp_path / "m.gguf"), read_tensors(tmp_path / "mm.gguf"), load_file(hf_dir / "model.safetensors")
    t = config.text_config
    assert not any(".attn_kv_b." in name for name in text)  # the converter writes only the split halves
    for layer in range(t.num_hidden_layers):
        k_b, v_b = converter_kv_b(stored[f"language_model.model.blocks.{layer}.self_attn.kv_b_proj.weight"],
                                  t.num_attention_heads, t.qk_nope_head_dim, t.v_head_dim)
        assert torch.equal(text[f"blk.{layer}.attn_k_b.weight"][0], k_b)
        assert torch.equal(text[f"blk.{layer}.attn_v_b.weight"][0], v_b)
    # llama.cpp's create_tensor shapes: wk_b {qk_nope, kv_lora_rank, n_head}, wv_b {kv_lora_rank, v, n_head}
    assert text["blk.0.attn_k_b.weight"][1] == [t.qk_nope_head_dim, t.kv_lora_rank, t.num_attention_heads]
    assert text["blk.0.attn_v_b.weight"][1] == [t.kv_lora_rank, t.v_head_dim, t.num_attention_heads]
    assert torch.equal(text["blk.1.exp_probs_b.bias"][0],
                       stored["language_model.model.blocks.1.mlp.gate.e_score_correction_bias"].float())
    heads = config.vision_config.num_attention_heads
    for block in range(config.vision_config.num_hidden_layers):
        for suffix in ("weight", "bias"):
            want = converter_wqkv(stored[f"vision_tower.encoder.blocks.{block}.wqkv.{suffix}"], heads)
            assert torch.equal(mmproj[f"v.blk.{block}.attn_qkv.{suffix}"][0], want)
    for name, original in (("v.position_embd.weight", "vision_tower.patch_embed.pos_emb.weight"),
                           ("mm.1.weight", "mm_projector.proj.0.weight"), ("mm.2.weight", "mm_projector.proj.2.weight"),
                           ("mm.input_norm.weight", "mm_projector.pre_norm.weight")):
        # transformers saves the projector's pre-norm under `model.`, the published checkpoint without it
        assert torch.equal(mmproj[name][0], stored.get(original, stored.get(f"model.{original}"))), name


def test_yarn_is_written_and_read_back_as_llama_cpp_keeps_it():
    """The factor, the original context, the betas and mscale_all_dim (a tenth of it as llama.cpp's
    yarn_log_multiplier); mscale comes back as mscale_all_dim, as llama.cpp's deepseek2 graph takes it."""
    model, _ = build_tiny_model("tiny-kimi-4x16", seed=0)
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    model.config.text_config.rope_parameters = dict(yarn)
    arch, keys = adapter_for("kimi_k25").gguf_metadata(model.config)
    assert keys[f"{arch}.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    assert _rope(GgufMetadata(None, keys), lambda name: f"{arch}.{name}") == yarn
    model.config.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    arch, keys = adapter_for("kimi_k25").gguf_metadata(model.config)
    assert _rope(GgufMetadata(None, keys), lambda name: f"{arch}.{name}") == {"rope_type": "default", "rope_theta": 10000.0}

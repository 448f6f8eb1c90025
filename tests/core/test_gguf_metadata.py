"""llama.cpp's metadata in the GGUF files we write: every family's text architecture keys
(`ModelAdapter.gguf_metadata`) and the mmproj file's `clip.*` keys (`ModelAdapter.mmproj_metadata`),
read back with the gguf package's GGUFReader against the tiny models' configs, key by key, in the
types llama.cpp's loaders read; and a clear warning naming the family where llama.cpp has nothing."""

import math

import pytest

from vismmoe_kt.demo.gguf_export import export_gguf, export_mmproj
from vismmoe_kt.demo.tiny import build_tiny_model
from vismmoe_kt.models import adapter_for

gguf = pytest.importorskip("gguf")
UINT32, FLOAT32, BOOL, STRING, ARRAY = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                                        gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
# keys llama.cpp's loader refuses a file without: every architecture's (llama_model::load_hparams), then each
# one's own (its load_hparams case or src/models/<arch>.cpp)
REQUIRED_ALL = ("context_length", "embedding_length", "block_count")
REQUIRED = {
    "qwen3vlmoe": ("attention.layer_norm_rms_epsilon",),
    "glm4moe": ("expert_feed_forward_length", "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
                "expert_shared_count"),
    "deepseek2-ocr": ("attention.layer_norm_rms_epsilon", "expert_feed_forward_length", "expert_shared_count"),
    "deepseek2": ("attention.layer_norm_rms_epsilon", "leading_dense_block_count", "attention.q_lora_rank",
                  "attention.kv_lora_rank", "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale"),
    "ernie4_5-moe": ("attention.layer_norm_rms_epsilon", "expert_feed_forward_length", "interleave_moe_layer_step",
                     "leading_dense_block_count"),
    "llama4": ("attention.layer_norm_rms_epsilon", "expert_feed_forward_length", "interleave_moe_layer_step"),
}


def _common(text):
    return {"context_length": text.max_position_embeddings, "embedding_length": text.hidden_size,
            "block_count": text.num_hidden_layers, "attention.head_count": text.num_attention_heads,
            "vocab_size": text.vocab_size, "attention.layer_norm_rms_epsilon": text.rms_norm_eps,
            "rope.freq_base": text.rope_parameters["rope_theta"]}


def _deepseek_moe(text, gating):
    return {"expert_count": text.n_routed_experts, "expert_used_count": text.num_experts_per_tok,
            "expert_feed_forward_length": text.moe_intermediate_size, "expert_shared_count": text.n_shared_experts,
            "expert_weights_scale": text.routed_scaling_factor, "expert_gating_func": gating}


def expect_qwen(config):
    text = config.text_config
    return {**_common(text), "feed_forward_length": text.intermediate_size, "attention.head_count_kv": text.num_key_value_heads,
            "attention.key_length": text.head_dim, "attention.value_length": text.head_dim,
            "expert_count": text.num_experts, "expert_used_count": text.num_experts_per_tok,
            "expert_feed_forward_length": text.moe_intermediate_size,
            "rope.dimension_sections": [*text.rope_parameters["mrope_section"], 0],
            "n_deepstack_layers": len(config.vision_config.deepstack_visual_indexes)}


def expect_glm(config):
    text = config.text_config
    return {**_common(text), **_deepseek_moe(text, 2), "feed_forward_length": text.intermediate_size,
            "attention.head_count_kv": text.num_key_value_heads, "attention.key_length": text.head_dim,
            "leading_dense_block_count": text.first_k_dense_replace, "expert_weights_norm": text.norm_topk_prob,
            "expert_group_count": text.n_group, "expert_group_used_count": text.topk_group,
            "rope.dimension_count": int(text.head_dim * text.rope_parameters["partial_rotary_factor"]),
            "rope.dimension_sections": [*text.rope_parameters["mrope_section"], 0]}


def expect_dsocr2(config):
    text = config.text_config
    return {**_common(text), **_deepseek_moe(text, 1), "feed_forward_length": text.intermediate_size,
            "attention.head_count_kv": text.num_key_value_heads, "attention.key_length": text.head_dim,
            "leading_dense_block_count": text.mlp_layer_types.index("sparse"), "expert_weights_norm": False,
            "rope.dimension_count": text.head_dim}


def expect_kimi(config):
    text = config.text_config
    return {**_common(text), **_deepseek_moe(text, 2), "feed_forward_length": text.intermediate_size,
            "attention.head_count_kv": 1, "leading_dense_block_count": text.first_k_dense_replace,
            "attention.q_lora_rank": text.q_lora_rank, "attention.kv_lora_rank": text.kv_lora_rank,
            "attention.key_length": text.kv_lora_rank + text.qk_rope_head_dim, "attention.value_length": text.kv_lora_rank,
            "attention.key_length_mla": text.qk_nope_head_dim + text.qk_rope_head_dim,
            "attention.value_length_mla": text.v_head_dim, "rope.dimension_count": text.qk_rope_head_dim,
            "expert_group_count": text.n_group, "expert_group_used_count": text.topk_group, "expert_weights_norm": True}


def expect_ernie(config):
    text = config.text_config
    return {**_common(text), "feed_forward_length": text.intermediate_size, "attention.head_count_kv": text.num_key_value_heads,
            "expert_count": text.moe_num_experts, "expert_used_count": text.moe_k,
            "expert_feed_forward_length": text.moe_intermediate_size[0], "expert_shared_count": text.moe_num_shared_experts,
            "expert_shared_feed_forward_length": text.moe_intermediate_size[0] * text.moe_num_shared_experts,
            "leading_dense_block_count": text.mlp_layer_types.index("sparse"), "interleave_moe_layer_step": 1}


def expect_llama4(config):
    text = config.text_config
    return {**_common(text), "feed_forward_length": text.intermediate_size_mlp, "attention.head_count_kv": text.num_key_value_heads,
            "expert_feed_forward_length": text.intermediate_size, "expert_count": text.num_local_experts,
            "expert_used_count": text.num_experts_per_tok, "interleave_moe_layer_step": text.interleave_moe_layer_step,
            "rope.dimension_count": text.head_dim, "attention.sliding_window": text.attention_chunk_size}


FAMILIES = {"tiny-4x16": ("qwen3vlmoe", expect_qwen), "tiny-glm-4x16": ("glm4moe", expect_glm),
            "tiny-dsocr2-4x16": ("deepseek2-ocr", expect_dsocr2), "tiny-kimi-4x16": ("deepseek2", expect_kimi),
            "tiny-ernie-4x16": ("ernie4_5-moe", expect_ernie), "tiny-llama4-6x16": ("llama4", expect_llama4)}
_BUILT = {}


def tiny(name):
    if name not in _BUILT:  # one random model per family for the module
        _BUILT[name] = build_tiny_model(name, seed=0)
    return _BUILT[name]


def read_fields(path):
    """key -> (value, GGUF type of the value or of an array's elements, whether it is an array)."""
    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("GGUF."):
            continue
        array = field.types[0] == ARRAY
        out[key] = (field.contents(), field.types[-1], array)
    return out


def check(fields, prefix, expected):
    """Each expected key present with its value, in llama.cpp's type: uint32 for ints, float32 for
    floats (float32's precision), bool, int32 / bool / float32 arrays."""
    for key, want in expected.items():
        assert f"{prefix}{key}" in fields, f"{prefix}{key} missing"
        got, kind, array = fields[f"{prefix}{key}"]
        if isinstance(want, list):
            assert array and list(got) == want, (key, got, want)
            assert kind == {bool: BOOL, int: gguf.GGUFValueType.INT32, float: FLOAT32}[type(want[0])], (key, kind)
        elif isinstance(want, bool):
            assert kind == BOOL and got is want, (key, got)
        elif isinstance(want, float):
            assert kind == FLOAT32 and math.isclose(got, want, rel_tol=1e-6), (key, got, want)
        elif isinstance(want, str):
            assert kind == STRING and got == want, (key, got)
        else:
            assert kind == UINT32 and got == want, (key, got, want)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_gguf_carries_llama_cpps_keys_from_its_config(name, tmp_path):
    arch, expect = FAMILIES[name]
    model, _ = tiny(name)
    adapter = adapter_for(model.config.model_type)
    path = tmp_path / "m.gguf"
    if not any(adapter.gguf_names(name) for name in model.state_dict()):  # no tensor layout mapped yet: keys only
        with pytest.warns(UserWarning, match=rf"{model.config.model_type}: no tensor has a GGUF name"):
            export_gguf(model.state_dict(), adapter, path, "F16", config=model.config)
    else:
        written = export_gguf(model.state_dict(), adapter, path, "F16", config=model.config)
        assert ("blk.0.attn_q_b.weight" if arch == "deepseek2" else "blk.0.attn_q.weight") in written  # MLA: low-rank
    fields = read_fields(path)
    assert fields["general.architecture"][0] == arch and fields["tokenizer.ggml.model"][0] == "no_vocab"
    for key in REQUIRED_ALL + REQUIRED[arch]:
        assert f"{arch}.{key}" in fields, f"llama.cpp requires {arch}.{key}"
    check(fields, f"{arch}.", expect(model.config))
    assert not any(key.startswith("clip.") for key in fields)


def test_qwen_mmproj_carries_llama_cpps_clip_keys(tmp_path):
    """llama.cpp's qwen3vl_merger block: the tower's sizes from the config, the image side its learned
    positions cover, the processor's normalisation, which blocks feed a DeepStack merger; the tensors
    still under llama.cpp's names."""
    model, processor = tiny("tiny-4x16")
    config, vision = model.config, model.config.vision_config
    written = export_mmproj(model.state_dict(), adapter_for("qwen3_vl_moe"), config, tmp_path / "mm.gguf",
                            processor=processor)
    assert {"v.patch_embd.weight", "mm.0.weight", "v.blk.0.attn_qkv.weight"} <= set(written)
    fields = read_fields(tmp_path / "mm.gguf")
    assert fields["general.architecture"][0] == "clip" and fields["general.type"][0] == "mmproj"
    side = int(math.isqrt(vision.num_position_embeddings)) * vision.patch_size
    check(fields, "clip.", {
        "projector_type": "qwen3vl_merger", "has_vision_encoder": True, "use_gelu": True,
        "vision.image_size": side, "vision.patch_size": vision.patch_size, "vision.embedding_length": vision.hidden_size,
        "vision.feed_forward_length": vision.intermediate_size, "vision.projection_dim": config.text_config.hidden_size,
        "vision.block_count": vision.depth, "vision.attention.head_count": vision.num_heads,
        "vision.attention.layer_norm_epsilon": config.text_config.rms_norm_eps,
        "vision.spatial_merge_size": vision.spatial_merge_size,
        "vision.image_mean": [float(v) for v in processor.image_processor.image_mean],
        "vision.image_std": [float(v) for v in processor.image_processor.image_std],
        "vision.is_deepstack_layers": [i in vision.deepstack_visual_indexes for i in range(vision.depth)]})


@pytest.mark.parametrize("name,projector", [("tiny-glm-4x16", "glm4v"), ("tiny-llama4-6x16", "llama4"),
                                            ("tiny-kimi-4x16", "kimik25")])
def test_other_projectors_clip_keys(name, projector, tmp_path):
    """GLM-4.5V, Llama 4 and Kimi K2.5 have llama.cpp projectors: their clip keys from the config, their towers
    under llama.cpp's mmproj names."""
    model, processor = tiny(name)
    config, vision = model.config, model.config.vision_config
    mapped = {"glm4v": {"v.patch_embd.weight", "v.patch_embd.weight.1", "mm.model.fc.weight", "v.blk.0.attn_qkv.weight"},
              "llama4": {"v.patch_embd.weight", "v.class_embd", "mm.model.mlp.2.weight", "v.blk.0.attn_q.weight",
                         "mm.model.fc.weight", "v.position_embd.weight"},  # where llama.cpp's clip loader looks
              "kimik25": {"v.patch_embd.weight", "v.position_embd.weight", "v.blk.0.attn_qkv.weight", "mm.input_norm.weight",
                          "mm.1.weight", "mm.2.weight", "v.post_ln.weight"}}[projector]
    written = export_mmproj(model.state_dict(), adapter_for(config.model_type), config, tmp_path / "mm.gguf",
                            processor=processor)
    assert mapped <= set(written)
    fields = read_fields(tmp_path / "mm.gguf")
    images = processor.image_processor
    common = {"projector_type": projector, "has_vision_encoder": True, "vision.patch_size": vision.patch_size,
              "vision.embedding_length": vision.hidden_size, "vision.feed_forward_length": vision.intermediate_size,
              "vision.projection_dim": config.text_config.hidden_size,
              "vision.image_mean": [float(v) for v in images.image_mean], "vision.image_std": [float(v) for v in images.image_std]}
    own = {
        "glm4v": lambda: {"vision.image_size": vision.image_size, "vision.block_count": vision.depth,
                          "vision.attention.head_count": vision.num_heads, "use_silu": True,
                          "vision.attention.layer_norm_epsilon": vision.rms_norm_eps,
                          "vision.spatial_merge_size": vision.spatial_merge_size,
                          "vision.image_min_pixels": images.size["shortest_edge"],
                          "vision.image_max_pixels": images.size["longest_edge"]},
        "llama4": lambda: {"vision.image_size": vision.image_size, "vision.block_count": vision.num_hidden_layers,
                           "vision.attention.head_count": vision.num_attention_heads, "use_gelu": True,
                           "vision.attention.layer_norm_epsilon": vision.norm_eps,
                           "vision.projector.scale_factor": round(1 / vision.pixel_shuffle_ratio)},
        "kimik25": lambda: {"vision.image_size": vision.pos_emb_height * vision.patch_size,
                            "vision.block_count": vision.num_hidden_layers, "use_gelu": True,
                            "vision.attention.head_count": vision.num_attention_heads,
                            "vision.attention.layer_norm_epsilon": config.projection_layer_norm_eps,
                            "vision.projector.scale_factor": vision.merge_kernel_size[0],
                            "vision.image_max_pixels": images.max_patches * vision.patch_size ** 2},
    }[projector]()
    check(fields, "clip.", {**common, **own})


@pytest.mark.parametrize("name", ["tiny-ernie-4x16", "tiny-dsocr2-4x16"])
def test_a_family_without_a_llama_cpp_projector_is_named(name, tmp_path):
    model, processor = tiny(name)
    family = model.config.model_type
    with pytest.warns(UserWarning, match=rf"{family}: llama.cpp has no mmproj projector for this family"):
        export_mmproj(model.state_dict(), adapter_for(family), model.config, tmp_path / "mm.gguf", processor=processor)
    assert not any(key.startswith("clip.") for key in read_fields(tmp_path / "mm.gguf"))


def test_the_writer_names_what_it_cannot_write(tmp_path):
    """A family without a llama.cpp text architecture, an mmproj without a processor, an arch that is not
    the family's: each a message naming it, not a silent file."""
    from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

    class Unknown(Qwen3VLMoeAdapter):
        model_types = ("unknown_vl",)

        def gguf_metadata(self, config):
            return None

    model, _ = tiny("tiny-4x16")
    with pytest.warns(UserWarning, match="unknown_vl: llama.cpp has no text architecture"):
        export_gguf(model.state_dict(), Unknown(), tmp_path / "u.gguf", "F16", config=model.config)
    fields = read_fields(tmp_path / "u.gguf")
    assert "tokenizer.ggml.model" not in fields and "qwen3vlmoe.context_length" not in fields
    with pytest.warns(UserWarning, match="qwen3_vl_moe: no processor given"):
        export_mmproj(model.state_dict(), adapter_for("qwen3_vl_moe"), model.config, tmp_path / "mm.gguf")
    assert "clip.projector_type" not in read_fields(tmp_path / "mm.gguf")
    with pytest.raises(ValueError, match="llama.cpp calls qwen3_vl_moe 'qwen3vlmoe'"):
        export_gguf(model.state_dict(), adapter_for("qwen3_vl_moe"), tmp_path / "x.gguf", arch="llama", config=model.config)

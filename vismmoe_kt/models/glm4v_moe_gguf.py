"""GLM-4.5V in llama.cpp's files: the text model under `glm4moe`'s tensor names, the vision tower under the
mmproj's (`glm4v`), and the config and processor rebuilt from the pair's metadata (the inverse of
`Glm4vMoeAdapter.gguf_metadata` / `mmproj_metadata`).

The names are the gguf package's own maps (`gguf.get_tensor_name_map`, which llama.cpp's converter
applies), with what they do not cover: the fused experts as llama.cpp's stacked `ffn_gate_exps` +
`ffn_up_exps` (concatenated along dim 1 into the model's gate_up (E, 2I, H)) and `ffn_down_exps`, the
router's correction bias as `exp_probs_b.bias`, and the Conv3d patch embedding as two 2-D slices along
time (`v.patch_embd.weight`, `.weight.1`), as for Qwen3-VL.
"""

from __future__ import annotations

from typing import Any

from ..errors import LoadError
from .base import MmprojSource
from .gguf_tensor_names import name_map, text_tensor_names
from .llama_cpp_keys import stored_float

_TEXT = "model.language_model."
_VISUAL = "model.visual."
_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
            "mlp.experts.down_proj": ("ffn_down_exps.weight",),
            "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias",)}
ARCH, FAMILY = "glm4moe", "glm4v_moe (llama.cpp's glm4moe)"
CLIP = "clip.vision."


def gguf_names(name: str, layers: int = 256) -> tuple[str, ...] | None:
    """llama.cpp's names of a text tensor (None for the vision tower, which goes to the mmproj file)."""
    return text_tensor_names(name, prefix=_TEXT, experts=_EXPERTS, layers=layers,
                             lm_head="lm_head.weight", arch="GLM4_MOE")


def mmproj_source(name: str, depth: int) -> MmprojSource | None:
    if not name.startswith(_VISUAL):
        return None
    rest = name[len(_VISUAL):]
    if rest == "patch_embed.proj.weight":
        return MmprojSource(("v.patch_embd.weight", "v.patch_embd.weight.1"), stack_dim=2)
    stem, _, suffix = rest.rpartition(".")
    mapped = name_map("MMPROJ", depth).get_name("visual." + stem)
    return MmprojSource((f"{mapped}.{suffix}",)) if mapped else None


def token_ids(tokenizer: Any, path: Any) -> dict[str, int]:
    """The config's special token ids, from the vocabulary."""
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
        ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>"))}
    missing = [name for name, index in ids.items() if index is None or index == tokenizer.unk_token_id]
    if missing:
        raise LoadError(f"{path}: {FAMILY}: the vocabulary lacks the vision tokens of {', '.join(missing)}")
    return ids


def config_from_gguf(text: Any, mmproj: Any, tokenizer: Any) -> Any:
    """Glm4vMoeConfig from the `glm4moe.*` and `clip.*` keys; from the tensors: the vocabulary, tied
    embeddings, attention biases, the patch embedding's time slices; the end tokens: eos, eot, eom."""
    from transformers import Glm4vMoeConfig

    need = lambda meta, key: meta.need(key, FAMILY)  # noqa: E731
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731
    head_dim = int(need(text, key("attention.key_length")))
    ends = [int(text.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")
            if text.get(f"tokenizer.ggml.{k}_token_id") is not None]
    pad = text.get("tokenizer.ggml.padding_token_id")
    groups = text.get(key("expert_group_count"))
    tie = "output.weight" not in text.shapes
    text_config = dict(
        vocab_size=int(text.get(key("vocab_size")) or text.shape("token_embd.weight", FAMILY)[0]),
        hidden_size=need(text, key("embedding_length")), intermediate_size=need(text, key("feed_forward_length")),
        num_hidden_layers=need(text, key("block_count")), num_attention_heads=need(text, key("attention.head_count")),
        num_key_value_heads=need(text, key("attention.head_count_kv")), head_dim=head_dim,
        moe_intermediate_size=need(text, key("expert_feed_forward_length")),
        n_routed_experts=need(text, key("expert_count")), num_experts_per_tok=need(text, key("expert_used_count")),
        n_shared_experts=need(text, key("expert_shared_count")),
        first_k_dense_replace=need(text, key("leading_dense_block_count")),
        routed_scaling_factor=stored_float(need(text, key("expert_weights_scale"))),
        norm_topk_prob=bool(need(text, key("expert_weights_norm"))),
        n_group=int(groups) if groups is not None else 1,
        topk_group=int(text.get(key("expert_group_used_count")) or 1),
        max_position_embeddings=need(text, key("context_length")),
        rms_norm_eps=stored_float(need(text, key("attention.layer_norm_rms_epsilon"))),
        attention_bias="blk.0.attn_q.bias" in text.shapes, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": stored_float(need(text, key("rope.freq_base"))),
                         "mrope_section": [int(v) for v in need(text, key("rope.dimension_sections"))][:3],
                         "partial_rotary_factor": stored_float(int(need(text, key("rope.dimension_count"))) / head_dim)},
        eos_token_id=ends if len(ends) > 1 else (ends[0] if ends else None),
        pad_token_id=None if pad is None else int(pad))
    act = "silu" if mmproj.get("clip.use_silu") else "gelu" if mmproj.get("clip.use_gelu") else None
    if act is None:
        raise LoadError(f"{mmproj.path}: {FAMILY}: the mmproj names no activation (clip.use_silu / clip.use_gelu)")
    vision = dict(
        depth=need(mmproj, CLIP + "block_count"), hidden_size=need(mmproj, CLIP + "embedding_length"),
        intermediate_size=need(mmproj, CLIP + "feed_forward_length"), num_heads=need(mmproj, CLIP + "attention.head_count"),
        out_hidden_size=need(mmproj, CLIP + "projection_dim"), patch_size=need(mmproj, CLIP + "patch_size"),
        spatial_merge_size=int(mmproj.get(CLIP + "spatial_merge_size", 2)),
        temporal_patch_size=2 if "v.patch_embd.weight.1" in mmproj.shapes else 1,
        image_size=need(mmproj, CLIP + "image_size"), hidden_act=act,
        rms_norm_eps=stored_float(need(mmproj, CLIP + "attention.layer_norm_epsilon")))
    return Glm4vMoeConfig(text_config=text_config, vision_config=vision, tie_word_embeddings=tie,
                          **token_ids(tokenizer, text.path))


def processor_from_gguf(mmproj: Any, tokenizer: Any, chat_template: str, processor_class: type) -> Any:
    """GLM-4.1V's PIL image processor from the `clip.*` keys (the class's own pixel bounds where the file
    has none)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    bounds = {"shortest_edge": mmproj.get(CLIP + "image_min_pixels"), "longest_edge": mmproj.get(CLIP + "image_max_pixels")}
    size = {"size": {k: int(v) for k, v in bounds.items()}} if None not in bounds.values() else {}
    image_processor = Glm4vImageProcessorPil(
        patch_size=int(mmproj.need(CLIP + "patch_size", FAMILY)),
        merge_size=int(mmproj.get(CLIP + "spatial_merge_size", 2)),
        temporal_patch_size=2 if "v.patch_embd.weight.1" in mmproj.shapes else 1,
        image_mean=[stored_float(v) for v in mmproj.need(CLIP + "image_mean", FAMILY)],
        image_std=[stored_float(v) for v in mmproj.need(CLIP + "image_std", FAMILY)], **size)
    return processor_class(image_processor, tokenizer, chat_template=chat_template)

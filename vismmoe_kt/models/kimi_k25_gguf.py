"""Kimi K2.5 in llama.cpp's files: the text model under `deepseek2`'s tensor names, MoonViT under the mmproj's
(`kimik25` projector), and the config and processor rebuilt from the pair's metadata (the inverse of
`KimiK25Adapter.gguf_metadata` / `mmproj_metadata`).

As llama.cpp's converter writes them (convert_hf_to_gguf.py at ggml-org/llama.cpp 0024aa7: DeepseekV2Model,
which takes KimiK25ForConditionalGeneration, and the mmproj's KimiK25Model):

- MLA's `kv_b_proj` (heads * (qk_nope + v), kv_lora) is split per head into `attn_k_b`, transposed to
  (heads, kv_lora, qk_nope), and `attn_v_b` (heads, v, kv_lora): llama.cpp's absorbed attention reads
  them so and the converter writes no `attn_kv_b`. Queries and keys are not permuted: deepseek2's rotary
  turns adjacent pairs, the checkpoint's interleaved layout (transformers' `rope_interleave`).
- the router's correction bias as `exp_probs_b.bias`, the fused experts as stacked `ffn_gate_exps` +
  `ffn_up_exps` (our gate_up split along dim 1) and `ffn_down_exps`, as for GLM.
- MoonViT's attention stays the checkpoint's fused `wqkv` (`v.blk.N.attn_qkv`), its query and key thirds
  moved from the checkpoint's rotary layout (interleaved pairs, the two axes alternating pair by pair) to
  the one llama.cpp's 2-D rope reads: each head's first half for one axis, the second for the other, each
  in adjacent pairs. The model's own q/k layout (transformers': the pairs' first elements, then the second
  ones) is a third; `_model_to_llama_cpp` / `_llama_cpp_to_model` go between it and llama.cpp's.
- the projector's `proj.0` / `proj.2` as `mm.1` / `mm.2`, its pre-norm as `mm.input_norm`, the learned
  position grid as `v.position_embd.weight` (height, width, width of a patch) unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import LoadError
from .base import MmprojSource
from .gguf_tensor_names import name_map, text_tensor_names
from .llama_cpp_keys import stored_float

_TEXT = "model.language_model."
_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
            "mlp.experts.down_proj": ("ffn_down_exps.weight",),
            "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias",)}
_KV_B = re.compile(r"^model\.language_model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight$")
_QKV = re.compile(r"^model\.vision_tower\.layers\.(\d+)\.attn\.(?P<part>[qkv])_proj\.(?P<suffix>weight|bias)$")
# the mmproj name map covers `mm_projector.proj.linear_{bid}` for bid below its depth: at least 3 for `mm.2`
_MIN_MAP_DEPTH = 3
ARCH, FAMILY = "deepseek2", "kimi_k25 (llama.cpp's deepseek2)"
CLIP = "clip.vision."


def gguf_names(name: str, layers: int = 256) -> tuple[str, ...] | None:
    """llama.cpp's names of a text tensor (None for the vision tower, which goes to the mmproj file)."""
    match = _KV_B.match(name)
    if match:
        return (f"blk.{match[1]}.attn_k_b.weight", f"blk.{match[1]}.attn_v_b.weight")
    return text_tensor_names(name, prefix=_TEXT, experts=_EXPERTS, layers=layers, lm_head="lm_head.weight",
                             arch="DEEPSEEK2")


def mmproj_source(name: str, stored: tuple[str, ...] | None, depth: int) -> MmprojSource | None:
    """Where the mmproj holds the model's vision tensor `name` (`stored`: its name in the original
    checkpoint, which llama.cpp's converter maps): q, k and v all in the block's fused `attn_qkv`."""
    match = _QKV.match(name)
    if match:
        return MmprojSource((f"v.blk.{match[1]}.attn_qkv.{match['suffix']}",))
    if not stored or not stored[0].startswith(("vision_tower.", "mm_projector.")):
        return None
    # the published checkpoint's patch embedding sits beside the encoder (`vision_tower.patch_embed.proj`, the
    # name llama.cpp maps), though transformers' reverse renaming puts it under `encoder.`
    original = stored[0].replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
    original = original.replace("mm_projector.proj.0.", "mm_projector.proj.linear_1.")
    original = original.replace("mm_projector.proj.2.", "mm_projector.proj.linear_2.")  # as the converter renames
    stem, _, suffix = original.rpartition(".")
    mapped = name_map("MMPROJ", max(depth, _MIN_MAP_DEPTH)).get_name(stem)
    return MmprojSource((f"{mapped}.{suffix}",)) if mapped else None


# --- the tensors llama.cpp's converter splits or permutes ---------------------------------------------------
def _model_to_llama_cpp(part: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection (rows, ...) from the model's rotary layout to llama.cpp's: back to the
    checkpoint's interleaved pairs (the inverse of `KimiK25Adapter.to_model_layout`), then the converter's
    `KimiK25Model.permute` (rows as (heads, dim/4, 2, 2), the middle two swapped)."""
    rows, rest = part.shape[0], part.shape[1:]
    stored = part.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(part.shape)
    return stored.reshape(heads, rows // heads // 4, 2, 2, *rest).transpose(1, 2).reshape(part.shape)


def _llama_cpp_to_model(part: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_model_to_llama_cpp` (the converter's swap undone, then transformers' permutation)."""
    rows, rest = part.shape[0], part.shape[1:]
    stored = part.reshape(heads, 2, rows // heads // 4, 2, *rest).transpose(1, 2).reshape(part.shape)
    return stored.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(part.shape)


def gguf_parts(name: str, state: dict[str, torch.Tensor], config: Any) -> list[torch.Tensor] | None:
    if _KV_B.match(name):
        if config is None:
            raise ValueError(f"{name}: splitting MLA's kv_b_proj into llama.cpp's attn_k_b / attn_v_b needs the config")
        text = config.text_config
        kv_b = state[name].float()
        kv_b = kv_b.reshape(text.num_attention_heads, text.qk_nope_head_dim + text.v_head_dim, kv_b.shape[-1])
        k_b, v_b = kv_b.split([text.qk_nope_head_dim, text.v_head_dim], dim=1)
        return [k_b.transpose(1, 2).contiguous(), v_b.contiguous()]
    match = _QKV.match(name)
    if match is None:
        return None
    if match["part"] != "q":
        return []  # written with the block's query, in the one fused tensor
    heads = int(config.vision_config.num_attention_heads)
    q, k, v = (state[name.replace(".q_proj.", f".{part}_proj.")].float() for part in "qkv")
    return [torch.cat([_model_to_llama_cpp(q, heads), _model_to_llama_cpp(k, heads), v], dim=0)]


def from_gguf(name: str, parts: list[torch.Tensor], config: Any) -> torch.Tensor | None:
    if _KV_B.match(name):
        k_b, v_b = parts  # (heads, kv_lora, qk_nope), (heads, v, kv_lora)
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        return kv_b.reshape(-1, kv_b.shape[-1])
    match = _QKV.match(name)
    if match is None:
        return None
    part = parts[0].chunk(3, dim=0)["qkv".index(match["part"])]
    if match["part"] == "v":
        return part.contiguous()
    return _llama_cpp_to_model(part, int(config.vision_config.num_attention_heads)).contiguous()


# --- config and processor from the pair's metadata ------------------------------------------------------------
def _rope(text: Any, key: Any) -> dict[str, Any]:
    """1-D rope, with YaRN where the file says: llama.cpp keeps the factor, the original context, the betas
    and a tenth of mscale_all_dim; its deepseek2 graph takes mscale as mscale_all_dim, and so does this."""
    rope = {"rope_type": "default", "rope_theta": stored_float(text.need(key("rope.freq_base"), FAMILY))}
    if text.get(key("rope.scaling.type")) != "yarn":
        return rope
    mscale = stored_float(float(text.get(key("rope.scaling.yarn_log_multiplier"), 0.0)) / 0.1)
    rope.update(rope_type="yarn", factor=stored_float(text.need(key("rope.scaling.factor"), FAMILY)),
                original_max_position_embeddings=int(text.need(key("rope.scaling.original_context_length"), FAMILY)),
                mscale=mscale, mscale_all_dim=mscale)
    for name in ("beta_fast", "beta_slow"):
        if text.get(key(f"rope.scaling.yarn_{name}")) is not None:
            rope[name] = stored_float(text.get(key(f"rope.scaling.yarn_{name}")))
    return rope


def config_from_gguf(text: Any, mmproj: Any, tokenizer: Any) -> Any:
    """Kimi_K25Config from the `deepseek2.*` and `clip.*` keys; from the tensors: the vocabulary, tied
    embeddings, the query's low-rank path, the projector's width; the token ids from the vocabulary."""
    from transformers import Kimi_K25Config

    need = lambda meta, key: meta.need(key, FAMILY)  # noqa: E731
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731
    token = lambda name: text.get(f"tokenizer.ggml.{name}_token_id")  # noqa: E731
    rope_dim = int(need(text, key("rope.dimension_count")))
    heads, groups = int(need(text, key("attention.head_count"))), text.get(key("expert_group_count"))
    tie = "output.weight" not in text.shapes
    text_config = dict(
        model_type="deepseek_v3",
        vocab_size=int(text.get(key("vocab_size")) or text.shape("token_embd.weight", FAMILY)[0]),
        hidden_size=need(text, key("embedding_length")), intermediate_size=need(text, key("feed_forward_length")),
        num_hidden_layers=need(text, key("block_count")), num_attention_heads=heads,
        # llama.cpp runs MLA as one KV head (head_count_kv = 1); the config names every query head's own
        num_key_value_heads=heads, q_lora_rank=text.get(key("attention.q_lora_rank")),
        kv_lora_rank=need(text, key("attention.kv_lora_rank")),
        qk_nope_head_dim=int(need(text, key("attention.key_length_mla"))) - rope_dim, qk_rope_head_dim=rope_dim,
        v_head_dim=need(text, key("attention.value_length_mla")), rope_interleave=True,
        moe_intermediate_size=need(text, key("expert_feed_forward_length")),
        n_routed_experts=need(text, key("expert_count")), num_experts_per_tok=need(text, key("expert_used_count")),
        n_shared_experts=need(text, key("expert_shared_count")),
        first_k_dense_replace=need(text, key("leading_dense_block_count")),
        routed_scaling_factor=stored_float(text.get(key("expert_weights_scale"), 1.0)),
        norm_topk_prob=bool(text.get(key("expert_weights_norm"), False)),
        n_group=int(groups) if groups is not None else 1, topk_group=int(text.get(key("expert_group_used_count")) or 1),
        max_position_embeddings=need(text, key("context_length")),
        rms_norm_eps=stored_float(need(text, key("attention.layer_norm_rms_epsilon"))),
        attention_bias="blk.0.attn_kv_a_mqa.bias" in text.shapes, tie_word_embeddings=tie,
        rope_parameters=_rope(text, key),
        **{f"{name}_token_id": int(token(name)) for name in ("bos", "eos") if token(name) is not None},
        pad_token_id=None if token("padding") is None else int(token("padding")))
    scale = int(need(mmproj, CLIP + "projector.scale_factor"))
    vision = dict(
        patch_size=need(mmproj, CLIP + "patch_size"), pos_emb_height=need(mmproj, "vision.pos_emb_height"),
        pos_emb_width=need(mmproj, "vision.pos_emb_width"), pos_emb_time=need(mmproj, "vision.pos_emb_time"),
        num_attention_heads=need(mmproj, CLIP + "attention.head_count"),
        num_hidden_layers=need(mmproj, CLIP + "block_count"), hidden_size=need(mmproj, CLIP + "embedding_length"),
        intermediate_size=need(mmproj, CLIP + "feed_forward_length"), merge_kernel_size=[scale, scale])
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|media_pad|>"), ("video_token_id", "<|kimi_k25_video_placeholder|>"),
        ("vision_start_token_id", "<|media_begin|>"), ("vision_end_token_id", "<|media_end|>"))}
    missing = [name for name, index in ids.items() if index is None or index == tokenizer.unk_token_id]
    if missing:
        raise LoadError(f"{text.path}: {FAMILY}: the vocabulary lacks the vision tokens of {', '.join(missing)}")
    return Kimi_K25Config(
        text_config=text_config, vision_config=vision, tie_word_embeddings=tie,
        projection_hidden_size=mmproj.shape("mm.input_norm.weight", FAMILY)[0],
        projection_layer_norm_eps=stored_float(need(mmproj, CLIP + "attention.layer_norm_epsilon")), **ids)


def processor_from_gguf(mmproj: Any, tokenizer: Any, chat_template: str) -> Any:
    """Kimi's processor from the `clip.*` keys: the patch budget from the pixel bound, the merge window from
    the scale factor. llama.cpp keeps no bound on an image's side (its preprocessor bounds the pixels only):
    the processor's own, 512 px, the published model's, is kept."""
    from .kimi_k25 import KimiK25ImageProcessorPil, KimiK25ImageTextProcessor

    patch = int(mmproj.need(CLIP + "patch_size", FAMILY))
    image_processor = KimiK25ImageProcessorPil(
        patch_size=patch, merge_size=int(mmproj.need(CLIP + "projector.scale_factor", FAMILY)),
        max_patches=int(mmproj.need(CLIP + "image_max_pixels", FAMILY)) // (patch * patch),
        image_mean=[stored_float(v) for v in mmproj.need(CLIP + "image_mean", FAMILY)],
        image_std=[stored_float(v) for v in mmproj.need(CLIP + "image_std", FAMILY)])
    return KimiK25ImageTextProcessor(image_processor, tokenizer, chat_template=chat_template)

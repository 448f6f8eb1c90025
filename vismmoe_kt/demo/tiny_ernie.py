"""Tiny ERNIE-4.5-VL models (transformers `ernie4_5_vl_moe`), built offline for tests: tiny.py's TinySpec
with `family="ernie4_5_vl_moe"` lands here (`build_tiny_model` and `save_tiny_model` dispatch on it).

The same recipe as the GLM builder: config, random weights from a seed (std 0.2, so routing depends on the
input; a non-zero router correction bias), a byte-level BPE tokenizer with ERNIE's special tokens, a chat
template in ERNIE's shape, and ERNIE's PIL image processor. What only this family has: every MoE layer holds
two expert sets, text experts (`moe_intermediate`) that text tokens route to and vision experts (here
`moe_intermediate // 3`, as the real model's 512 against 1536) that image tokens and their
start/end markers route to, each with its own softmax router and correction bias, plus shared experts.
The vision tower is ERNIE's ViT at toy widths: 14 px patches merged 2x2 by the resampler, so a picture of
160 x 128 px resizes to 168 x 140 and gives 12 x 10 patches, 30 visual tokens.
"""

from __future__ import annotations

import torch

from .byte_tokenizer import byte_level_tokenizer
from .tiny_glm import random_model

SPECIAL_TOKENS = ("</s>", "<s>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|IMAGE_START|>",
                  "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_START|>", "<|VIDEO_END|>",
                  "<|VIDEO_PLACEHOLDER|>", "<think>", "</think>")

CHAT_TEMPLATE = (
    "<|begin_of_sentence|>{% for m in messages %}{{ 'User: ' if m['role'] == 'user' else 'Assistant: ' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}Picture:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' if m['role'] == 'user' else '<|end_of_sentence|>' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
INIT_STD = 0.2
BIAS_STD = 0.05  # the routers' correction biases, against softmax probabilities over 16 experts
PATCH, MERGE = 14, 2


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos="</s>", pad="</s>", bos="<s>", named=2)


def build_processor(spec):
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    from ..models.ernie4_5_vl_moe import ErnieImageTextProcessor

    image_processor = Ernie4_5_VLMoeImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 28 * 28, "longest_edge": spec.max_image_pixels},
    )
    return ErnieImageTextProcessor(image_processor, build_tokenizer(), chat_template=CHAT_TEMPLATE)


def build_config(spec, tokenizer):
    from transformers import Ernie4_5_VLMoeConfig

    token = tokenizer.convert_tokens_to_ids
    half = spec.head_dim // 2  # M-RoPE over the head's frequency pairs: height, width, then time (ERNIE's order)
    side = (half - half // 3) // 2
    mrope = [side, side, half - 2 * side]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, moe_intermediate_size=[spec.moe_intermediate, spec.moe_intermediate // 3],
        moe_num_experts=spec.experts, moe_k=spec.top_k, moe_num_shared_experts=1,
        mlp_layer_types=["dense"] + ["sparse"] * (spec.layers - 1), max_position_embeddings=4096,
        initializer_range=INIT_STD, tie_word_embeddings=spec.tie_embeddings, use_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        eos_token_id=[token("</s>"), token("<|end_of_sentence|>")], pad_token_id=token("</s>"),
    )
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads, patch_size=PATCH, spatial_merge_size=MERGE, initializer_range=INIT_STD,
    )
    return Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings,
        image_token_id=token("<|IMAGE_PLACEHOLDER|>"), video_token_id=token("<|VIDEO_PLACEHOLDER|>"),
        image_start_token_id=token("<|IMAGE_START|>"), image_end_token_id=token("<|IMAGE_END|>"),
        video_start_token_id=token("<|VIDEO_START|>"), video_end_token_id=token("<|VIDEO_END|>"),
        initializer_range=INIT_STD,
    )


def build_tiny_ernie(spec, seed: int = 0):
    """`(model, processor)`: a random fp32 ERNIE-4.5-VL in eval mode and its processor."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    processor = build_processor(spec)
    model = random_model(Ernie4_5_VLMoeForConditionalGeneration, build_config(spec, processor.tokenizer), seed)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # ERNIE keeps its correction biases as parameters, which random_model leaves at zero
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * BIAS_STD)
    return model, processor

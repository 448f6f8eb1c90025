"""Tiny DeepSeek-OCR-2 models (transformers `deepseek_ocr2`), built offline for tests: tiny.py's TinySpec
with `family="deepseek_ocr2"` lands here (`build_tiny_model` and `save_tiny_model` dispatch on it).

The same recipe as the GLM builder: config, random weights from a seed (std 0.2, so routing depends on
the input), a byte-level BPE tokenizer with DeepSeek-OCR-2's special tokens, the family's PIL image
processor and a chat template. The vision side is the real pipeline at a quarter of its pixel sizes:
the global view is 256 px (1024 in the model), local tiles 192 px (768), SAM patches of 4 px (16), so
the SAM output is 16x16 per global view and 12x12 per tile, and the vision encoder's learned queries give
256 (global) and 144 (tile) visual tokens, as in the real model; the processor's `patch_size` 4 with
`downsample_ratio` 4 counts the same tokens. An image wider than a tile also gets local views.
"""

from __future__ import annotations

from .byte_tokenizer import byte_level_tokenizer
from .tiny_glm import random_model

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = (EOS, BOS, "<image>", "<|User|>", "<|Assistant|>")

CHAT_TEMPLATE = (
    BOS + "{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{% else %}<|Assistant|>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>{% endif %}"
)
INIT_STD = 0.2
GLOBAL_PIXELS, TILE_PIXELS, SAM_PATCH, DOWNSAMPLE = 256, 192, 4, 4


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos=EOS, pad=EOS, bos=BOS)


def build_processor(spec):
    return make_processor(GLOBAL_PIXELS, TILE_PIXELS, SAM_PATCH, DOWNSAMPLE)


def make_processor(global_pixels: int, tile_pixels: int, patch_size: int, downsample_ratio: int):
    """DeepSeek-OCR-2's processor at these pixel sizes (the synthetic full-size model uses the published
    1024 / 768 / 16 / 4), with the tiny byte-level tokenizer."""
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import DeepseekOcr2ImageProcessorPil

    from ..models.deepseek_ocr2 import DeepseekOcr2ImageTextProcessor

    image_processor = DeepseekOcr2ImageProcessorPil(size={"height": global_pixels, "width": global_pixels},
                                                    tile_size=tile_pixels)
    return DeepseekOcr2ImageTextProcessor(image_processor, build_tokenizer(), chat_template=CHAT_TEMPLATE,
                                          patch_size=patch_size, downsample_ratio=downsample_ratio)


def build_config(spec, tokenizer):
    from transformers import DeepseekOcr2Config

    token = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        moe_intermediate_size=spec.moe_intermediate, n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k,
        n_shared_experts=2, routed_scaling_factor=1.5, topk_method="greedy",
        mlp_layer_types=["dense"] + ["sparse"] * (spec.layers - 1), max_position_embeddings=4096,
        initializer_range=INIT_STD, tie_word_embeddings=spec.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=token(BOS), eos_token_id=token(EOS), pad_token_id=token(EOS),
    )
    wide = 3 * spec.vision_hidden // 2  # the vision encoder's width (896 beside SAM's 768 in the real model)
    sam = dict(hidden_size=spec.vision_hidden, output_channels=spec.vision_hidden, num_hidden_layers=spec.vision_depth,
               num_attention_heads=spec.vision_heads, image_size=GLOBAL_PIXELS, patch_size=SAM_PATCH, window_size=7,
               global_attn_indexes=[spec.vision_depth - 1], downsample_channels=[spec.vision_hidden, wide],
               initializer_range=INIT_STD)
    encoder = dict(hidden_size=wide, intermediate_size=2 * wide, num_hidden_layers=1, num_attention_heads=spec.vision_heads,
                   num_key_value_heads=spec.vision_heads, max_position_embeddings=1024, initializer_range=INIT_STD,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return DeepseekOcr2Config(text_config=text, vision_config={"sam_config": sam, "encoder_config": encoder},
                              image_token_id=token("<image>"), tie_word_embeddings=spec.tie_embeddings,
                              initializer_range=INIT_STD)


def build_tiny_dsocr2(spec, seed: int = 0):
    """`(model, processor)`: a random fp32 DeepSeek-OCR-2 in eval mode and its processor."""
    from transformers import DeepseekOcr2ForConditionalGeneration

    processor = build_processor(spec)
    return random_model(DeepseekOcr2ForConditionalGeneration, build_config(spec, processor.tokenizer), seed), processor

"""Tiny Llama 4 models (transformers `llama4`), built offline for tests: tiny.py's TinySpec with
`family="llama4"` lands here (`build_tiny_model` and `save_tiny_model` dispatch on it).

The same recipe as the GLM builder: config, random weights from a seed (std 0.15, so routing depends on
the input), a byte-level BPE tokenizer with Llama 4's special tokens, a chat template in Llama 4's shape,
and Llama 4's processor over our PIL port of its image processor (transformers' needs torchvision). The
text model: six layers, MoE every second one (`interleave_moe_layer_step` 2: layers 1, 3 and 5; the others
dense: three MoE layers, as the other families' tiny models, so an offload budget can pin one and miss),
16 experts, one per token (sigmoid of the chosen logit, which scales the expert's input), a shared expert;
rotary (and the L2 q/k norm) in every layer but 3, whose queries get Llama 4's temperature tuning
(`floor_scale` 8, so it changes within a short prompt). The vision tower: 112 px tiles of 14 px patches
(8 x 8, pixel-shuffled to 16 visual tokens a tile), at most 4 tiles plus the global one.
"""

from __future__ import annotations

from .byte_tokenizer import byte_level_tokenizer
from .tiny_glm import random_model

SPECIAL_TOKENS = ("<|finetune_right_pad|>", "<|begin_of_text|>", "<|eot|>", "<|header_start|>", "<|header_end|>",
                  "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                  "<|tile_y_separator|>")

CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
INIT_STD = 0.15  # at 0.2 kt-kernel's BF16 experts drift past the shared suite's tolerance over three MoE layers
TILE, PATCH, MAX_TILES = 112, 14, 4
CHUNK = 1024  # attention_chunk_size: the context our forward serves


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos="<|eot|>", pad="<|finetune_right_pad|>", bos="<|begin_of_text|>")


def build_processor(spec, tile: int = TILE, max_tiles: int = MAX_TILES):
    """Llama 4's processor over our PIL image processor: tiles of `tile` px, at most `max_tiles` of them
    (the published model's: 336 px and 16)."""
    from ..models.llama4_images import Llama4ImageProcessorPil, Llama4ImageTextProcessor

    image_processor = Llama4ImageProcessorPil(size={"height": tile, "width": tile}, max_patches=max_tiles)
    return Llama4ImageTextProcessor(image_processor, build_tokenizer(), patch_size=PATCH, pixel_shuffle_ratio=0.5,
                                    chat_template=CHAT_TEMPLATE)


def build_config(spec, tokenizer, **text_overrides):
    from transformers import Llama4Config

    token = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.moe_intermediate,
        intermediate_size_mlp=2 * spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, num_local_experts=spec.experts,
        num_experts_per_tok=spec.top_k, interleave_moe_layer_step=2, no_rope_layer_interval=4,
        attention_chunk_size=CHUNK, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1, use_qk_norm=True,
        max_position_embeddings=4096, initializer_range=INIT_STD, tie_word_embeddings=spec.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=token("<|begin_of_text|>"), eos_token_id=token("<|eot|>"), pad_token_id=token("<|finetune_right_pad|>"),
    )
    text.update(text_overrides)
    vision = dict(
        hidden_size=spec.vision_hidden, num_hidden_layers=spec.vision_depth, num_attention_heads=spec.vision_heads,
        intermediate_size=4 * spec.vision_hidden, image_size=TILE, patch_size=PATCH, pixel_shuffle_ratio=0.5,
        projector_input_dim=2 * spec.vision_hidden, projector_output_dim=2 * spec.vision_hidden,
        vision_output_dim=2 * spec.vision_hidden, initializer_range=INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Llama4Config(
        text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings,
        image_token_index=token("<|patch|>"), boi_token_index=token("<|image_start|>"),
        eoi_token_index=token("<|image_end|>"),
    )


def build_tiny_llama4(spec, seed: int = 0):
    """`(model, processor)`: a random fp32 Llama 4 (transformers' own modules) in eval mode and its processor."""
    from transformers import Llama4ForConditionalGeneration

    processor = build_processor(spec)
    return random_model(Llama4ForConditionalGeneration, build_config(spec, processor.tokenizer), seed), processor

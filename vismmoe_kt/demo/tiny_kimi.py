"""Tiny Kimi K2.5 models (transformers `kimi_k25`), built offline for tests: tiny.py's TinySpec with
`family="kimi_k25"` lands here (`build_tiny_model` and `save_tiny_model` dispatch on it).

The same recipe as the GLM builder: config, random weights from a seed (std 0.2, so routing depends on
the input; a non-zero router correction bias), a byte-level BPE tokenizer with Kimi's special tokens, a
chat template in Kimi's shape, and Kimi's processor over our PIL port of its image processor (transformers'
needs torchvision, which does not import beside the CPU torch). The text model is DeepSeek-V3's: MLA
attention (q and kv low-rank projections, a rotary part of 8 of each head's 24 query/key dims, values 16
wide), the first layer dense, then MoE layers of 16 experts in 4 groups (top-2 groups, top-4 experts,
sigmoid scores, renormalised, times 2.5) with a shared expert. The vision tower is MoonViT at toy widths:
14 px patches, 2x2 merge, so an image of 160 x 128 px pads to 168 x 140 and gives 12 x 10 patches, 30
visual tokens.
"""

from __future__ import annotations

from .byte_tokenizer import byte_level_tokenizer
from .tiny_glm import random_model

SPECIAL_TOKENS = ("[EOS]", "[BOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                  "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                  "<|kimi_k25_video_placeholder|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
INIT_STD = 0.2
PATCH, MERGE, MAX_SIDE = 14, 2, 16  # MAX_SIDE: patches per side at most (the real model's 512 px / 14)


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos="<|im_end|>", pad="[EOS]", bos="[BOS]")


def build_processor(spec):
    from ..models.kimi_k25 import KimiK25ImageProcessorPil, KimiK25ImageTextProcessor

    image_processor = KimiK25ImageProcessorPil(patch_size=PATCH, merge_size=MERGE,
                                               size={"max_height": MAX_SIDE * PATCH, "max_width": MAX_SIDE * PATCH})
    return KimiK25ImageTextProcessor(image_processor, build_tokenizer(), chat_template=CHAT_TEMPLATE)


def build_config(spec, tokenizer):
    from transformers import Kimi_K25Config

    token = tokenizer.convert_tokens_to_ids
    text = dict(
        model_type="deepseek_v3", vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=spec.moe_intermediate, n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True, max_position_embeddings=4096, initializer_range=INIT_STD,
        tie_word_embeddings=spec.tie_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=token("[BOS]"), eos_token_id=token("<|im_end|>"), pad_token_id=token("[EOS]"),
    )
    vision = dict(
        patch_size=PATCH, pos_emb_height=MAX_SIDE, pos_emb_width=MAX_SIDE, pos_emb_time=4,
        num_attention_heads=spec.vision_heads, num_hidden_layers=spec.vision_depth, hidden_size=spec.vision_hidden,
        intermediate_size=2 * spec.vision_hidden, merge_kernel_size=[MERGE, MERGE], initializer_range=INIT_STD,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    return Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=spec.vision_hidden,
        tie_word_embeddings=spec.tie_embeddings, image_token_id=token("<|media_pad|>"),
        video_token_id=token("<|kimi_k25_video_placeholder|>"), vision_start_token_id=token("<|media_begin|>"),
        vision_end_token_id=token("<|media_end|>"), initializer_range=INIT_STD,
    )


def build_tiny_kimi(spec, seed: int = 0):
    """`(model, processor)`: a random fp32 Kimi K2.5 in eval mode and its processor."""
    from transformers import Kimi_K25ForConditionalGeneration

    processor = build_processor(spec)
    return random_model(Kimi_K25ForConditionalGeneration, build_config(spec, processor.tokenizer), seed), processor

"""Tiny GLM-4.5V models (transformers `glm4v_moe`), built offline for tests: tiny.py's TinySpec with
`family="glm4v_moe"` lands here (`build_tiny_model` and `save_tiny_model` dispatch on it).

The same recipe as the Qwen builder: config, random weights from a seed, a byte-level BPE tokenizer with
GLM's special tokens, GLM-4.1V's PIL image processor (no torchvision) and a chat template in GLM's
shape. Two choices keep the random model from hiding bugs: weights drawn at std 0.2 (at transformers'
0.02 every layer is close to the identity and routing barely depends on the input), and a non-zero
router correction bias (a zero one would pass a loader that never reads it).
"""

from __future__ import annotations

import torch

from .byte_tokenizer import byte_level_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                  "<|video|>")

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
INIT_STD = 0.2
BIAS_STD = 0.1  # the router's e_score_correction_bias, against sigmoid scores in (0, 1)


def build_tokenizer():
    return byte_level_tokenizer(SPECIAL_TOKENS, eos="<|endoftext|>", pad="<|endoftext|>")


def build_processor(spec):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from ..models.glm4v_moe import Glm4vImageTextProcessor

    image_processor = Glm4vImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 28 * 28, "longest_edge": spec.max_image_pixels},
    )
    return Glm4vImageTextProcessor(image_processor, build_tokenizer(), chat_template=CHAT_TEMPLATE)


def build_config(spec, tokenizer):
    from transformers import Glm4vMoeConfig

    token = tokenizer.convert_tokens_to_ids
    rotary_half = spec.head_dim // 4  # partial_rotary_factor 0.5: rotary on half a head, M-RoPE over its half
    mrope = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, moe_intermediate_size=spec.moe_intermediate, n_routed_experts=spec.experts,
        num_experts_per_tok=spec.top_k, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=INIT_STD,
        tie_word_embeddings=spec.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope,
                         "partial_rotary_factor": 0.5},
        eos_token_id=[token("<|endoftext|>"), token("<|user|>")], pad_token_id=token("<|endoftext|>"),
    )
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads, out_hidden_size=spec.hidden, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, image_size=56, initializer_range=INIT_STD,
    )
    return Glm4vMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings,
        image_token_id=token("<|image|>"), video_token_id=token("<|video|>"),
        image_start_token_id=token("<|begin_of_image|>"), image_end_token_id=token("<|end_of_image|>"),
        video_start_token_id=token("<|begin_of_video|>"), video_end_token_id=token("<|end_of_video|>"),
        initializer_range=INIT_STD,
    )


def random_model(model_class, config, seed: int):
    """A random fp32 model in eval mode from `config`, deterministic from `seed`; every sigmoid router's
    `e_score_correction_bias` drawn at BIAS_STD (transformers makes them zero, which would pass a loader
    that never reads them); generation stops at the text config's end tokens."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * BIAS_STD)
    text = config.text_config
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    return model


def build_tiny_glm(spec, seed: int = 0):
    """`(model, processor)`: a random fp32 GLM-4.5V in eval mode and its processor."""
    from transformers import Glm4vMoeForConditionalGeneration

    processor = build_processor(spec)
    return random_model(Glm4vMoeForConditionalGeneration, build_config(spec, processor.tokenizer), seed), processor

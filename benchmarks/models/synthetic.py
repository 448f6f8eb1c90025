"""Full-size models with random weights, built on the machine that runs them (benchmarks).

`load_synthetic("qwen3-vl-30b-a3b", rules)` assembles a published model's real shapes exactly as
`vismmoe_kt.load` does, but a SyntheticReader makes each tensor on demand instead of reading a
checkpoint: nothing is downloaded and nothing is written to disk. `layers=N` keeps only the first N
decoder layers for hosts with less memory; `narrow=True` keeps the family's layout (experts, top-k,
dense and MoE layers, shared experts, the image pipeline and its visual-token count) at CPU-sized widths
and a small vocabulary, for sanity runs and tests. The tokenizer is the family's tiny byte-level one (its ids
are what the config names), so prompts cost more tokens than with the real vocabulary.

The models (SYNTHETIC_MODELS), each with where its numbers come from:
  qwen3-vl-30b-a3b  Qwen3-VL-30B-A3B-Instruct: 48 layers x 128 experts, top-8, hidden 2048, expert
                    intermediate 768; 62 GB of BF16 experts (one H200 holds it all)
  deepseek-ocr2     DeepSeek-OCR-2 (about 3.4B parameters): DeepSeek-MoE decoder, 12 layers (layer 0
                    dense), 64 routed + 2 shared experts, top-6, hidden 1280, expert intermediate 896;
                    11 x 64 experts of 6.9 MB = 4.8 GB of BF16 experts (one H200 holds it all)
  glm-4.5v          GLM-4.5V (106B): 46 layers (layer 0 dense), 128 routed + 1 shared expert, top-8,
                    hidden 4096, expert intermediate 1408; 45 x 128 experts of 34.6 MB = 199 GB of
                    BF16 experts: one H200 (141 GB) holds it only as a `layers=N` cut (N <= about 28
                    for all-on-gpu; offloaded configurations also need the host to hold the store)
  ernie-4.5-vl-28b-a3b  ERNIE-4.5-VL-28B-A3B: 28 layers (layer 0 dense), each MoE layer 64 text experts
                    (intermediate 1536) + 64 vision experts (512) + 2 shared, top-6, hidden 2560; 27 x 64
                    text experts of 23.6 MB = 40.8 GB and vision experts of 7.9 MB = 13.6 GB of BF16
                    (one H200 holds it all; decode reads only the text experts)
  llama-4-scout     Llama 4 Scout (17B active, 109B total): 48 layers, every one MoE with 16 routed experts
                    (one per token, the router's sigmoid scaling its input) + 1 shared, hidden 5120, expert
                    intermediate 8192; 48 x 16 experts of 252 MB = 193 GB of BF16 experts: one H200 (and
                    its host) holds it only as a `layers=N` cut (N = 16: 64 GB of experts)

Random weights route tokens almost uniformly over the experts: any figure that depends on routing
(hit rates, prefetch value) is not what a trained model would show (benchmarks use `--routing synthetic`).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from vismmoe_kt.core.loader import _build_on_meta, assemble, parse_dtype, pick_default_device
from vismmoe_kt.models import adapter_for
from vismmoe_kt.demo.tiny import TinySpec, build_processor

# Qwen3-VL-30B-A3B-Instruct's published shapes (vision + text); token ids come from our tokenizer.
QWEN3_VL_30B_A3B = {
    "family": "qwen3_vl_moe",
    "text": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                 num_experts=128, num_experts_per_tok=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
                 tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                  "mrope_interleaved": True}),
    "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                   patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                   deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
}
# DeepSeek-OCR-2's published shapes. Text: deepseek-ai/DeepSeek-OCR-2's config.json `language_config`
# (as mirrored on the Hub, and the same numbers in the transformers-converted config that
# hf-internal-testing/tiny-processor-deepseek_ocr2 carries: text_config, image_token_id 128815, `mlp_layer_types`
# dense + 11 sparse); routed_scaling_factor 1.0 and rope_theta 10000 are DeepseekV2Config's defaults, which the
# checkpoint leaves unset. (transformers 5.17's DeepseekOcr2TextConfig defaults are DeepSeek-V2's 4096-wide
# ones, not this model's.) Vision: SAM ViT-B is transformers' DeepseekOcr2SamVisionConfig defaults (768 wide, 12
# blocks, global attention at 2/5/8/11, neck 256 -> 512 -> 896 channels, 1024 px, patch 16); the encoder is
# DeepSeek's `build_qwen2_decoder_as_encoder` defaults (Qwen2-0.5B's shape: 24 layers, 896 wide, 14 heads,
# 2 kv heads, intermediate 4864, rope_theta 1e6). The processor is DeepSeek-OCR-2's: a 1024 px global view
# (256 visual tokens), 768 px tiles (144 each) for images wider than a tile.
DEEPSEEK_OCR2 = {
    "family": "deepseek_ocr2",
    "text": dict(vocab_size=129280, hidden_size=1280, intermediate_size=6848, num_hidden_layers=12,
                 num_attention_heads=10, num_key_value_heads=10, moe_intermediate_size=896, n_routed_experts=64,
                 n_shared_experts=2, num_experts_per_tok=6, routed_scaling_factor=1.0, topk_method="greedy",
                 n_group=1, topk_group=1, mlp_layer_types=["dense"] + ["sparse"] * 11, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "vision": dict(
        sam_config=dict(hidden_size=768, output_channels=256, num_hidden_layers=12, num_attention_heads=12,
                        image_size=1024, patch_size=16, window_size=14, global_attn_indexes=[2, 5, 8, 11],
                        downsample_channels=[512, 896]),
        encoder_config=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "processor": dict(global_pixels=1024, tile_pixels=768, patch_size=16, downsample_ratio=4),
    # the same layout at CPU-sized widths (`narrow=True`): every count above (layers, experts, top-k, shared
    # experts, the dense first layer, SAM's 16 px patches and the 256 / 144 visual tokens per view) kept, but a
    # vocabulary of 4096 (the tokenizer's ids are below 300; the full one's head would cost most of a CPU prefill)
    "narrow": dict(
        text=dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=2, moe_intermediate_size=64),
        sam_config=dict(hidden_size=64, output_channels=64, num_hidden_layers=2, num_attention_heads=2,
                        global_attn_indexes=[1], downsample_channels=[64, 96]),
        encoder_config=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2)),
}
# GLM-4.5V: transformers 5.17's Glm4vMoeConfig defaults, which its docstring names zai-org/GLM-4.5V's (text:
# GLM-4.5-Air's MoE, 46 layers, first_k_dense_replace 1, 128 experts top-8 + 1 shared, sigmoid routing with a
# correction bias, top-k renormalised; vision: 24 blocks, 1536 wide, patch 14, merge 2), with head_dim 128 and
# M-RoPE sections [8, 12, 12] over the rotary half of each head (GLM-4.5V's config.json).
GLM_45V = {
    "family": "glm4v_moe",
    "text": dict(vocab_size=151424, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                 num_attention_heads=96, num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408,
                 n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                 first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
                 max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                  "partial_rotary_factor": 0.5}),
    "vision": dict(depth=24, hidden_size=1536, intermediate_size=13696, num_heads=12, out_hidden_size=4096,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=336),
}
# ERNIE-4.5-VL-28B-A3B: transformers 5.17's Ernie4_5_VLMoeConfig defaults, which its docstring names
# baidu/ERNIE-4.5-VL-28B-A3B-PT's (text: 28 layers, the first dense, 64 text + 64 vision experts of 1536 / 512,
# top-6, 2 shared experts, 20 heads over 4 kv heads of 128, M-RoPE sections [22, 22, 20] (the checkpoint's
# freq_allocation 20), rope_theta 500000 as its config.json; vision: 32 blocks, 1280 wide, patch 14, merge 2).
# The published checkpoint ties its embeddings; the untied head here costs the same bytes.
ERNIE_45_VL_28B = {
    "family": "ernie4_5_vl_moe",
    "text": dict(vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28,
                 num_attention_heads=20, num_key_value_heads=4, head_dim=128, moe_intermediate_size=[1536, 512],
                 moe_num_experts=64, moe_k=6, moe_num_shared_experts=2, mlp_layer_types=["dense"] + ["sparse"] * 27,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, use_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [22, 22, 20]}),
    "vision": dict(depth=32, hidden_size=1280, intermediate_size=4 * 1280, num_heads=16, patch_size=14,
                   spatial_merge_size=2, hidden_act="quick_gelu"),
}
# Llama 4 Scout (meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json, which transformers 5.17's Llama4Config
# defaults follow): text 48 layers, 40 heads over 8 kv heads of 128, every layer MoE (interleave step 1), 16
# experts top-1 + a shared expert of 8192, a dense MLP width of 16384 (unused: no dense layer), no rotary in every
# 4th layer (temperature tuning there, floor 8192), chunked attention of 8192 (our context cap), llama3 rope
# scaling (its high and low frequency factors both 1.0, as published, which transformers warns about); vision 34 blocks, 1408 wide, 336 px tiles of 14 px patches pixel-shuffled 2 x 2 (144 tokens a tile),
# at most 16 tiles and the global one.
LLAMA_4_SCOUT = {
    "family": "llama4",
    "text": dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                 num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                 num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layer_interval=4,
                 attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                 use_qk_norm=True, max_position_embeddings=10485760, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    "vision": dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16,
                   image_size=336, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                   projector_output_dim=4096, vision_output_dim=4096, norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "processor": dict(tile=336, max_tiles=16),
}
SYNTHETIC_MODELS = {"qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B, "deepseek-ocr2": DEEPSEEK_OCR2, "glm-4.5v": GLM_45V,
                    "ernie-4.5-vl-28b-a3b": ERNIE_45_VL_28B, "llama-4-scout": LLAMA_4_SCOUT}
DEFAULT_MODEL = "qwen3-vl-30b-a3b"


def _shapes(name: str) -> dict[str, Any]:
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r}; choose one of {', '.join(SYNTHETIC_MODELS)}")
    return SYNTHETIC_MODELS[name]


def total_layers(name: str) -> int:
    """The published decoder-layer count of a synthetic model."""
    return _shapes(name)["text"]["num_hidden_layers"]


def synthetic_processor(name: str, max_image_pixels: int = 1024 * 1024):
    """The processor a synthetic model's prompts go through: the family's image processor at the published
    pixel sizes, with the family's tiny byte-level tokenizer (its special tokens name the config's ids)."""
    family = _shapes(name)["family"]
    spec = TinySpec(1, 1, 1, 1, 1, max_image_pixels=max_image_pixels, family=family)
    if family == "deepseek_ocr2":
        from vismmoe_kt.demo.tiny_dsocr2 import make_processor

        return make_processor(**_shapes(name)["processor"])
    if family == "glm4v_moe":
        from vismmoe_kt.demo.tiny_glm import build_processor as glm_processor

        return glm_processor(spec)
    if family == "ernie4_5_vl_moe":
        from vismmoe_kt.demo.tiny_ernie import build_processor as ernie_processor

        return ernie_processor(spec)
    if family == "llama4":
        from vismmoe_kt.demo.tiny_llama4 import build_processor as llama4_processor

        return llama4_processor(spec, **_shapes(name)["processor"])
    return build_processor(spec)


def synthetic_config(name: str, tokenizer: Any, layers: int | None = None, narrow: bool = False):
    """The model's config at its published shapes (the first `layers` decoder layers; `narrow`: CPU-sized widths)."""
    shapes = _shapes(name)
    if narrow and "narrow" not in shapes:
        raise ValueError(f"synthetic model {name!r} has no narrow variant (those that do: "
                         f"{', '.join(n for n, s in SYNTHETIC_MODELS.items() if 'narrow' in s)})")
    if layers is not None and not 1 <= layers <= shapes["text"]["num_hidden_layers"]:
        raise ValueError(f"layers must be in [1, {shapes['text']['num_hidden_layers']}] for {name}, got {layers}")
    text, vision = dict(shapes["text"]), {k: (dict(v) if isinstance(v, dict) else v) for k, v in shapes["vision"].items()}
    if narrow:
        text.update(shapes["narrow"]["text"])
        for part in ("sam_config", "encoder_config"):
            vision[part].update(shapes["narrow"][part])
    if layers is not None:
        text["num_hidden_layers"] = layers
        if "mlp_layer_types" in text:
            text["mlp_layer_types"] = text["mlp_layer_types"][:layers]
    token = tokenizer.convert_tokens_to_ids
    family = shapes["family"]
    if family == "deepseek_ocr2":
        from transformers import DeepseekOcr2Config

        from vismmoe_kt.demo.tiny_dsocr2 import BOS, EOS

        text.update(bos_token_id=token(BOS), eos_token_id=token(EOS), pad_token_id=token(EOS))
        return DeepseekOcr2Config(text_config=text, vision_config=vision, image_token_id=token("<image>"),
                                  tie_word_embeddings=False)
    if family == "glm4v_moe":
        from transformers import Glm4vMoeConfig

        text.update(eos_token_id=token("<|endoftext|>"), pad_token_id=token("<|endoftext|>"))
        return Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              image_token_id=token("<|image|>"), video_token_id=token("<|video|>"),
                              image_start_token_id=token("<|begin_of_image|>"),
                              image_end_token_id=token("<|end_of_image|>"),
                              video_start_token_id=token("<|begin_of_video|>"),
                              video_end_token_id=token("<|end_of_video|>"))
    if family == "ernie4_5_vl_moe":
        from transformers import Ernie4_5_VLMoeConfig

        text.update(eos_token_id=token("</s>"), pad_token_id=token("</s>"))
        return Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                    image_token_id=token("<|IMAGE_PLACEHOLDER|>"),
                                    video_token_id=token("<|VIDEO_PLACEHOLDER|>"),
                                    image_start_token_id=token("<|IMAGE_START|>"), image_end_token_id=token("<|IMAGE_END|>"),
                                    video_start_token_id=token("<|VIDEO_START|>"), video_end_token_id=token("<|VIDEO_END|>"))
    if family == "llama4":
        from transformers import Llama4Config

        text.update(bos_token_id=token("<|begin_of_text|>"), eos_token_id=token("<|eot|>"),
                    pad_token_id=token("<|finetune_right_pad|>"))
        return Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            image_token_index=token("<|patch|>"), boi_token_index=token("<|image_start|>"),
                            eoi_token_index=token("<|image_end|>"))
    from transformers import Qwen3VLMoeConfig

    text.update(eos_token_id=token("<|im_end|>"), pad_token_id=token("<|endoftext|>"))
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
                            vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))


def routed_expert_bytes(config: Any, dtype: str | torch.dtype = "bfloat16") -> int:
    """Bytes of every routed expert of `config`'s MoE layers in `dtype` (what an expert budget as a share
    of the experts is a share of)."""
    shape = adapter_for(config.model_type).moe_shape(config)
    return len(shape.moe_layers) * shape.num_experts * 3 * shape.hidden * shape.inter * parse_dtype(dtype).itemsize


class SyntheticReader:
    """The CheckpointReader interface, with every tensor made on demand from a seed.

    Tensors are generated on the GPU when one is present (fast) and moved where they are asked for.
    Norm weights are ones and biases zeros, other weights N(0, 0.02), so activations stay finite.
    """

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, seed: int = 0, name: str = "synthetic"):
        self.shapes, self.dtype, self.seed = shapes, dtype, seed
        self.model_dir = f"<{name}, random weights>"
        self.layout_fix = None
        self.device_map: dict[str, dict[str, Any]] = {}
        self.on_tensor = None
        self.make_on = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
        self.staging_device = self.make_on  # operators that copy weights into their own memory read from here

    def planned_device(self, module_key: str, fallback: torch.device | str) -> torch.device:
        return torch.device(self.device_map.get(module_key, {}).get("generate_device", fallback))

    def load_tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=self.dtype, device=device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=self.dtype, device=device)
        else:
            generator = torch.Generator(device=self.make_on).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor = torch.empty(shape, dtype=self.dtype, device=self.make_on).normal_(0.0, 0.02, generator=generator)
            tensor = tensor.to(device)
        if self.on_tensor is not None:
            self.on_tensor(name, tensor.numel() * tensor.element_size())
        return tensor

    def close(self) -> None:
        pass


def load_synthetic(name: str = DEFAULT_MODEL, rules: Any = None, *, layers: int | None = None,
                   dtype: str | torch.dtype = "bfloat16", seed: int = 0, progress: bool = True,
                   max_image_pixels: int = 1024 * 1024, narrow: bool = False, **overrides: Any):
    """Like `vismmoe_kt.load`, for a full-size random-weight model; returns `(model, processor)`."""
    processor = synthetic_processor(name, max_image_pixels)
    config = synthetic_config(name, processor.tokenizer, layers, narrow)
    return assemble_synthetic(config, processor, rules, dtype=dtype, seed=seed, name=name, progress=progress,
                              **overrides)


def assemble_synthetic(config: Any, processor: Any, rules: Any = None, *, dtype: str | torch.dtype = "bfloat16",
                       seed: int = 0, name: str = "synthetic", progress: bool = True, **overrides: Any):
    """`config`'s model with SyntheticReader's weights (`seed`), assembled as `vismmoe_kt.load` does."""
    start = time.perf_counter()
    adapter = adapter_for(config.model_type)
    meta = _build_on_meta(adapter, config)
    shapes = {n: t.shape for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    del meta
    reader = SyntheticReader(shapes, parse_dtype(dtype), seed, name)
    device = overrides.get("generate_device") or pick_default_device()
    model = assemble(config, adapter, reader, rules, device, progress, overrides)
    model.generation_config.eos_token_id = None  # random weights: decode the requested number of tokens
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.vismmoe.load_seconds = time.perf_counter() - start
    return model, processor

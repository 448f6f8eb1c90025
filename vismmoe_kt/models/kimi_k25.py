"""Kimi K2.5 (transformers `kimi_k25`, 5.x layout): MoonViT + DeepSeek-V3's text model.

Vision (`model.vision_tower`): MoonViT, a ViT over 14 px patches in raster order with 2-D axial rotary
and a learned position grid; each 2x2 window of patches is pooled into one visual token and projected
by `model.mm_projector`. Text (`model.language_model`, a DeepseekV3Model): 1-D RoPE; the first
`first_k_dense_replace` layers have a dense MLP, the others an MoE `mlp` with the router `gate` (sigmoid
scores, an fp32 `e_score_correction_bias` added for the choice only, grouped top-k over `n_group`
groups keeping `topk_group`, renormalised, times `routed_scaling_factor`), the fused experts `experts`
(`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) and `shared_experts`, a dense MLP the block adds.

Attention is MLA (multi-head latent attention): queries through a low-rank `q_a_proj` / `q_a_layernorm`
/ `q_b_proj` (or one `q_proj`), and per position one compressed latent, `kv_a_proj_with_mqa` split into
`kv_lora_rank` normed dims and `qk_rope_head_dim` rotary dims shared by every head. transformers'
attention writes those two latents to the cache (as a one-head key and value of widths kv_lora_rank
and qk_rope_head_dim) and expands them into per-head keys and values with `kv_b_proj` after reading it:
`kv_cache_shape` tells the engine's caches that shape, and the lean decode step runs the module itself.

The model hands its text model embeddings only (input_ids=None, no `visual_pos_masks`): `install_hooks`
passes it `input_ids == image_token_id` as GLM's adapter does. transformers' image processor for Kimi
needs torchvision: `KimiK25ImageProcessorPil` is the same pipeline over PIL and NumPy.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
from transformers.processing_utils import ImagesKwargs, ProcessorMixin

from . import kimi_k25_gguf
from .glm4v_moe import hand_text_model_image_mask
from .llama_cpp_keys import arch_keys, clip_keys, common_text_keys, deepseek_moe_keys, rope_parameters
from .qwen3_vl_moe import _read_chat_template
from .transformers_layout import (DeepseekMoeConfig, OneDimensionalRope, SigmoidRouting, TransformersLayout,
                                 pretrained_tokenizer_and_image_processor)

# the model's names -> the original checkpoint's (what `save_pretrained` writes too): the reverse of
# transformers' conversion mapping for kimi_k25 (conversion_mapping.py), first match wins. transformers
# renames every `blocks` to `layers` on load, so text layers may be stored under either: both are tried
_STORED = tuple((re.compile(pattern), stored) for pattern, stored in (
    (r"^model\.language_model\.layers\.", ("language_model.model.layers.", "language_model.model.blocks.")),
    (r"^model\.language_model\.", ("language_model.model.",)),
    (r"^lm_head\.", ("language_model.lm_head.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", (r"vision_tower.encoder.blocks.\1.norm0.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", (r"vision_tower.encoder.blocks.\1.norm1.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", (r"vision_tower.encoder.blocks.\1.mlp.fc0.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", (r"vision_tower.encoder.blocks.\1.mlp.fc1.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", (r"vision_tower.encoder.blocks.\1.wo.",)),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.[qkv]_proj\.", (r"vision_tower.encoder.blocks.\1.wqkv.",)),
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$", ("vision_tower.patch_embed.pos_emb.weight",)),
    (r"^model\.vision_tower\.", ("vision_tower.encoder.",)),
    (r"^model\.mm_projector\.in_proj\.", ("mm_projector.proj.0.",)),
    (r"^model\.mm_projector\.out_proj\.", ("mm_projector.proj.2.",)),
    (r"^model\.mm_projector\.", ("mm_projector.",)),
))
_VISION_QKV = re.compile(r"^model\.vision_tower\.layers\.\d+\.attn\.(?P<part>[qkv])_proj\.(weight|bias)$")


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)): Kimi's resize (transformers'
    image_processing_kimi_k25.navit_resize, which cannot be imported without torchvision): scale down,
    never up, to at most `max_patches` patches and `max_side` patches a side, then pad to whole merge
    windows."""
    patches_h, patches_w = max(1.0, height // patch_size), max(1.0, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / (patches_h * patches_w)), max_side * patch_size / height,
                max_side * patch_size / width)
    new_h = min(max(1, int(height * scale)), max_side * patch_size)
    new_w = min(max(1, int(width * scale)), max_side * patch_size)
    factor = merge_size * patch_size
    return (new_h, new_w), ((factor - new_h % factor) % factor + new_h, (factor - new_w % factor) % factor + new_w)


class KimiK25ImageProcessorKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


class KimiK25ImageProcessorPil(PilBackend):
    """Kimi K2.5's image processor over PIL and NumPy: resize (bicubic) within the patch budget, pad with
    zeros to whole 2x2 merge windows, rescale and normalise, cut into (patches, 3, 14, 14) in raster
    order with `image_grid_thw` (1, h, w): the outputs of transformers' Kimi_K25ImageProcessor."""

    do_resize = True
    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = KimiK25ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size: SizeDict, resample: Any, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any, patch_size: int,
                    merge_size: int, max_patches: int, return_tensors: Any, **kwargs: Any) -> BatchFeature:
        if size.max_height is None or size.max_height != size.max_width:
            raise ValueError(f"size must hold equal 'max_height' and 'max_width', got {size}")
        pixels, grids = [], []
        for image in images:  # (C, H, W)
            if do_resize:
                resized, padded = navit_resize(*image.shape[-2:], patch_size, merge_size, max_patches,
                                               size.max_height // patch_size)
                image = self.resize(image, SizeDict(height=resized[0], width=resized[1]), resample)
                image = self.pad([image], pad_size=SizeDict(height=padded[0], width=padded[1]))[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels, height, width = image.shape
            grid_h, grid_w = height // patch_size, width // patch_size
            patches = np.asarray(image, dtype=np.float32).reshape(channels, grid_h, patch_size, grid_w, patch_size)
            pixels.append(patches.transpose(1, 3, 0, 2, 4).reshape(grid_h * grid_w, channels, patch_size, patch_size))
            grids.append([1, grid_h, grid_w])
        return BatchFeature(data={"pixel_values": np.concatenate(pixels), "image_grid_thw": np.array(grids, dtype=np.int64)},
                            tensor_type=return_tensors)


class KimiK25ImageTextProcessor(Kimi_K25Processor):
    """Kimi K2.5's processor for images and text, without the video processor (which needs torchvision).
    Images and text behave exactly as in Kimi_K25Processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|media_pad|>", "<|kimi_k25_video_placeholder|>"
        ids = tokenizer.convert_tokens_to_ids
        self.image_token_id, self.video_token_id = ids(self.image_token), ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


class KimiK25Adapter(OneDimensionalRope, DeepseekMoeConfig, SigmoidRouting, TransformersLayout):
    model_types = ("kimi_k25",)
    llama_cpp_arch = "deepseek2"

    def model_class(self) -> type[nn.Module]:
        from transformers import Kimi_K25ForConditionalGeneration

        return Kimi_K25ForConditionalGeneration

    def checkpoint_name(self, name: str, config: Any) -> tuple[str, ...] | None:
        """Kimi K2.5's checkpoints keep the original layout (`language_model.model.layers.N`,
        `vision_tower.encoder.blocks.N` with a fused `wqkv`, `mm_projector.proj.0`, ...), which
        transformers renames on load."""
        for pattern, stored in _STORED:
            if pattern.match(name):
                return tuple(pattern.sub(candidate, name, count=1) for candidate in stored)
        return None

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size, config: Any = None) -> torch.Tensor:
        """A vision attention's q, k or v projection from the stored fused `wqkv`: its third along dim 0; q
        and k also from the original rotary layout (each head's dims in interleaved pairs) to the model's
        (the first halves of the pairs, then the second halves), as transformers' PermuteForRope does."""
        match = _VISION_QKV.match(name)
        if match is None or tensor.shape[0] != 3 * expected[0]:
            return tensor
        part = tensor.chunk(3, dim=0)["qkv".index(match["part"])]
        if match["part"] == "v":
            return part.contiguous()
        heads = int(config.vision_config.num_attention_heads)
        rows = part.shape[0]
        return part.reshape(heads, rows // heads // 2, 2, *part.shape[1:]).transpose(1, 2).reshape(part.shape).contiguous()

    def load_processor(self, model_dir: Path) -> KimiK25ImageTextProcessor:
        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, KimiK25ImageProcessorPil)
        return KimiK25ImageTextProcessor(image_processor, tokenizer, chat_template=_read_chat_template(model_dir, tokenizer))

    def gguf_names(self, name: str) -> tuple[str, ...] | None:
        return kimi_k25_gguf.gguf_names(name)

    def mmproj_source(self, name: str, config: Any) -> Any:
        return kimi_k25_gguf.mmproj_source(name, self.checkpoint_name(name, config), config.vision_config.num_hidden_layers)

    def gguf_parts(self, name: str, state: dict[str, torch.Tensor], config: Any) -> list[torch.Tensor] | None:
        return kimi_k25_gguf.gguf_parts(name, state, config)

    def from_gguf(self, name: str, parts: list[torch.Tensor], config: Any) -> torch.Tensor | None:
        return kimi_k25_gguf.from_gguf(name, parts, config)

    def config_from_gguf(self, text: Any, mmproj: Any, tokenizer: Any) -> Any:
        return kimi_k25_gguf.config_from_gguf(text, mmproj, tokenizer)

    def processor_from_gguf(self, mmproj: Any, tokenizer: Any, chat_template: str, family: str) -> Any:
        return kimi_k25_gguf.processor_from_gguf(mmproj, tokenizer, chat_template)

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `deepseek2` (its converter's DeepseekV2Model, which takes KimiK25ForConditionalGeneration;
        what its loader requires): MLA written as llama.cpp runs it, one KV head whose key is the latent
        and the rotary key (kv_lora_rank + qk_rope_head_dim wide) and whose value is the latent, the
        per-head widths as the *_mla lengths; the DeepSeek-V3 MoE with sigmoid scores over expert groups.
        No NextN/MTP layer is written (llama.cpp's converter skips them)."""
        from gguf import Keys

        text, arch, attention = config.text_config, "deepseek2", Keys.Attention
        rope = rope_parameters(text)
        return arch, common_text_keys(text, arch) | deepseek_moe_keys(text, arch, self.moe_layers_from_config(config), True) | \
            arch_keys(arch, {
                attention.HEAD_COUNT_KV: 1, attention.Q_LORA_RANK: text.q_lora_rank, attention.KV_LORA_RANK: text.kv_lora_rank,
                attention.KEY_LENGTH: text.kv_lora_rank + text.qk_rope_head_dim, attention.VALUE_LENGTH: text.kv_lora_rank,
                attention.KEY_LENGTH_MLA: text.qk_nope_head_dim + text.qk_rope_head_dim,
                attention.VALUE_LENGTH_MLA: text.v_head_dim, Keys.Rope.DIMENSION_COUNT: text.qk_rope_head_dim,
                # llama.cpp's converter writes a tenth of mscale_all_dim here and its loader undoes it
                Keys.Rope.SCALING_YARN_LOG_MUL: 0.1 * rope["mscale_all_dim"] if rope.get("mscale_all_dim") else None,
                # YaRN's betas, which its TextModel base writes where the rope parameters have them
                **({Keys.Rope.SCALING_YARN_BETA_FAST: _float(rope.get("beta_fast")),
                    Keys.Rope.SCALING_YARN_BETA_SLOW: _float(rope.get("beta_slow"))}
                   if rope.get("rope_type", rope.get("type")) == "yarn" else {})})

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """llama.cpp's `kimik25` projector (its converter's KimiK25Model): the image side its learned
        position grid covers, the grid itself (the converter's literal `vision.pos_emb_*` keys), the
        projector's GELU and LayerNorm epsilon, the merge window as the scale factor, the pixel budget."""
        from gguf import Keys

        vision, clip = config.vision_config, Keys.ClipVision
        patch = int(vision.patch_size)
        sizes = dict(image_size=vision.pos_emb_height * patch, patch_size=patch, embedding_length=vision.hidden_size,
                     feed_forward_length=vision.intermediate_size, block_count=vision.num_hidden_layers,
                     head_count=vision.num_attention_heads)
        images = getattr(processor, "image_processor", processor)
        return clip_keys("kimik25", sizes, processor, config.text_config.hidden_size) | {
            "vision.pos_emb_height": vision.pos_emb_height, "vision.pos_emb_width": vision.pos_emb_width,
            "vision.pos_emb_time": vision.pos_emb_time, clip.USE_GELU: True,
            clip.Attention.LAYERNORM_EPS: float(config.projection_layer_norm_eps),
            clip.Projector.SCALE_FACTOR: int(vision.merge_kernel_size[0]),
            clip.IMAGE_MIN_PIXELS: 8 * patch * patch, clip.IMAGE_MAX_PIXELS: int(images.max_patches) * patch * patch}

    # --- config ------------------------------------------------------------------------------
    def kv_cache_shape(self, config: Any) -> tuple[int, int, int]:
        """MLA caches one latent per position: kv_lora_rank normed dims (as the key) and the shared rotary
        key's qk_rope_head_dim (as the value), one head."""
        text = self.text_config(config)
        return 1, int(text.kv_lora_rank), int(text.qk_rope_head_dim)

    def attention_norms(self, attn: nn.Module) -> tuple[nn.Module, ...]:
        """The query and latent RMSNorms inside MLA (fused forwards on the GPU, as Qwen3's q/k norms)."""
        return tuple(n for n in (getattr(attn, "q_a_layernorm", None), getattr(attn, "kv_a_layernorm", None))
                     if n is not None)

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def vision_merge_size(self, config: Any) -> int:
        return int(config.vision_config.merge_kernel_size[0])

    def vision_last_attention(self, vision_tower: nn.Module) -> nn.Module:
        return vision_tower.layers[-1].attn

    def install_hooks(self, model: nn.Module) -> None:
        """Kimi_K25Model hands its text model no `visual_pos_masks`: hand it the image-token mask."""
        hand_text_model_image_mask(self, model)

    # --- attention read for visual-token saliency ---------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError(
            "Kimi K2.5's vision saliency: MoonViT keeps patches in raster order and pools 2x2 windows of them, "
            "which the vision attention's inputs do not tell apart; use saliency_source: llm (FastV-style)")

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions` in an MLA layer: the query from its
        low-rank projection, keys expanded from the latents (the module's own `expand_kv`), rotary on the
        last qk_rope_head_dim dims of each head (interleaved pairs where the config says so)."""
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                          apply_rotary_pos_emb_interleave)

        rotary = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
        last = hidden[:, -1:]
        q = attn.q_proj(last) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(last)))
        q_pass, q_rot = q.view(1, 1, -1, attn.qk_head_dim).transpose(1, 2).split(
            [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(hidden).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        latent, k_rot = attn.kv_a_layernorm(latent)[:, None], k_rot[:, None]  # (1, 1, S, .): one head
        cos, sin = position_embeddings
        q_rot, _ = rotary(q_rot, q_rot, cos[:, -1:], sin[:, -1:])
        _, k_rot = rotary(k_rot, k_rot, cos, sin)
        keys, _ = attn.expand_kv(latent, k_rot)  # (1, heads, S, qk_head_dim)
        q = torch.cat((q_pass, q_rot), dim=-1)
        probs = torch.softmax((q.float() @ keys.float().transpose(-1, -2)) * attn.scaling, dim=-1)  # (1, heads, 1, S)
        return probs.mean(dim=1)[0, 0, positions]

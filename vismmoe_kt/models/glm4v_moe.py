"""GLM-4.5V (transformers `glm4v_moe`, 5.x layout).

Text layers live at `model.language_model.layers.N`; the first `first_k_dense_replace` layers have a
dense MLP, the others an MoE `mlp` with the router `gate` (sigmoid scores, an fp32
`e_score_correction_bias` added for the choice only, grouped top-k, renormalised, times
`routed_scaling_factor`), the fused experts `experts` with `gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I) in memory, and `shared_experts`, a dense MLP every token runs, whose output the block adds
to the routed experts'. Attention has q/k/v biases, no q/k norms, and rotary on the first
`partial_rotary_factor` of each head only.

`save_pretrained` (and the published checkpoints) store the experts one by one
(`experts.N.gate_proj.weight` (I, H), `up_proj`, `down_proj` (H, I)): `checkpoint_sources` says how
the fused tensors are assembled from them. Image tokens are `input_ids == image_token_id`; unlike
Qwen3-VL, the model's forward hands its text model no `visual_pos_masks`, so `install_hooks` hooks it in
where our text model's forward needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.processing_utils import ProcessorMixin

from . import glm4v_moe_gguf
from .base import MmprojSource, ModelAdapter
from .llama_cpp_keys import arch_keys, clip_keys, common_text_keys, deepseek_moe_keys, partial_rotary, rope_sections
from .transformers_layout import (DeepseekMoeConfig, MropeVision, SigmoidRouting, TransformersLayout, gqa_last_token_attention,
                                 pretrained_tokenizer_and_image_processor)
from .qwen3_vl_moe import _read_chat_template, vision_attention_received



def hand_text_model_image_mask(adapter: ModelAdapter, model: nn.Module, outer: nn.Module | None = None) -> None:
    """For a model whose forward hands its text model no `visual_pos_masks` (GLM-4.5V, DeepSeek-OCR-2):
    where our text model's forward runs (an injected operator), a hook on the module that takes the
    input ids (`outer`; default `model.model`) remembers `input_ids == image_token_id` of each call and
    one on the text model passes it on."""
    text = adapter.text_model(model)
    if not getattr(text, "is_injected_operator", False):
        return  # transformers' own text model takes no mask
    token, seen = adapter.image_token_id(model.config), {}

    def remember(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["mask"] = ids == token if ids is not None and token is not None else None

    def hand_over(module, args, kwargs):
        mask = seen.pop("mask", None)
        if kwargs.get("visual_pos_masks") is None and mask is not None and bool(mask.any()):
            kwargs["visual_pos_masks"] = mask
        return args, kwargs

    (outer if outer is not None else model.model).register_forward_pre_hook(remember, with_kwargs=True)
    text.register_forward_pre_hook(hand_over, with_kwargs=True)


class Glm4vImageTextProcessor(Glm4vProcessor):
    """GLM-4.5V's processor for images and text, without the video processor (which needs
    torchvision, whose wheels on our machines do not import beside the CPU torch). Images and text
    behave exactly as in Glm4vProcessor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image|>", "<|video|>"
        ids = tokenizer.convert_tokens_to_ids
        self.image_token_id, self.video_token_id = ids(self.image_token), ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.video_start_id, self.video_end_id = ids("<|begin_of_video|>"), ids("<|end_of_video|>")


class Glm4vMoeAdapter(MropeVision, DeepseekMoeConfig, SigmoidRouting, TransformersLayout):
    model_types = ("glm4v_moe",)
    llama_cpp_arch = "glm4moe"

    def model_class(self) -> type[nn.Module]:
        from transformers import Glm4vMoeForConditionalGeneration

        return Glm4vMoeForConditionalGeneration

    def load_processor(self, model_dir: Path) -> Glm4vImageTextProcessor:
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, Glm4vImageProcessorPil)
        return Glm4vImageTextProcessor(image_processor, tokenizer, chat_template=_read_chat_template(model_dir, tokenizer))

    def gguf_names(self, name: str) -> tuple[str, ...] | None:
        return glm4v_moe_gguf.gguf_names(name)

    def mmproj_source(self, name: str, config: Any) -> MmprojSource | None:
        return glm4v_moe_gguf.mmproj_source(name, config.vision_config.depth)

    def config_from_gguf(self, text: Any, mmproj: Any, tokenizer: Any) -> Any:
        return glm4v_moe_gguf.config_from_gguf(text, mmproj, tokenizer)

    def processor_from_gguf(self, mmproj: Any, tokenizer: Any, chat_template: str, family: str) -> Any:
        return glm4v_moe_gguf.processor_from_gguf(mmproj, tokenizer, chat_template, Glm4vImageTextProcessor)

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `glm4moe` (its converter's Glm4MoeModel, which takes Glm4vMoeForConditionalGeneration;
        what src/models/glm4-moe.cpp reads): the rotary part of each head, the M-RoPE sections (without
        them llama.cpp refuses image embeddings), the DeepSeek-style MoE with sigmoid scores. No
        NextN/MTP layers are written, so the block count is the decoder's."""
        from gguf import Keys

        text, arch = config.text_config, "glm4moe"
        head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
        return arch, common_text_keys(text, arch) | deepseek_moe_keys(text, arch, self.moe_layers_from_config(config), True) | \
            arch_keys(arch, {Keys.Rope.DIMENSION_COUNT: int(head_dim * partial_rotary(text, 0.5)), Keys.Rope.DIMENSION_SECTIONS: rope_sections(text)})

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """llama.cpp's `glm4v` projector (its converter's Glm4VVisionModel): the tower's activation as
        use_silu / use_gelu, its RMS epsilon, the merge size and the processor's pixel bounds."""
        from gguf import Keys

        vision, clip = config.vision_config, Keys.ClipVision
        sizes = dict(image_size=vision.image_size, patch_size=vision.patch_size, embedding_length=vision.hidden_size,
                     feed_forward_length=vision.intermediate_size, block_count=vision.depth, head_count=vision.num_heads)
        act = str(vision.hidden_act).lower()
        activation = {"gelu": {clip.USE_GELU: True}, "silu": {clip.USE_SILU: True}}.get(act, {})
        pixels = getattr(getattr(processor, "image_processor", processor), "size", None) or {}
        return clip_keys("glm4v", sizes, processor, config.text_config.hidden_size) | activation | {
            clip.Attention.LAYERNORM_EPS: float(getattr(vision, "rms_norm_eps", 1e-5)),
            clip.SPATIAL_MERGE_SIZE: vision.spatial_merge_size,
            clip.IMAGE_MIN_PIXELS: pixels.get("shortest_edge"), clip.IMAGE_MAX_PIXELS: pixels.get("longest_edge")}

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def install_hooks(self, model: nn.Module) -> None:
        """Glm4vMoeModel hands its text model no `visual_pos_masks`: where our text model's forward runs
        (an injected operator), a hook on the model remembers `input_ids == image_token_id` of each call
        and one on the text model passes it on, so pruning, ReaLB's modality and the predictor's visual
        summary see the image tokens as they do for Qwen3-VL (text-only calls: no mask, as there)."""
        hand_text_model_image_mask(self, model)

    # --- attention read for visual-token saliency ---------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(patches,) mean attention received by each patch in `attn` (GLM's vision attention: Qwen-VL's shape)."""
        from transformers.models.glm4v_moe.modeling_glm4v_moe import apply_rotary_pos_emb_vision

        return vision_attention_received(attn, hidden, cu_seqlens, position_embeddings, apply_rotary_pos_emb_vision)

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions`, in a GLM text attention layer (no
        q/k norms; rotary on the leading part of each head, which `apply_rotary_pos_emb` handles)."""
        from transformers.models.glm4v_moe.modeling_glm4v_moe import apply_rotary_pos_emb

        return gqa_last_token_attention(attn, hidden, position_embeddings, positions, apply_rotary_pos_emb)

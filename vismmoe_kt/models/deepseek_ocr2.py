"""DeepSeek-OCR-2 (transformers `deepseek_ocr2`, 5.x layout).

Vision: a SAM encoder and a Qwen2-style encoder with learned queries (`model.vision_tower`), projected by
`model.multi_modal_projector`; a fixed number of visual tokens per view (global view, local tiles) and a
learned separator. Text (`model.language_model`): a DeepSeek-MoE decoder with standard multi-head
attention (no q/k norms, no biases, full 1-D RoPE: position ids (B, T), not M-RoPE); the layers whose
`mlp_layer_types` entry is "dense" have a dense MLP, the "sparse" ones an MoE `mlp` with the router
`gate` (softmax over every expert, greedy or group-limited top-k, *not* renormalised, times
`routed_scaling_factor`: not the fused softmax-top-k-renormalise router), the fused experts `experts`
(`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) and `shared_experts`, a dense MLP the block adds.

The model hands its text model embeddings only (input_ids=None, no `visual_pos_masks`): `install_hooks`
passes it `input_ids == image_token_id` as GLM's adapter does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.deepseek_ocr2.processing_deepseek_ocr2 import (DeepseekOcr2Processor,
                                                                        DeepseekOcr2ProcessorKwargs)

from .transformers_layout import (DeepseekMoeConfig, OneDimensionalRope, TransformersLayout, gqa_last_token_attention,
                                 pretrained_tokenizer_and_image_processor)
from .glm4v_moe import hand_text_model_image_mask
from .llama_cpp_keys import LLAMA_CPP_CHECKED, arch_keys, common_text_keys, deepseek_moe_keys
from .qwen3_vl_moe import _read_chat_template

# the model's names -> the published checkpoint's (what `save_pretrained` writes too): the reverse of
# transformers' conversion mapping for deepseek_ocr2 (conversion_mapping.py), first match wins
_STORED = tuple((re.compile(pattern), stored) for pattern, stored in (
    (r"^model\.language_model\.", "model."),
    (r"^model\.multi_modal_projector\.", "model.projector.layers."),
    (r"^model\.view_separator$", "model.view_seperator"),
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.layer_norm([12])\.", r"model.sam_model.blocks.\1.norm\2."),
    (r"^model\.vision_tower\.sam_encoder\.layers\.", "model.sam_model.blocks."),
    (r"^model\.vision_tower\.sam_encoder\.patch_embed\.projection\.", "model.sam_model.patch_embed.proj."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv1\.", "model.sam_model.neck.0."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm1\.", "model.sam_model.neck.1."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv2\.", "model.sam_model.neck.2."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm2\.", "model.sam_model.neck.3."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv1\.", "model.sam_model.net_2."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv2\.", "model.sam_model.net_3."),
    (r"^model\.vision_tower\.sam_encoder\.", "model.sam_model."),
    (r"^model\.vision_tower\.vision_encoder\.", "model.qwen2_model.model.model."),
    (r"^model\.vision_tower\.query_(768|1024)_resolution\.", r"model.qwen2_model.query_\1."),
))


class DeepseekOcr2ImageTextProcessor(DeepseekOcr2Processor):
    """DeepSeek-OCR-2's processor, which also takes text without images (transformers' raises on a
    prompt without one: our apps and batched requests send text-only turns). With images, exactly
    DeepseekOcr2Processor."""

    def __call__(self, images=None, text=None, **kwargs) -> BatchFeature:
        if images is not None and (not isinstance(images, (list, tuple)) or len(images)):
            return super().__call__(images=images, text=text, **kwargs)
        if text is None:
            raise ValueError("the processor needs text")
        output_kwargs = self._merge_kwargs(DeepseekOcr2ProcessorKwargs, tokenizer_init_kwargs=self.tokenizer.init_kwargs,
                                           **kwargs)
        text = [text] if isinstance(text, str) else list(text)
        if any(self.image_token in t for t in text):
            raise ValueError(f"the text holds {self.image_token} but no image was given")
        return_tensors = output_kwargs["text_kwargs"].pop("return_tensors", None)
        return BatchFeature(data=dict(self.tokenizer(text, **output_kwargs["text_kwargs"])), tensor_type=return_tensors)


class DeepseekOcr2Adapter(OneDimensionalRope, DeepseekMoeConfig, TransformersLayout):
    model_types = ("deepseek_ocr2",)
    llama_cpp_arch = "deepseek2-ocr"
    llama_cpp_gap = (f"llama.cpp has the text architecture deepseek2-ocr, but no mmproj projector for DeepSeek-OCR-2: "
                     f"its one DeepSeek-OCR projector, deepseekocr, is the first DeepSeek-OCR's SAM + CLIP-L tower, "
                     f"not OCR-2's SAM + Qwen2 encoder with learned queries (as of {LLAMA_CPP_CHECKED}); load "
                     f"DeepSeek-OCR-2 with --model_path DIR")

    def model_class(self) -> type[nn.Module]:
        from transformers import DeepseekOcr2ForConditionalGeneration

        return DeepseekOcr2ForConditionalGeneration

    def checkpoint_name(self, name: str, config: Any) -> str | None:
        """DeepSeek-OCR-2's checkpoints keep the original layout (`model.layers.N`, `model.sam_model`,
        `model.qwen2_model`, `model.projector`, ...), which transformers renames on load."""
        for pattern, stored in _STORED:
            renamed, count = pattern.subn(stored, name, count=1)
            if count:
                return renamed
        return None

    def load_processor(self, model_dir: Path) -> DeepseekOcr2ImageTextProcessor:
        from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import DeepseekOcr2ImageProcessorPil

        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, DeepseekOcr2ImageProcessorPil)
        saved = model_dir / "processor_config.json"
        options = json.loads(saved.read_text()) if saved.is_file() else {}
        return DeepseekOcr2ImageTextProcessor(image_processor, tokenizer,
                                              chat_template=_read_chat_template(model_dir, tokenizer),
                                              patch_size=options.get("patch_size", 16),
                                              downsample_ratio=options.get("downsample_ratio", 4))

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `deepseek2-ocr` (DeepSeek-V2's MoE without MLA: what src/models/deepseek2ocr.cpp
        reads; llama.cpp's converter writes it for DeepseekOCRForCausalLM, and in later versions for
        DeepseekOCR2ForCausalLM too): softmax scores, not renormalised, scaled; rotary over whole heads.
        llama.cpp builds this architecture's q/k/v square (heads == KV heads), as the published model is."""
        from gguf import Keys

        text, arch = config.text_config, "deepseek2-ocr"
        return arch, common_text_keys(text, arch) | deepseek_moe_keys(text, arch, self.moe_layers_from_config(config), False) | \
            arch_keys(arch, {Keys.Rope.DIMENSION_COUNT: text.head_dim or text.hidden_size // text.num_attention_heads})

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """None: llama.cpp's converter names DeepSeek-OCR-2's projector `deepseekocr2` only in versions
        newer than the gguf package we write with (whose VisionProjectorType stops at `deepseekocr`, the
        first DeepSeek-OCR's SAM + CLIP tower), and no mmproj layout of this tower is mapped here."""
        return None

    # --- config ------------------------------------------------------------------------------
    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule DeepseekOcr2TextDecoderLayer applies
        return [i for i, kind in enumerate(text.mlp_layer_types[:text.num_hidden_layers]) if kind == "sparse"]

    # The router is softmax -> top-k without renormalisation, times routed_scaling_factor: `fused_router`
    # stays None (the decode step calls the module); its probabilities are the base class's softmax.
    def routing_weights(self, config: Any, probabilities: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return probabilities.gather(-1, ids) * float(self.text_config(config).routed_scaling_factor)

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def vision_merge_size(self, config: Any) -> int:
        return 1  # visual tokens are the encoder's learned queries, one each: no patch merging

    def vision_last_attention(self, vision_tower: nn.Module) -> nn.Module:
        return vision_tower.vision_encoder.layers[-1].self_attn

    def install_hooks(self, model: nn.Module) -> None:
        """DeepseekOcr2Model hands its text model no `visual_pos_masks`: hand it the image-token mask. Its
        vision tower also convolves the pixels as given (Qwen's and GLM's towers cast them to their own
        dtype first): pixels arrive in float32 from the processor, so a BF16 model casts them here."""
        hand_text_model_image_mask(self, model)
        tower = self.vision_tower(model)

        def cast_pixels(module, args, kwargs):
            weight = next(module.parameters(), None)
            if args and weight is not None and args[0].is_floating_point() and args[0].dtype != weight.dtype:
                return (args[0].to(weight.dtype), *args[1:]), kwargs
            return args, kwargs

        tower.register_forward_pre_hook(cast_pixels, with_kwargs=True)

    # --- attention read for visual-token saliency ---------------------------------------------
    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions`, in a DeepSeek-OCR-2 text attention
        layer (no q/k norms, rotary over the whole head)."""
        from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import apply_rotary_pos_emb

        return gqa_last_token_attention(attn, hidden, position_embeddings, positions, apply_rotary_pos_emb)

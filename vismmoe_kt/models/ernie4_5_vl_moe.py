"""ERNIE-4.5-VL (transformers `ernie4_5_vl_moe`, 5.x layout): modality-separated experts.

Text layers live at `model.language_model.layers.N`; `mlp_layer_types` says which are dense (the first)
and which sparse. A sparse layer's `mlp` holds two expert sets, each a block with its own router `gate`
(softmax over fp32 logits, a correction bias added for the choice only, the chosen probabilities
renormalised) and fused experts `experts` (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)):
`text_moe`, which text tokens route to, and `vision_moe` (smaller experts: 512 wide against 1536 in the
28B model), which image tokens and their start/end markers route to (`moe_mm_token_type_ids` from the
processor), plus `shared_experts` every token runs.

The text experts are the layer's *primary* set, the one decode uses: generated tokens are text, so a
decode step never touches the vision experts (transformers' own generate drops the modality ids after
the prompt). `router`, `experts` and `moe_shape` speak of them, and every operator built for one expert
set per layer serves them unchanged. The vision experts are a second set (`expert_set` names it
"vision") that only a prefill with image tokens runs: the `VisionExperts` operator gives them their own
offload runtime and budget, so the GPU memory decode needs goes to the text experts; ReaLB's rule puts
its low-precision operator on the vision set only, where every token is an image token.

Checkpoints (the published ones, and what `save_pretrained` writes) keep the original layout: both sets in
one list of per-expert tensors (`mlp.experts.0..E-1` text, `E..2E-1` vision), routers as
`mlp.gate.weight` / `mlp.gate.weight_1` stored transposed (H, E), both correction biases stacked in
`mlp.moe_statics.e_score_correction_bias` (2, E), the text model without `language_model`, and the vision
tower as `model.vision_model`; `checkpoint_name`, `checkpoint_sources` and `to_model_layout` map them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor
from transformers.processing_utils import ProcessorMixin

from .base import VISION_SET, MoEShape
from .glm4v_moe import hand_text_model_image_mask
from .llama_cpp_keys import LLAMA_CPP_CHECKED, arch_keys, common_text_keys, moe_layer_step
from .qwen3_vl_moe import _read_chat_template, vision_attention_received
from .transformers_layout import (MropeVision, TransformersLayout, gqa_last_token_attention,
                                 pretrained_tokenizer_and_image_processor)

VISION = VISION_SET  # the name of the second expert set (`expert_set`)
_SETS = {"text_moe": 0, "vision_moe": 1}  # each set's place in the checkpoint's expert list and router list

# the model's tensor names -> the original checkpoint's, first match wins (the reverse of transformers'
# conversion mapping for ernie4_5_vl_moe, conversion_mapping.py)
_STORED = tuple((re.compile(pattern), stored) for pattern, stored in (
    (r"^model\.language_model\.(layers\.\d+\.mlp)\.text_moe\.gate\.weight$", r"model.\1.gate.weight"),
    (r"^model\.language_model\.(layers\.\d+\.mlp)\.vision_moe\.gate\.weight$", r"model.\1.gate.weight_1"),
    (r"^model\.language_model\.(layers\.\d+\.mlp)\.(?:text|vision)_moe\.gate\.moe_statics\.e_score_correction_bias$",
     r"model.\1.moe_statics.e_score_correction_bias"),
    (r"^model\.language_model\.", "model."),
    (r"^model\.vision_tower\.", "model.vision_model."),
    (r"^model\.resampler_model\.(spatial|temporal)_linear\.fc1\.", r"model.resampler_model.\1_linear.0."),
    (r"^model\.resampler_model\.(spatial|temporal)_linear\.fc2\.", r"model.resampler_model.\1_linear.2."),
    (r"^model\.resampler_model\.(spatial|temporal)_linear\.ln\.", r"model.resampler_model.\1_linear.3."),
))
_SET_TENSOR = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.(?P<set>text_moe|vision_moe)\.")
_FUSED = re.compile(r"^model\.language_model\.(?P<mlp>layers\.\d+\.mlp)\.(?P<set>text_moe|vision_moe)\.experts\."
                    r"(?P<tensor>gate_up_proj|down_proj)$")


class ErnieImageTextProcessor(Ernie4_5_VLMoeProcessor):
    """ERNIE-4.5-VL's processor for images and text, without the video processor (which needs torchvision,
    whose wheels on our machines do not import beside the CPU torch) and without a tokenizer class of its
    own: the special tokens are looked up by name. Images and text behave exactly as in
    Ernie4_5_VLMoeProcessor, `moe_mm_token_type_ids` included."""

    TOKENS = {"image": "<|IMAGE_PLACEHOLDER|>", "image_start": "<|IMAGE_START|>", "image_end": "<|IMAGE_END|>",
              "video": "<|VIDEO_PLACEHOLDER|>", "video_start": "<|VIDEO_START|>", "video_end": "<|VIDEO_END|>"}

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        for name, token in self.TOKENS.items():
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        return ProcessorMixin.save_pretrained(self, save_directory, push_to_hub, **kwargs)  # no video font to copy


class Ernie45VLMoeAdapter(MropeVision, TransformersLayout):
    model_types = ("ernie4_5_vl_moe",)
    llama_cpp_arch = "ernie4_5-moe"
    llama_cpp_gap = (f"llama.cpp has no mmproj projector for ERNIE-4.5-VL (no ERNIE entry among its clip projector "
                     f"types), and its text architecture ernie4_5-moe is ERNIE-4.5's text-only MoE, without the "
                     f"vision experts or M-RoPE (as of {LLAMA_CPP_CHECKED}); load ERNIE-4.5-VL with --model_path DIR")

    def model_class(self) -> type[nn.Module]:
        from transformers import Ernie4_5_VLMoeForConditionalGeneration

        return Ernie4_5_VLMoeForConditionalGeneration

    def load_processor(self, model_dir: Path) -> ErnieImageTextProcessor:
        from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
            Ernie4_5_VLMoeImageProcessorPil)

        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, Ernie4_5_VLMoeImageProcessorPil)
        return ErnieImageTextProcessor(image_processor, tokenizer, chat_template=_read_chat_template(model_dir, tokenizer))

    # --- checkpoint ------------------------------------------------------------------------------
    def checkpoint_name(self, name: str, config: Any) -> str | None:
        for pattern, stored in _STORED:
            renamed, count = pattern.subn(stored, name, count=1)
            if count:
                return renamed
        return None

    def checkpoint_sources(self, name: str, config: Any) -> tuple[tuple[str, ...], ...] | None:
        """A set's fused experts from the checkpoint's one list of per-expert tensors: text experts first,
        then vision experts, each `gate_proj` / `up_proj` (I, H) and `down_proj` (H, I)."""
        match = _FUSED.match(name)
        if match is None:
            return None
        count = int(self.text_config(config).moe_num_experts)
        first = _SETS[match["set"]] * count
        key = f"model.{match['mlp']}.experts"
        if match["tensor"] == "gate_up_proj":
            return tuple((f"{key}.{e}.gate_proj.weight", f"{key}.{e}.up_proj.weight") for e in range(first, first + count))
        return tuple((f"{key}.{e}.down_proj.weight",) for e in range(first, first + count))

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size, config: Any = None) -> torch.Tensor:
        """A router's weight, stored transposed (H, E); a set's correction bias, its row of the stored (2, E)."""
        match = _SET_TENSOR.match(name)
        if match is None:
            return tensor
        if name.endswith(".gate.weight") and tensor.shape == expected[::-1]:
            return tensor.t().contiguous()
        if name.endswith("e_score_correction_bias") and tensor.shape[0] == len(_SETS):
            return tensor[_SETS[match["set"]]:_SETS[match["set"]] + 1].reshape(expected).contiguous()
        return tensor

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `ernie4_5-moe` (its converter's Ernie4_5MoeModel; what src/models/ernie4-5-moe.cpp
        reads): the text experts and the shared expert, the MoE layers' start and interval. llama.cpp's
        text-only architecture has no place for the vision experts or M-RoPE, so such a file holds the
        text side only (no converter of llama.cpp's takes ERNIE-4.5-VL; there is no mmproj for it)."""
        from gguf import Keys

        text, arch, llm = config.text_config, "ernie4_5-moe", Keys.LLM
        moe = self.moe_layers_from_config(config)
        width, shared = int(text.moe_intermediate_size[0]), int(text.moe_num_shared_experts or 0)
        return arch, common_text_keys(text, arch) | arch_keys(arch, {
            llm.EXPERT_COUNT: text.moe_num_experts, llm.EXPERT_USED_COUNT: text.moe_k,
            llm.EXPERT_FEED_FORWARD_LENGTH: width, llm.EXPERT_SHARED_COUNT: shared,
            # the shared experts run as one MLP this wide (the model's own rule; llama.cpp's converter
            # derives the same number for the published checkpoints from intermediate_size)
            llm.EXPERT_SHARED_FEED_FORWARD_LENGTH: width * shared if shared else None,
            llm.LEADING_DENSE_BLOCK_COUNT: moe[0] if moe else text.num_hidden_layers,
            llm.INTERLEAVE_MOE_LAYER_STEP: moe_layer_step(text.mlp_layer_types[:text.num_hidden_layers])})

    # --- config ------------------------------------------------------------------------------
    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule Ernie4_5_VLMoeDecoderLayer applies
        return [i for i, kind in enumerate(text.mlp_layer_types[:text.num_hidden_layers]) if kind == "sparse"]

    def moe_shape(self, config: Any) -> MoEShape:
        return self._set_shape(config, 0)

    def _set_shape(self, config: Any, index: int) -> MoEShape:
        text = self.text_config(config)
        return MoEShape(int(text.moe_num_experts), int(text.moe_k), int(text.hidden_size),
                        int(text.moe_intermediate_size[index]), tuple(self.moe_layers_from_config(config)))

    def expert_set(self, module_name: str) -> str | None:
        return VISION if ".vision_moe." in f"{module_name}." else None

    def expert_set_shape(self, config: Any, expert_set: str | None) -> MoEShape:
        if expert_set is None:
            return self.moe_shape(config)
        if expert_set != VISION:
            raise ValueError(f"ERNIE-4.5-VL has no expert set {expert_set!r} (only {VISION!r} besides the text experts)")
        return self._set_shape(config, 1)

    # --- the model's parts -------------------------------------------------------------------
    def experts_key(self, layer: int) -> str:
        return f"model.language_model.layers.{layer}.mlp.text_moe.experts"

    def router(self, layer: nn.Module) -> nn.Module | None:
        block = getattr(layer.mlp, "text_moe", None)
        return block.gate if block is not None else None

    def experts(self, layer: nn.Module) -> nn.Module | None:
        block = getattr(layer.mlp, "text_moe", None)
        return block.experts if block is not None else None

    def visual_router(self, layer: nn.Module) -> nn.Module | None:
        block = getattr(layer.mlp, "vision_moe", None)
        return block.gate if block is not None else None

    def modality_argument(self) -> str | None:
        return "moe_mm_token_type_ids"

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def install_hooks(self, model: nn.Module) -> None:
        """The model hands its text model no `visual_pos_masks`: GLM's hooks pass it `input_ids ==
        image_token_id` (pruning, ReaLB's modality and the predictor's visual summary need it)."""
        hand_text_model_image_mask(self, model)

    # --- attention read for visual-token saliency ---------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import apply_rotary_pos_emb_vision

        return vision_attention_received(attn, hidden, cu_seqlens, position_embeddings, apply_rotary_pos_emb_vision)

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions` in an ERNIE text attention layer (no q/k
        norms; ERNIE's own rotary, whose frequencies are pre-rotated for its M-RoPE layout)."""
        from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import apply_rotary_pos_emb

        return gqa_last_token_attention(attn, hidden, position_embeddings, positions, apply_rotary_pos_emb)

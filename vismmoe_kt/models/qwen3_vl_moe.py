"""Qwen3-VL-MoE (transformers `qwen3_vl_moe`, 5.x layout).

Text layers live at `model.language_model.layers.N`; an MoE layer's `mlp` holds the router `gate`
(softmax in fp32, top-k, renormalised) and the fused experts `experts` with `gate_up_proj` (E, 2I, H)
and `down_proj` (E, H, I). There are no shared experts. Image tokens are `input_ids == image_token_id`.

Checkpoints on the hub store the fused experts transposed ((E, H, 2I) and (E, I, H)), while
`save_pretrained` writes the in-memory layout; transformers tells them apart by shape, and so do we.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from ..errors import LoadError
from .base import ModelAdapter

_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Qwen3VLImageTextProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor for images and text, without the video processor.

    The stock processor insists on a video processor, which needs torchvision; the torchvision
    wheels on our machines do not import beside the CPU torch. Images and text behave exactly as in
    Qwen3VLProcessor.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        ids = tokenizer.convert_tokens_to_ids
        self.image_token_id, self.video_token_id = ids(self.image_token), ids(self.video_token)
        self.vision_start_token_id, self.vision_end_token_id = ids(self.vision_start_token), ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def _read_chat_template(model_dir: Path, tokenizer: Any) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    as_json = model_dir / "chat_template.json"
    if as_json.exists():
        return json.loads(as_json.read_text(encoding="utf-8"))["chat_template"]
    return getattr(tokenizer, "chat_template", None)


class Qwen3VLMoeAdapter(ModelAdapter):
    model_types = ("qwen3_vl_moe",)

    def model_class(self) -> type[nn.Module]:
        from transformers import Qwen3VLMoeForConditionalGeneration

        return Qwen3VLMoeForConditionalGeneration

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size) -> torch.Tensor:
        if name.endswith(_EXPERT_TENSORS) and tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected:
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def load_processor(self, model_dir: Path) -> Qwen3VLImageTextProcessor:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise LoadError(f"{model_dir}: cannot load the tokenizer or image processor ({exc})") from None
        template = _read_chat_template(model_dir, tokenizer)
        return Qwen3VLImageTextProcessor(image_processor, tokenizer, chat_template=template)

    def text_config(self, config: Any) -> Any:
        return config.text_config

    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule Qwen3VLMoeTextDecoderLayer applies
        return [i for i in range(text.num_hidden_layers)
                if i not in (text.mlp_only_layers or []) and text.num_experts > 0 and (i + 1) % text.decoder_sparse_step == 0]

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.language_model.layers

    def router(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "gate", None) if self.experts(layer) is not None else None

    def experts(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "experts", None)

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def image_token_mask(self, config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids == config.image_token_id

"""ModelAdapter: where one model family keeps the parts our operators care about.

Operators and the runtime never name Hugging Face classes or attribute paths; they ask the adapter
of the loaded model: the decoder layers, which of them are MoE layers, each layer's router, routed
experts and shared experts (if the family has them), the vision tower, the image-token mask, and
how checkpoint tensors map onto the model's parameters. Adding a family (DeepSeek-VL2, Kimi-VL as
remote-code models from a local directory, GLM-4.5V) is one file in this package plus one line in
the registry (`vismmoe_kt/models/__init__.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


class ModelAdapter:
    #: `config.model_type` values this adapter serves
    model_types: tuple[str, ...] = ()
    #: load the modelling code shipped in the model directory (remote-code families)
    trust_remote_code: bool = False

    # --- construction and checkpoint -------------------------------------------------------
    def model_class(self) -> type[nn.Module]:
        raise NotImplementedError

    def build(self, config: Any) -> nn.Module:
        """Instantiate the model from its config (the loader calls this under meta-device init)."""
        return self.model_class()._from_config(config)

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size) -> torch.Tensor:
        """Turn a stored tensor whose shape differs from the parameter into the model's layout."""
        return tensor

    def load_processor(self, model_dir: Path) -> Any:
        raise NotImplementedError

    # --- structure -------------------------------------------------------------------------
    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def moe_layers_from_config(self, config: Any) -> list[int]:
        """Indices of the decoder layers that are MoE layers, from the config alone (before the model exists)."""
        raise NotImplementedError

    def moe_layer_indices(self, model: nn.Module) -> list[int]:
        return [i for i, layer in enumerate(self.decoder_layers(model)) if self.experts(layer) is not None]

    def router(self, layer: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def experts(self, layer: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def shared_experts(self, layer: nn.Module) -> nn.Module | None:
        return None

    def vision_tower(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def image_token_mask(self, config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

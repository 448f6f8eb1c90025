"""The module layout transformers' VL-MoE families share, as adapter defaults.

Qwen3-VL-MoE, GLM-4.5V and DeepSeek-OCR-2 all keep their text model at `model.model.language_model`
with `layers`, `embed_tokens`, `norm` and `rotary_emb`; decoder layers with `self_attn`,
`input_layernorm`, `post_attention_layernorm` and an `mlp` that, in MoE layers, holds `gate`, `experts`
and (where the family has them) `shared_experts`; routers that return (logits, top-k weights, top-k
ids); RMSNorms with `variance_epsilon`. A family adapter derives from this and overrides what differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import ModelAdapter


class TransformersLayout(ModelAdapter):
    def text_config(self, config: Any) -> Any:
        return config.text_config if hasattr(config, "text_config") else config

    # --- the model's parts -------------------------------------------------------------------
    def text_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def output_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def layers_of(self, text: nn.Module) -> nn.ModuleList:
        return text.layers

    def token_embedding(self, text: nn.Module) -> nn.Module:
        return text.embed_tokens

    def final_norm(self, text: nn.Module) -> nn.Module:
        return text.norm

    def rotary(self, text: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return text.rotary_emb(hidden, position_ids)

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def input_norm(self, layer: nn.Module) -> nn.Module:
        return layer.input_layernorm

    def post_attention_norm(self, layer: nn.Module) -> nn.Module:
        return layer.post_attention_layernorm

    def feed_forward(self, layer: nn.Module) -> nn.Module:
        return layer.mlp

    def router(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "gate", None) if self.experts(layer) is not None else None

    def experts(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "experts", None)

    def shared_experts(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.mlp, "shared_experts", None) if self.experts(layer) is not None else None

    def expert_activation(self, experts: nn.Module):
        return experts.act_fn

    # --- routing -----------------------------------------------------------------------------
    def routed_experts(self, router_output: Any) -> torch.Tensor:
        return router_output[2]  # the top-k routers: (logits, top-k weights or scores, top-k indices)

    def with_routing(self, router_output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        logits, scores, _ = router_output
        return logits, weights.to(scores.dtype), ids

    def rms_norm_params(self, norm: nn.Module) -> tuple[torch.Tensor, float] | None:
        if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
            return norm.weight, float(norm.variance_epsilon)
        return None

    def image_token_id(self, config: Any) -> int | None:
        return getattr(config, "image_token_id", None)

"""The module layout transformers' VL-MoE families share, as adapter defaults.

Qwen3-VL-MoE, GLM-4.5V and DeepSeek-OCR-2 all keep their text model at `model.model.language_model`
with `layers`, `embed_tokens`, `norm` and `rotary_emb`; decoder layers with `self_attn`,
`input_layernorm`, `post_attention_layernorm` and an `mlp` that, in MoE layers, holds `gate`, `experts`
and (where the family has them) `shared_experts`; routers that return (logits, top-k weights, top-k
ids); RMSNorms with `variance_epsilon`. A family adapter derives from this and overrides what differs.
The mixins below hold what several families share beyond the layout: DeepSeek-MoE's config names
(`DeepseekMoeConfig`), plain 1-D RoPE (`OneDimensionalRope`), Qwen-VL's M-RoPE and ViT (`MropeVision`),
sigmoid routers (`SigmoidRouting`); `gqa_last_token_attention` reads a grouped-query attention layer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LoadError
from .base import ModelAdapter, MoEShape

_FUSED = re.compile(r"^(?P<key>.*\.mlp\.experts)\.(?P<tensor>gate_up_proj|down_proj)$")


def fused_experts_sources(name: str, count: int) -> tuple[tuple[str, ...], ...] | None:
    """`checkpoint_sources` for checkpoints that store the routed experts one by one
    (`experts.N.gate_proj.weight` (I, H), `up_proj`, `down_proj` (H, I): what `save_pretrained` writes for
    GLM-4.5V, DeepSeek-OCR-2 and Kimi K2.5, and their published checkpoints): fused gate_up from each
    expert's gate and up, fused down from each expert's down."""
    match = _FUSED.match(name)
    if match is None:
        return None
    key = match["key"]
    if match["tensor"] == "gate_up_proj":
        return tuple((f"{key}.{e}.gate_proj.weight", f"{key}.{e}.up_proj.weight") for e in range(count))
    return tuple((f"{key}.{e}.down_proj.weight",) for e in range(count))



def pretrained_tokenizer_and_image_processor(model_dir: Path, image_processor_class: type) -> tuple[Any, Any]:
    """A model directory's tokenizer and image processor (of the family's PIL class), offline; a LoadError
    that names the directory where either is missing or unreadable."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return tokenizer, image_processor_class.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LoadError(f"{model_dir}: cannot load the tokenizer or image processor ({exc})") from None


class TransformersLayout(ModelAdapter):
    def text_config(self, config: Any) -> Any:
        return config.text_config if hasattr(config, "text_config") else config

    # --- the model's parts -------------------------------------------------------------------
    def text_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def output_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def experts_key(self, layer: int) -> str:
        return f"model.language_model.layers.{layer}.mlp.experts"

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

    def router_output(self, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        return logits, weights, ids

    def rms_norm_params(self, norm: nn.Module) -> tuple[torch.Tensor, float] | None:
        if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
            return norm.weight, float(norm.variance_epsilon)
        return None

    def image_token_id(self, config: Any) -> int | None:
        return getattr(config, "image_token_id", None)


class OneDimensionalRope:
    """Adapter methods for a text model with plain 1-D RoPE (DeepSeek-OCR-2, Kimi K2.5): one row of
    position ids, which are the token indices with no offset (images do not shorten positions)."""

    def position_rows(self) -> int:
        return 1

    def rotary(self, text: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return text.rotary_emb(hidden, position_ids[0] if position_ids.ndim == 3 else position_ids)

    def rope_index(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = inputs["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(1, ids.shape[0], -1)
        return positions, torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device)


class MropeVision:
    """Adapter methods for the Qwen-VL vision line (Qwen3-VL-MoE, GLM-4.5V, ERNIE-4.5-VL): a ViT whose
    `blocks` end in the attention read for saliency, patches merged `spatial_merge_size`^2 to a token, and
    M-RoPE positions from the model's own `get_rope_index`, whose per-sequence offset (`rope_deltas`) the
    model keeps for decode."""

    def vision_merge_size(self, config: Any) -> int:
        return int(config.vision_config.spatial_merge_size)

    def vision_last_attention(self, vision_tower: nn.Module) -> nn.Module:
        return vision_tower.blocks[-1].attn

    def rope_index(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                          image_grid_thw=inputs.get("image_grid_thw"))

    def rope_delta(self, model: nn.Module) -> torch.Tensor | None:
        return model.model.rope_deltas

    def set_rope_delta(self, model: nn.Module, delta: torch.Tensor | None) -> None:
        model.model.rope_deltas = delta


def gqa_last_token_attention(attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor, apply_rotary_pos_emb: Any, qk_norm: bool = False) -> torch.Tensor:
    """Head-averaged attention of the last token to `positions` in a grouped-query text attention layer
    with `q_proj`/`k_proj` (`hidden` is that layer's input after its input norm; batch 1), the family's
    own `apply_rotary_pos_emb` (partial or pre-rotated rotary is its business) and, where `qk_norm`, the
    per-head `q_norm`/`k_norm` before the rotary."""
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden[:, -1:]).view(1, 1, -1, attn.head_dim)
    k = attn.k_proj(hidden).view(shape)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    k = k.repeat_interleave(attn.num_key_value_groups, dim=1)  # grouped-query attention where kv heads < heads
    probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * attn.scaling, dim=-1)  # (1, heads, 1, S)
    return probs.mean(dim=1)[0, 0, positions]


class SigmoidRouting:
    """Adapter methods for DeepSeek-V3-style sigmoid routers (GLM-4.5V, Kimi K2.5): an fp32
    `e_score_correction_bias` added for the choice only, grouped top-k, renormalised, scaled. The decode
    step calls the module (`fused_router` stays None); the probabilities an offload cache ranks experts by
    are the sigmoid scores, before the bias."""

    def router_probabilities(self, router_logits: torch.Tensor) -> torch.Tensor:
        return router_logits.float().sigmoid()

    def routing_weights(self, config: Any, probabilities: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen scores, renormalised where `norm_topk_prob`, times `routed_scaling_factor`."""
        text = self.text_config(config)
        weights = probabilities.gather(-1, ids)
        if text.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights * float(text.routed_scaling_factor)


class DeepseekMoeConfig:
    """Adapter methods for text configs in DeepSeek-MoE's names (GLM-4.5V, DeepSeek-OCR-2, Kimi K2.5):
    `n_routed_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` a token, the first
    `first_k_dense_replace` layers dense; checkpoints store the experts one by one."""

    def checkpoint_sources(self, name: str, config: Any) -> tuple[tuple[str, ...], ...] | None:
        return fused_experts_sources(name, int(self.text_config(config).n_routed_experts))

    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule the decoder layers apply
        return [i for i in range(text.num_hidden_layers) if i >= text.first_k_dense_replace and text.n_routed_experts > 0]

    def moe_shape(self, config: Any) -> MoEShape:
        text = self.text_config(config)
        return MoEShape(text.n_routed_experts, text.num_experts_per_tok, text.hidden_size, text.moe_intermediate_size,
                        tuple(self.moe_layers_from_config(config)))

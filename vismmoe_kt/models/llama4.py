"""Llama 4 (transformers `llama4`, 5.x layout: Llama4ForConditionalGeneration).

Layout: the vision tower `vision_model` (a ViT over square tiles of the picture, a class token, 2-D
complex rotary; its `vision_adapter` pixel-shuffles each 2x2 window of patches into one visual token),
`multi_modal_projector`, and the text model at `language_model.model` (a Llama4ForCausalLM holds it
and its own `lm_head`). Decoder layers have `self_attn`, `input_layernorm`, `post_attention_layernorm`
and a `feed_forward`: in the layers of the text config's `moe_layers` (every `interleave_moe_layer_step`-th)
an MoE block with the router `router` (a linear layer: top-k logits, the sigmoid of the chosen ones),
the fused experts `experts` and `shared_expert`, a dense MLP every token runs; elsewhere a dense MLP.

What differs from the other families, and how the adapter handles it:
- the routed experts' *input* is scaled by the router score (`expert(score * x)`, not `score * expert(x)`).
  `build` gives the model our MoE block (`Llama4MoeBlock`): a router returning (logits, weights, ids), fused
  experts in our operators' layout (gate_up (E, 2I, H), down (E, H, I): transformers' are (E, H, 2I) and
  (E, I, H), which `to_model_layout` transposes at load) with the operators' call `experts(hidden, ids,
  weights)` and Llama 4's meaning; where a rule replaces the experts, `install_hooks` puts a forward
  pre-hook on the operator that scales its input rows by the weights and hands it weights of one, so
  `weights * expert(x)` becomes `expert(weights * x)`. That is exact for one expert per token, which
  every Llama 4 checkpoint routes: a config with `num_experts_per_tok` > 1 is refused at load.
- rotary is complex (`freqs_cis`): `rotary` packs it as (real, imag), each with the position appended as a
  last column, the (cos, sin) pair our text model's forward and the lean decode step carry; the
  attention (`Llama4PackedRopeAttention`, transformers' own for anything else) unpacks it, and reads the
  positions for the temperature tuning of the layers without rotary (`attn_temperature_tuning`), where
  transformers counts the cache's length (a host read our captured decode step cannot make).
- the layers with rotary attend within chunks of `attention_chunk_size` positions; our forward uses plain
  causal masks, so the context is capped there (`context_length`) and a longer prompt is refused.

The model's forward hands its text model embeddings only (no `visual_pos_masks`): `install_hooks` passes
it `input_ids == image_token_id` (`<|patch|>`) as GLM's adapter does. transformers' image processor for
Llama 4 needs torchvision: `Llama4ImageProcessorPil` (llama4_images.py) is the same pipeline over PIL and NumPy.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextExperts, Llama4TextMLP

from ..errors import InputError, LoadError
from . import llama4_gguf
from .base import MoEShape
from .glm4v_moe import hand_text_model_image_mask
from .llama4_images import Llama4ImageProcessorPil, Llama4ImageTextProcessor
from .llama_cpp_keys import arch_keys, clip_keys, common_text_keys
from .qwen3_vl_moe import _read_chat_template
from .transformers_layout import OneDimensionalRope, TransformersLayout, pretrained_tokenizer_and_image_processor

_FUSED = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")
_SCALED = "_vismmoe_scales_input"  # marks an experts operator whose input the pre-hook scales


# --- the text model's MoE block, in our operators' terms ---------------------------------------------------
class Llama4TopKRouter(nn.Linear):
    """Llama 4's router as the other families' routers answer: (logits (T, E), weights (T, K), ids (T, K));
    the weights are the sigmoid of the chosen logits (transformers' Llama4Router's scores)."""

    def __init__(self, config: Any):
        super().__init__(config.hidden_size, config.num_local_experts, bias=False)
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = super().forward(hidden)
        top, ids = torch.topk(logits, self.top_k, dim=1)
        return logits, torch.sigmoid(top.float()).to(top.dtype), ids


class Llama4FusedExperts(nn.Module):
    """The routed experts in our operators' layout, gate_up (E, 2I, H) and down (E, H, I), called as
    `experts(hidden (T, H), ids (T, K), weights (T, K))` with Llama 4's meaning: each chosen expert runs on
    the token scaled by its weight (`sum_k expert_k(w_k x)`)."""

    def __init__(self, config: Any):
        super().__init__()
        self.num_experts, inter, hidden = config.num_local_experts, config.intermediate_size, config.hidden_size
        # left unfilled: the loader builds this under init_empty_weights and fills it from the checkpoint (zeros
        # would first allocate and write every expert's bytes, 8 GB a layer for Llama 4 Scout)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == expert)
            rows = hidden[token] * top_k_weights[token, slot, None].to(hidden.dtype)
            gate, up = nn.functional.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            out.index_add_(0, token, nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert]).to(out.dtype))
        return out


class _StockExpertsNotBuilt(nn.Module):
    """Stands in for transformers' Llama4TextExperts while `build` makes the stock model, whose MoE blocks it
    replaces at once: transformers makes those experts' gate_up with torch.zeros, which init_empty_weights moves
    to the meta device only after allocating and filling it (2.7 GB a layer for Llama 4 Scout)."""

    def __init__(self, config: Any):
        super().__init__()
        # what transformers' weight init touches, on the meta device (empty, nothing to fill)
        self.gate_up_proj = nn.Parameter(torch.empty(0, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(0, device="meta"))


@contextmanager
def _stock_experts_not_built():
    from transformers.models.llama4 import modeling_llama4

    original = modeling_llama4.Llama4TextExperts
    modeling_llama4.Llama4TextExperts = _StockExpertsNotBuilt
    try:
        yield
    finally:
        modeling_llama4.Llama4TextExperts = original


class Llama4MoeBlock(nn.Module):
    """transformers' Llama4TextMoe with our router and experts (same tensor names): the shared expert's
    output plus the routed experts'; returns (output, router logits) as Llama4TextMoe does."""

    def __init__(self, config: Any):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.experts = Llama4FusedExperts(config)
        self.router = Llama4TopKRouter(config)
        self.shared_expert = Llama4TextMLP(config)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, self.hidden_dim)
        logits, weights, ids = self.router(flat)
        return self.shared_expert(flat) + self.experts(flat, ids, weights), logits


def scale_expert_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook for an experts operator of Llama 4 (one expert per token): its input rows scaled by
    the router weights, the weights made one, so the operator's `weights * expert(x)` is Llama 4's
    `expert(weights * x)`."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs.pop(name) for name in names[len(args):] if name in kwargs]
    hidden, ids, weights = values[:3]
    return (hidden * weights.to(hidden.dtype).view(-1, 1), ids, torch.ones_like(weights)), kwargs


def cast_pixels(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook for Llama 4's vision tower: the pixels in the tower's dtype. The model hands its tower
    the processor's float32 pixels as they come, which a BF16 checkpoint's patch embedding cannot take (the
    other families' models cast them themselves)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)  # (the tower, or an
    if dtype is None:                                                                     # operator wrapping it)
        return args, kwargs
    if args and torch.is_floating_point(args[0]) and args[0].dtype != dtype:
        args = (args[0].to(dtype), *args[1:])
    if torch.is_tensor(kwargs.get("pixel_values")) and kwargs["pixel_values"].dtype != dtype:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(dtype)
    return args, kwargs


# --- attention with the packed rotary -----------------------------------------------------------------------
def pack_rotary(freqs_cis: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's complex rotary (B, T, D/2) as a (cos, sin)-shaped pair: (real, imag), each with the positions
    (B, T) appended as a last column (fp32: exact up to 2**24)."""
    column = positions.to(torch.float32)[..., None]
    return torch.cat([freqs_cis.real, column], dim=-1), torch.cat([freqs_cis.imag, column], dim=-1)


def unpack_rotary(position_embeddings: Any, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(freqs_cis (B, T, D/2) complex, positions (B, T) fp32) from a packed pair, or from transformers' own
    complex tensor (a prefill from an empty cache: positions 0..T-1)."""
    if isinstance(position_embeddings, (tuple, list)):
        real, imag = position_embeddings
        return torch.complex(real[..., :-1].float(), imag[..., :-1].float()), real[..., -1].float()
    return position_embeddings, torch.arange(length, device=device, dtype=torch.float32)[None]


def temperature_scales(attn: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """(B, T, 1, 1) query scales of a layer without rotary under `attn_temperature_tuning` (transformers')."""
    scales = torch.log1p(torch.floor((positions + 1.0) / attn.floor_scale)) * attn.attn_scale + 1.0
    return scales[..., None, None]


def project_queries_keys(attn: nn.Module, hidden_q: torch.Tensor, hidden_k: torch.Tensor, freqs_q: torch.Tensor,
                         freqs_k: torch.Tensor, positions_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries (B, Tq, heads, D), keys (B, Tk, kv heads, D)) of a Llama 4 text attention: projections, rotary
    where the layer has it, the L2 q/k norm where it has one, temperature tuning where it has no rotary."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    q = attn.q_proj(hidden_q).view(*hidden_q.shape[:-1], -1, attn.head_dim)
    k = attn.k_proj(hidden_k).view(*hidden_k.shape[:-1], -1, attn.head_dim)
    if attn.use_rope:
        q, _ = apply_rotary_emb(q, q, freqs_q.to(q.device))
        _, k = apply_rotary_emb(k, k, freqs_k.to(k.device))
    if hasattr(attn, "qk_norm"):
        q, k = attn.qk_norm(q), attn.qk_norm(k)
    if attn.attn_temperature_tuning and not attn.use_rope:
        q = (q * temperature_scales(attn, positions_q.to(q.device))).to(q.dtype)
    return q, k


class Llama4PackedRopeAttention(Llama4TextAttention):
    """transformers' Llama4TextAttention, which also takes the packed (cos, sin) pair (`pack_rotary`) as its
    position embeddings: our text model's forward and the lean decode step hand it that, and it reads
    the temperature-tuning positions from it. Given transformers' complex tensor, transformers' forward."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: torch.Tensor | None,
                past_key_values: Any = None, **kwargs: Any):
        if not isinstance(position_embeddings, (tuple, list)):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama4.modeling_llama4 import eager_attention_forward

        freqs, positions = unpack_rotary(position_embeddings, hidden_states.shape[1], hidden_states.device)
        query, key = project_queries_keys(self, hidden_states, hidden_states, freqs, freqs, positions)
        value = self.v_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = interface(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


# --- the adapter -----------------------------------------------------------------------------------------------
class Llama4Adapter(OneDimensionalRope, TransformersLayout):
    model_types = ("llama4",)
    llama_cpp_arch = "llama4"

    def model_class(self) -> type[nn.Module]:
        from transformers import Llama4ForConditionalGeneration

        return Llama4ForConditionalGeneration

    def build(self, config: Any) -> nn.Module:
        """transformers' model with our MoE blocks (`Llama4MoeBlock`) and attention (`Llama4PackedRopeAttention`).
        Refused: a config routing more than one expert per token (the operators' input scaling is exact for
        one), and experts whose stored layout cannot be told from ours by shape (hidden_size = I or 2I)."""
        text = self.text_config(config)
        if int(text.num_experts_per_tok) != 1:
            raise LoadError(f"Llama 4 with num_experts_per_tok={text.num_experts_per_tok}: vismmoe-kt serves Llama 4's "
                            f"input-scaled experts for one expert per token only (every published Llama 4 routes one)")
        hidden, inter = int(text.hidden_size), int(text.intermediate_size)
        if hidden in (inter, 2 * inter):
            raise LoadError(f"Llama 4 with hidden_size {hidden} and intermediate_size {inter}: the stored experts' "
                            f"layout (E, H, 2I) / (E, I, H) cannot be told from ours (E, 2I, H) / (E, H, I) by shape "
                            f"when H is I or 2I, and vismmoe-kt converts by shape")
        with _stock_experts_not_built():
            model = super().build(config)
        for layer in self.layers_of(self.text_model(model)):
            layer.self_attn.__class__ = Llama4PackedRopeAttention  # no state of its own: a forward that takes both
            if layer.is_moe_layer:
                layer.feed_forward = Llama4MoeBlock(text)
        return model

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size, config: Any = None) -> torch.Tensor:
        """transformers' fused experts, gate_up (E, H, 2I) and down (E, I, H), in our layout (E, 2I, H) and (E, H, I)."""
        if _FUSED.search(name) and tensor.ndim == 3 and tensor.shape != expected and \
                tensor.shape == (expected[0], expected[2], expected[1]):
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def load_processor(self, model_dir: Path) -> Llama4ImageTextProcessor:
        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, Llama4ImageProcessorPil)
        saved = model_dir / "processor_config.json"
        options = json.loads(saved.read_text()) if saved.is_file() else {}
        return Llama4ImageTextProcessor(image_processor, tokenizer, chat_template=_read_chat_template(model_dir, tokenizer),
                                        patch_size=options.get("patch_size", 14),
                                        pixel_shuffle_ratio=options.get("pixel_shuffle_ratio", 0.5))

    # --- config ------------------------------------------------------------------------------
    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule Llama4TextDecoderLayer applies (moe_layers from the interleave step)
        return [i for i in range(text.num_hidden_layers) if i in text.moe_layers]

    def moe_shape(self, config: Any) -> MoEShape:
        text = self.text_config(config)
        return MoEShape(int(text.num_local_experts), int(text.num_experts_per_tok), int(text.hidden_size),
                        int(text.intermediate_size), tuple(self.moe_layers_from_config(config)))

    def gguf_names(self, name: str) -> tuple[str, ...] | None:
        return llama4_gguf.gguf_names(name)

    def mmproj_source(self, name: str, config: Any) -> Any:
        return llama4_gguf.mmproj_source(name, config.vision_config.num_hidden_layers)

    def config_from_gguf(self, text: Any, mmproj: Any, tokenizer: Any) -> Any:
        return llama4_gguf.config_from_gguf(text, mmproj, tokenizer)

    def processor_from_gguf(self, mmproj: Any, tokenizer: Any, chat_template: str, family: str) -> Any:
        return llama4_gguf.processor_from_gguf(mmproj, tokenizer, chat_template)

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `llama4` (its converter's Llama4Model; what its loader requires: the RMS epsilon,
        the experts' width, the MoE interval): the dense MLPs' width as feed_forward_length, rotary over
        whole heads, the chunk of the chunked layers as the sliding window (0: every layer full), the
        attention temperature tuning's floor and scale (where the config tunes it)."""
        from gguf import Keys

        text, arch, llm = config.text_config, "llama4", Keys.LLM
        chunked = any(kind == "chunked_attention" for kind in getattr(text, "layer_types", None) or ("chunked_attention",))
        return arch, common_text_keys(text, arch) | arch_keys(arch, {
            llm.FEED_FORWARD_LENGTH: text.intermediate_size_mlp, llm.EXPERT_FEED_FORWARD_LENGTH: text.intermediate_size,
            llm.EXPERT_COUNT: text.num_local_experts, llm.EXPERT_USED_COUNT: text.num_experts_per_tok,
            llm.INTERLEAVE_MOE_LAYER_STEP: text.interleave_moe_layer_step, Keys.Rope.DIMENSION_COUNT: text.head_dim,
            Keys.Attention.SLIDING_WINDOW: int(text.attention_chunk_size or 0) if chunked else 0,
            Keys.Attention.TEMPERATURE_LENGTH: int(text.floor_scale) if text.attn_temperature_tuning else None,
            Keys.Attention.TEMPERATURE_SCALE: float(text.attn_scale) if text.attn_temperature_tuning else None})

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """llama.cpp's `llama4` projector (its converter's Llama4VisionModel): GELU, the tower's norm
        epsilon, the pixel shuffle as the projector's scale factor, the processor's tile count."""
        from gguf import Keys

        vision, clip = config.vision_config, Keys.ClipVision
        sizes = dict(image_size=vision.image_size, patch_size=vision.patch_size, embedding_length=vision.hidden_size,
                     feed_forward_length=vision.intermediate_size, block_count=vision.num_hidden_layers,
                     head_count=vision.num_attention_heads)
        return clip_keys("llama4", sizes, processor, config.text_config.hidden_size) | {
            clip.USE_GELU: True, clip.Attention.LAYERNORM_EPS: float(vision.norm_eps),
            clip.Projector.SCALE_FACTOR: int(round(1.0 / vision.pixel_shuffle_ratio)),
            clip.PREPROC_MAX_TILES: getattr(getattr(processor, "image_processor", processor), "max_patches", None)}

    def context_length(self, config: Any) -> int:
        """At most `attention_chunk_size`: within one chunk Llama 4's chunked attention is plain causal attention,
        which is what our forward and decode step compute."""
        text = self.text_config(config)
        chunk = getattr(text, "attention_chunk_size", None)
        return int(min(text.max_position_embeddings, chunk)) if chunk else int(text.max_position_embeddings)

    # --- the model's parts -------------------------------------------------------------------
    def text_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def output_head(self, model: nn.Module) -> nn.Module:
        return model.language_model.lm_head

    def experts_key(self, layer: int) -> str:
        return f"language_model.model.layers.{layer}.feed_forward.experts"

    def feed_forward(self, layer: nn.Module) -> nn.Module:
        return layer.feed_forward

    def router(self, layer: nn.Module) -> nn.Module | None:
        return layer.feed_forward.router if self.experts(layer) is not None else None

    def experts(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer.feed_forward, "experts", None)

    def shared_experts(self, layer: nn.Module) -> nn.Module | None:
        return layer.feed_forward.shared_expert if self.experts(layer) is not None else None

    def expert_weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2I, H), down (E, H, I)): transformers' own Llama4TextExperts' tensors transposed."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if isinstance(experts, Llama4TextExperts):
            return gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up, down

    def rms_norm_params(self, norm: nn.Module) -> tuple[torch.Tensor, float] | None:
        return None  # Llama4TextRMSNorm (`eps`, not `variance_epsilon`) runs as the module: transformers' arithmetic

    # --- routing -----------------------------------------------------------------------------
    def routed_experts(self, router_output: Any) -> torch.Tensor:
        """The (T, K) ids: ours return (logits, weights, ids); transformers' own Llama4Router (scores (T, E), zero
        but at the chosen expert, logits), one expert per token."""
        if len(router_output) == 2:
            return router_output[0].argmax(dim=-1, keepdim=True)
        return router_output[2]

    def router_probabilities(self, router_logits: torch.Tensor) -> torch.Tensor:
        return router_logits.float().sigmoid()

    def routing_weights(self, config: Any, probabilities: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The sigmoid of the chosen logit, not renormalised."""
        return probabilities.gather(-1, ids)

    # --- vision and positions ----------------------------------------------------------------
    def rotary(self, text: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids[0] if position_ids.ndim == 3 else position_ids
        return pack_rotary(text.rotary_emb(hidden, positions), positions)

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.vision_model

    def vision_merge_size(self, config: Any) -> int:
        return int(round(1 / float(config.vision_config.pixel_shuffle_ratio)))

    def vision_last_attention(self, vision_tower: nn.Module) -> nn.Module:
        return vision_tower.model.layers[-1].self_attn

    def install_hooks(self, model: nn.Module) -> None:
        """The vision tower's pixels cast to its dtype; where a rule replaced the routed experts, the input-scaling
        pre-hook on the operator; where our text model's forward runs, the image-token mask handed to it (the model hands it embeddings only) and
        prompts longer than `context_length` refused."""
        tower = self.vision_tower(model)
        if not getattr(tower, "_vismmoe_casts_pixels", False):
            tower.register_forward_pre_hook(cast_pixels, with_kwargs=True)
            tower._vismmoe_casts_pixels = True
        for layer in self.decoder_layers(model):
            experts = self.experts(layer)
            if experts is not None and not isinstance(experts, Llama4FusedExperts) and not getattr(experts, _SCALED, False):
                experts.register_forward_pre_hook(scale_expert_input, with_kwargs=True)
                setattr(experts, _SCALED, True)
        if not getattr(self.text_model(model), "is_injected_operator", False):
            return
        hand_text_model_image_mask(self, model, outer=model)
        limit = self.context_length(model.config)

        def refuse_long(module, args, kwargs):
            tokens = kwargs.get("input_ids", args[0] if args else None)
            if tokens is None:
                tokens = kwargs.get("inputs_embeds")
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            if tokens is not None and past + tokens.shape[1] > limit:
                raise InputError(f"Llama 4 context of {past + tokens.shape[1]} tokens: vismmoe-kt serves at most "
                                 f"attention_chunk_size = {limit} tokens (one chunk of its chunked attention)")
        model.register_forward_pre_hook(refuse_long, with_kwargs=True)

    # --- attention read for visual-token saliency ---------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor | None,
                           position_embeddings: Any) -> torch.Tensor:
        """(patches,) head-averaged attention each patch receives within its tile in Llama 4's vision attention
        (the class token's row left out), in the order pixel shuffle groups them: each visual token's 2x2
        patches consecutive, tiles in order."""
        from transformers.models.llama4.modeling_llama4 import (Llama4VisionRotaryEmbedding, pixel_shuffle,
                                                                vision_apply_rotary_emb)

        freqs = Llama4VisionRotaryEmbedding._compute_freqs_ci(attn.config).to(hidden.device)
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        q, k = vision_apply_rotary_emb(attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape), freqs)
        q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()  # (tiles, heads, P + 1, D)
        received = torch.zeros(hidden.shape[:2], device=hidden.device)
        for head in range(q.shape[1]):  # one head at a time keeps memory at tiles x P x P
            probs = torch.softmax(q[:, head] @ k[:, head].transpose(-1, -2) * attn.scaling, dim=-1)
            received += probs.mean(dim=1)
        received = received[:, :-1] / q.shape[1]  # the class token is last
        ratio = float(attn.config.pixel_shuffle_ratio)
        return pixel_shuffle(received[..., None], ratio).reshape(-1)

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: Any,
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions` in a Llama 4 text attention layer: rotary
        (where the layer has it) from the packed pair or transformers' complex tensor, the L2 q/k norm, the
        temperature tuning of layers without rotary."""
        freqs, where = unpack_rotary(position_embeddings, hidden.shape[1], hidden.device)
        q, k = project_queries_keys(attn, hidden[:, -1:], hidden, freqs[:, -1:], freqs, where[:, -1:])
        q, k = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(attn.num_key_value_groups, dim=1)
        probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * attn.scaling, dim=-1)  # (1, heads, 1, S)
        return probs.mean(dim=1)[0, 0, positions]

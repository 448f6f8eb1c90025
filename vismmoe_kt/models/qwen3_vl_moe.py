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
from transformers import vision_utils
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from ..errors import InputError, LoadError
from .base import DecodeAttentionParts, MmprojSource, MoEShape, VisionAttentionParts
from .gguf_tensor_names import name_map
from .llama_cpp_keys import (arch_keys, clip_keys, common_text_keys, image_size_from_positions, rope_sections,
                             stored_float)
from .transformers_layout import (MropeVision, TransformersLayout, gqa_last_token_attention,
                                 pretrained_tokenizer_and_image_processor)

_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
LLAMA_CPP_QWEN_VL_TOKENS = (8, 4096)  # llama.cpp's bounds on a Qwen-VL picture's merged tokens, where a file has none
_TEXT = "model.language_model."
_VISUAL = "model.visual."
# llama.cpp's names for the text model (convert_hf_to_gguf.py, arch qwen3vlmoe); the fused gate_up
# experts are two GGUF tensors, (E, I, H) each, concatenated along dim 1
_GGUF_GLOBAL = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
_GGUF_LAYER = {
    "self_attn.q_proj.weight": ("attn_q.weight",), "self_attn.k_proj.weight": ("attn_k.weight",),
    "self_attn.v_proj.weight": ("attn_v.weight",), "self_attn.o_proj.weight": ("attn_output.weight",),
    "self_attn.q_norm.weight": ("attn_q_norm.weight",), "self_attn.k_norm.weight": ("attn_k_norm.weight",),
    "input_layernorm.weight": ("attn_norm.weight",), "post_attention_layernorm.weight": ("ffn_norm.weight",),
    "mlp.gate.weight": ("ffn_gate_inp.weight",),
    "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight",),
}


def vision_attention_received(attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor], rotary) -> torch.Tensor:
    """(patches,) head-averaged attention each patch receives within its image, in a vision attention with
    a fused `qkv` (Qwen-VL's, and GLM-4.xV's after it), recomputed from its inputs; `rotary` is the
    family's apply_rotary_pos_emb_vision. One image reads nothing back from the device (its bounds are the
    patches'); several read their bounds once and are computed apart (a mask over all of them would cost the
    square of every patch together: gigabytes for a long video)."""
    length = hidden.shape[0]
    q, k, _ = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotary(q, k, *position_embeddings)
    bounds = [0, length] if cu_seqlens is None or cu_seqlens.numel() <= 2 else cu_seqlens.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks = q[start:end].transpose(0, 1).float(), k[start:end].transpose(0, 1).float()  # (heads, L, d)
        received = torch.zeros(end - start, device=hidden.device)
        for head in range(qs.shape[0]):  # one head at a time keeps memory at L x L
            probs = torch.softmax(qs[head] @ ks[head].T * attn.scaling, dim=-1)
            received += probs.mean(dim=0)
        out.append(received / qs.shape[0])
    return out[0] if len(out) == 1 else torch.cat(out)


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


class Qwen3VLMoeAdapter(MropeVision, TransformersLayout):
    model_types = ("qwen3_vl_moe",)
    llama_cpp_arch = "qwen3vlmoe"

    def model_class(self) -> type[nn.Module]:
        from transformers import Qwen3VLMoeForConditionalGeneration

        return Qwen3VLMoeForConditionalGeneration

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size, config: Any = None) -> torch.Tensor:
        if name.endswith(_EXPERT_TENSORS) and tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected:
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def hub_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(1, 2).contiguous() if name.endswith(_EXPERT_TENSORS) and tensor.dim() == 3 else tensor

    def gguf_names(self, name: str) -> tuple[str, ...] | None:
        if name == "lm_head.weight":
            return ("output.weight",)
        if not name.startswith(_TEXT):
            return None  # the vision tower: llama.cpp writes it to a separate mmproj file
        rest = name[len(_TEXT):]
        if rest in _GGUF_GLOBAL:
            return (_GGUF_GLOBAL[rest],)
        parts = rest.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
            return tuple(f"blk.{parts[1]}.{suffix}" for suffix in _GGUF_LAYER[parts[2]])
        return None

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """llama.cpp's `qwen3vlmoe` hyperparameters (its converter's Qwen3MoeModel and Qwen3VLMoeTextModel;
        what its loader refuses a file without): the M-RoPE sections padded to four, the DeepStack
        layers' count."""
        from gguf import Keys

        text, arch = config.text_config, "qwen3vlmoe"
        return arch, common_text_keys(text, arch) | arch_keys(arch, {
            Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: text.moe_intermediate_size, Keys.LLM.EXPERT_COUNT: text.num_experts,
            Keys.LLM.EXPERT_USED_COUNT: text.num_experts_per_tok, Keys.Rope.DIMENSION_SECTIONS: rope_sections(text),
            Keys.LLM.NUM_DEEPSTACK_LAYERS: len(getattr(config.vision_config, "deepstack_visual_indexes", ()) or ())})

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """llama.cpp's `qwen3vl_merger` projector (its converter's Qwen3VLVisionModel): the image side its
        learned positions cover, GELU, the merge size, the text model's RMS epsilon for the tower's norms
        (as the converter takes it), which blocks feed a DeepStack merger."""
        from gguf import Keys

        vision, clip = config.vision_config, Keys.ClipVision
        deepstack = set(vision.deepstack_visual_indexes or ())
        sizes = dict(image_size=image_size_from_positions(vision.num_position_embeddings, vision.patch_size),
                     patch_size=vision.patch_size, embedding_length=vision.hidden_size,
                     feed_forward_length=vision.intermediate_size, block_count=vision.depth, head_count=vision.num_heads)
        pixels = getattr(getattr(processor, "image_processor", processor), "size", None) or {}
        return clip_keys("qwen3vl_merger", sizes, processor, config.text_config.hidden_size) | {
            clip.IMAGE_MIN_PIXELS: pixels.get("shortest_edge"), clip.IMAGE_MAX_PIXELS: pixels.get("longest_edge"),
            clip.USE_GELU: True, clip.SPATIAL_MERGE_SIZE: vision.spatial_merge_size,
            clip.Attention.LAYERNORM_EPS: float(config.text_config.rms_norm_eps),
            clip.IS_DEEPSTACK_LAYERS: [i in deepstack for i in range(vision.depth)]}

    def config_from_gguf(self, text: Any, mmproj: Any, tokenizer: Any) -> Any:
        """The inverse of `gguf_metadata` and `mmproj_metadata`. What llama.cpp does not write comes from
        the tensors (the vocabulary from the embedding, tied embeddings where there is no `output.weight`,
        the learned positions' count, the patch embedding's time slices) and the tokenizer (the special
        tokens' ids); Qwen3-VL's fixed choices (interleaved M-RoPE, every layer MoE) are its own."""
        from transformers import Qwen3VLMoeConfig

        arch, family = self.llama_cpp_arch, "qwen3_vl_moe (llama.cpp's qwen3vlmoe)"
        need = lambda meta, key: meta.need(key.format(arch=arch), family)  # noqa: E731
        vocab = text.get(f"{arch}.vocab_size") or text.shape("token_embd.weight", family)[0]
        head_dim = need(text, "{arch}.attention.key_length")
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
        missing = [name for name, index in ids.items() if index is None or index == tokenizer.unk_token_id]
        if missing:
            raise LoadError(f"{text.path}: {family}: the vocabulary lacks the vision tokens of {', '.join(missing)}")
        sections = [int(v) for v in need(text, "{arch}.rope.dimension_sections")][:3]
        tie = "output.weight" not in text.shapes
        eos, pad = text.get("tokenizer.ggml.eos_token_id"), text.get("tokenizer.ggml.padding_token_id")
        text_config = dict(
            vocab_size=int(vocab), hidden_size=need(text, "{arch}.embedding_length"),
            intermediate_size=need(text, "{arch}.feed_forward_length"), num_hidden_layers=need(text, "{arch}.block_count"),
            num_attention_heads=need(text, "{arch}.attention.head_count"),
            num_key_value_heads=need(text, "{arch}.attention.head_count_kv"), head_dim=head_dim,
            moe_intermediate_size=need(text, "{arch}.expert_feed_forward_length"),
            num_experts=need(text, "{arch}.expert_count"), num_experts_per_tok=need(text, "{arch}.expert_used_count"),
            max_position_embeddings=need(text, "{arch}.context_length"),
            rms_norm_eps=stored_float(need(text, "{arch}.attention.layer_norm_rms_epsilon")), tie_word_embeddings=tie,
            rope_parameters={"rope_type": "default", "rope_theta": stored_float(need(text, "{arch}.rope.freq_base")),
                             "mrope_section": sections, "mrope_interleaved": True},
            eos_token_id=None if eos is None else int(eos), pad_token_id=None if pad is None else int(pad))
        clip = "clip.vision."
        patch = int(need(mmproj, clip + "patch_size"))
        positions = mmproj.shapes.get("v.position_embd.weight")
        image_size = int(need(mmproj, clip + "image_size"))
        flags = list(need(mmproj, clip + "is_deepstack_layers"))
        vision = dict(
            depth=need(mmproj, clip + "block_count"), hidden_size=need(mmproj, clip + "embedding_length"),
            intermediate_size=need(mmproj, clip + "feed_forward_length"),
            num_heads=need(mmproj, clip + "attention.head_count"), out_hidden_size=need(mmproj, clip + "projection_dim"),
            patch_size=patch, spatial_merge_size=need(mmproj, clip + "spatial_merge_size"),
            temporal_patch_size=2 if "v.patch_embd.weight.1" in mmproj.shapes else 1,
            num_position_embeddings=positions[0] if positions else (image_size // patch) ** 2,
            deepstack_visual_indexes=[i for i, flag in enumerate(flags) if flag])
        return Qwen3VLMoeConfig(text_config=text_config, vision_config=vision, tie_word_embeddings=tie, **ids)

    def processor_from_gguf(self, mmproj: Any, tokenizer: Any, chat_template: str, family: str) -> Any:
        """Qwen2-VL's PIL image processor from the `clip.*` keys: patch and merge sizes, the pixel
        normalisation, the pixel bounds (where the file has none, llama.cpp's: 8 to 4096 merged tokens)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        clip = "clip.vision."
        patch, merge = int(mmproj.need(clip + "patch_size", family)), int(mmproj.need(clip + "spatial_merge_size", family))
        # llama.cpp's converter writes no bounds for Qwen-VL towers and llama.cpp's loader reads none: it takes
        # 8 to 4096 merged tokens a picture (clip.cpp, set_limit_image_tokens), so a pair it wrote sees the
        # pictures here as llama.cpp sees them (a 224 px picture stays 7 x 7 tokens; the published processor's
        # 65536-pixel floor would enlarge it to 8 x 8)
        token_pixels = (patch * merge) ** 2
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch, merge_size=merge,
            temporal_patch_size=2 if "v.patch_embd.weight.1" in mmproj.shapes else 1,
            image_mean=[stored_float(v) for v in mmproj.need(clip + "image_mean", family)],
            image_std=[stored_float(v) for v in mmproj.need(clip + "image_std", family)],
            size={"shortest_edge": int(mmproj.get(clip + "image_min_pixels", LLAMA_CPP_QWEN_VL_TOKENS[0] * token_pixels)),
                  "longest_edge": int(mmproj.get(clip + "image_max_pixels", LLAMA_CPP_QWEN_VL_TOKENS[1] * token_pixels))})
        return Qwen3VLImageTextProcessor(image_processor, tokenizer, chat_template=chat_template)

    def mmproj_source(self, name: str, config: Any) -> MmprojSource | None:
        """llama.cpp's names for the vision tower (its converter's Qwen3VLVisionModel): the blocks,
        position and patch embeddings through the gguf package's own name map; the merger as `mm.0` /
        `mm.2` (its two linears) and `v.post_ln` (its norm); each DeepStack merger as
        `v.deepstack.<vision layer it reads>`; the Conv3d patch embedding as two 2-D slices along time
        (`v.patch_embd.weight`, `.weight.1`)."""
        if not name.startswith(_VISUAL):
            return None
        import gguf

        rest, vision = name[len(_VISUAL):], config.vision_config
        names, kinds = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
        if rest.startswith("deepstack_merger_list."):
            _, index, part, suffix = rest.split(".", 3)
            kind = {"norm": kinds.V_DS_NORM, "linear_fc1": kinds.V_DS_FC1, "linear_fc2": kinds.V_DS_FC2}.get(part)
            layers = list(vision.deepstack_visual_indexes)
            if kind is None or int(index) >= len(layers):
                return None
            return MmprojSource((f"{names[kind].format(bid=layers[int(index)])}.{suffix}",))
        if rest.startswith("merger."):
            _, part, suffix = rest.split(".", 2)
            if part == "norm":
                return MmprojSource((f"{names[kinds.V_POST_NORM]}.{suffix}",))
            fc = {"linear_fc1": 0, "linear_fc2": 2}.get(part)
            return None if fc is None else MmprojSource((f"{names[kinds.V_MMPROJ].format(bid=fc)}.{suffix}",))
        if rest == "patch_embed.proj.weight":
            patch = names[kinds.V_ENC_EMBD_PATCH]
            return MmprojSource((f"{patch}.weight", f"{patch}.weight.1"), stack_dim=2)
        mapped = name_map("MMPROJ", vision.depth).get_name("visual." + rest, try_suffixes=(".weight", ".bias"))
        return MmprojSource((mapped,)) if mapped else None

    def load_processor(self, model_dir: Path) -> Qwen3VLImageTextProcessor:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tokenizer, image_processor = pretrained_tokenizer_and_image_processor(model_dir, Qwen2VLImageProcessorPil)
        return Qwen3VLImageTextProcessor(image_processor, tokenizer, chat_template=_read_chat_template(model_dir, tokenizer))

    # --- config ------------------------------------------------------------------------------
    def moe_layers_from_config(self, config: Any) -> list[int]:
        text = self.text_config(config)  # the rule Qwen3VLMoeTextDecoderLayer applies
        return [i for i in range(text.num_hidden_layers)
                if i not in (text.mlp_only_layers or []) and text.num_experts > 0 and (i + 1) % text.decoder_sparse_step == 0]

    def moe_shape(self, config: Any) -> MoEShape:
        text = self.text_config(config)
        return MoEShape(text.num_experts, text.num_experts_per_tok, text.hidden_size, text.moe_intermediate_size,
                        tuple(self.moe_layers_from_config(config)))

    # --- routing -----------------------------------------------------------------------------
    def fused_router(self, router: nn.Module) -> tuple[torch.Tensor, int] | None:
        if type(router).__name__.endswith("TopKRouter") and isinstance(getattr(router, "weight", None), torch.Tensor):
            return router.weight, int(router.top_k)
        return None

    def decode_attention_parts(self, attn: nn.Module) -> DecodeAttentionParts | None:
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        norms = [self.rms_norm_params(getattr(attn, name, None)) for name in ("q_norm", "k_norm")]
        if not all(type(p) is nn.Linear and p.bias is None for p in projections) or None in norms:
            return None  # biases, quantized or replaced projections: the module's own forward
        config = attn.config
        return DecodeAttentionParts(*projections, *norms, heads=config.num_attention_heads,
                                    kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
                                    scaling=float(attn.scaling), layer_index=int(attn.layer_idx))

    def attention_norms(self, attn: nn.Module) -> tuple[nn.Module, ...]:
        return tuple(norm for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if norm is not None)

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def vision_patch_projection(self, module: nn.Module) -> nn.Module | None:
        # Qwen3VLMoeVisionPatchEmbed views its input as (-1, in_channels, temporal_patch_size, patch, patch) for a
        # Conv3d of exactly that kernel: the flattened rows are the kernel's order
        if type(module).__name__ != "Qwen3VLMoeVisionPatchEmbed":
            return None
        conv = module.proj
        kernel = (int(module.in_channels), int(module.temporal_patch_size), int(module.patch_size),
                  int(module.patch_size))
        return conv if tuple(conv.weight.shape[1:]) == kernel else None

    def add_deepstack(self, text: nn.Module, hidden: torch.Tensor, visual_rows: torch.Tensor,
                      embeds: torch.Tensor) -> torch.Tensor:
        # transformers' _deepstack_process by row index: a copy, the visual rows plus the features
        out = hidden.clone()
        flat = out.view(-1, out.shape[-1])
        rows = visual_rows.to(out.device)
        flat[rows] = flat[rows] + embeds.to(out.device, out.dtype)
        return out

    def vision_tower_replayable(self) -> bool:
        return True

    builds_prompt_inputs = True

    def prompt_inputs(self, model: nn.Module, inputs: dict[str, torch.Tensor], visual_rows: torch.Tensor,
                      visual_tokens: int) -> dict[str, Any] | None:
        # Qwen3VLMoeModel.forward's picture part, without its three reads of the device: the tower's output split by
        # sizes read from the grid (the host then idles through the whole tower), the placeholder check's token
        # count, the positions' token types (the runner passes positions computed on the host)
        if "pixel_values_videos" in inputs:
            return None
        tower = self.vision_tower(model)
        ids = inputs["input_ids"]
        vision = tower(inputs["pixel_values"].type(tower.dtype), grid_thw=inputs["image_grid_thw"], return_dict=True)
        features = vision.pooler_output  # (N, H): every picture's tokens, in the prompt's order
        if features.shape[0] != visual_tokens:
            raise InputError(f"the prompt has {visual_tokens} image tokens but its pictures give {features.shape[0]} "
                             f"features: the processor's input ids and pixels do not belong together")
        embeds = model.get_input_embeddings()(ids)
        embeds.view(-1, embeds.shape[-1]).index_copy_(0, visual_rows, features.to(embeds.device, embeds.dtype))
        return {"inputs_embeds": embeds, "visual_pos_masks": self.image_token_mask(model.config, ids),
                "deepstack_visual_embeds": vision.deepstack_features}

    def vision_graph_inputs(self, vision_tower: nn.Module, grid_thw: torch.Tensor) -> dict[str, Any] | None:
        # what Qwen3VLMoeVisionModel.forward computes from the grid, by transformers' own helpers (vision_utils),
        # under the names its forward takes them precomputed
        tower = vision_tower
        if type(tower).__name__ != "Qwen3VLMoeVisionModel":
            return None
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
        cu_seqlens, max_seqlen = vision_utils.get_vision_attention_seqlens(grid_thw, tower.config)
        return {"interp_indices": indices, "interp_weights": weights, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
                "position_ids": vision_utils.get_vision_position_ids(grid_thw, tower.spatial_merge_size)}

    def vision_attention_parts(self, attn: nn.Module) -> VisionAttentionParts | None:
        # Qwen3-VL's: a biased qkv projection, rotary by halves in fp32 (apply_rotary_pos_emb_vision)
        if type(attn).__name__ != "Qwen3VLMoeVisionAttention" or type(attn.qkv) is not nn.Linear \
                or type(attn.proj) is not nn.Linear:
            return None
        return VisionAttentionParts(attn.qkv, attn.proj, heads=int(attn.num_heads), head_dim=int(attn.head_dim),
                                    scaling=float(attn.scaling))

    # --- attention read for visual-token saliency ---------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(patches,) mean attention received by each patch in `attn` (a Qwen-VL vision attention)."""
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

        return vision_attention_received(attn, hidden, cu_seqlens, position_embeddings, apply_rotary_pos_emb_vision)

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions`, in a Qwen3 text attention layer
        (`hidden` is that layer's input after its input norm; batch 1)."""
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb

        return gqa_last_token_attention(attn, hidden, position_embeddings, positions, apply_rotary_pos_emb, qk_norm=True)

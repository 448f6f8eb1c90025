"""ModelAdapter: everything model-specific the engine and the operators need, in one place per family.

No module outside `models/` names a Hugging Face attribute path (a test greps for them): the loader,
the rule engine's operators, the decode engine, the predictor's traces, expert parallelism and the
apps ask the adapter of the loaded model. Adding a family is one file here plus one line in the
registry (`models/__init__.py`).

Vocabulary: the *text model* is the language model module (the one a VisDecoder rule replaces);
a *decoder layer* has an attention, two norms and an MLP; an *MoE layer*'s MLP holds a router and
routed experts (and maybe shared experts); *fused experts* keep every expert of a layer in two
tensors, gate_up (E, 2I, H) and down (E, H, I).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import LoadError

_LAYER_INDEX = re.compile(r"(?:layers|blk)\.(\d+)\.")  # Hugging Face's and GGUF's (KTransformers') names


@dataclass(frozen=True)
class MmprojSource:
    """The tensors of an mmproj GGUF (llama.cpp's file for the vision tower) behind one of the model's
    tensors: one, or several stacked along `stack_dim` (a 3-D convolution written as 2-D slices)."""
    names: tuple[str, ...]
    stack_dim: int | None = None


# `expert_set` of a modality-separated MoE layer's experts that only image tokens route to
VISION_SET = "vision"


@dataclass(frozen=True)
class DecodeAttentionParts:
    """A grouped-query attention the decode step may run in fewer kernels (engine/fused_attention.py):
    bias-free query/key/value/output projections, an RMSNorm over each query and key head (Qwen3's), and
    rotary embedding by halves (transformers' `rotate_half`) with the (cos, sin) that `rotary` returns."""

    query: nn.Linear                      # the projections
    key: nn.Linear
    value: nn.Linear
    output: nn.Linear
    query_norm: tuple[torch.Tensor, float]   # (weight (D,), eps)
    key_norm: tuple[torch.Tensor, float]
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_index: int                     # the cache layer it writes


@dataclass(frozen=True)
class VisionAttentionParts:
    """A vision encoder attention a prompt may run in fewer kernels (engine/vision_attention.py): one
    query/key/value projection (rows: the queries', keys' and values' heads in turn), rotary embedding by
    halves in fp32 with the (cos, sin) the tower hands every block, attention inside each image
    (cu_seqlens), the output projection."""

    projection: nn.Linear
    output: nn.Linear
    heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class MoEShape:
    """What the offload runtime and the CPU backends need to know of a model's experts."""

    num_experts: int
    top_k: int
    hidden: int
    inter: int             # one expert's intermediate size
    moe_layers: tuple[int, ...]


class ModelAdapter:
    #: `config.model_type` values this adapter serves
    model_types: tuple[str, ...] = ()
    #: load the modelling code shipped in the model directory (remote-code families)
    trust_remote_code: bool = False
    #: names of a fused experts module's two weight tensors: gate_up (E, 2I, H), down (E, H, I)
    expert_tensors: tuple[str, str] = ("gate_up_proj", "down_proj")

    # --- construction and checkpoint -------------------------------------------------------
    def model_class(self) -> type[nn.Module]:
        raise NotImplementedError

    def build(self, config: Any) -> nn.Module:
        """Instantiate the model from its config (the loader calls this under meta-device init)."""
        return self.model_class()._from_config(config)

    def to_model_layout(self, name: str, tensor: torch.Tensor, expected: torch.Size, config: Any = None) -> torch.Tensor:
        """Turn a stored tensor whose shape differs from the parameter into the model's layout (`config`: the
        model's, where the layout depends on it)."""
        return tensor

    def hub_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The model's tensor `name` as the family's published checkpoints store it (what converters such as
        llama.cpp's expect), where that differs from the in-memory layout `save_pretrained` writes."""
        return tensor

    def checkpoint_sources(self, name: str, config: Any) -> tuple[tuple[str, ...], ...] | None:
        """How the model's tensor `name` is assembled where a checkpoint does not hold it under that name:
        one row per expert (stacked along a new dim 0), each row the checkpoint tensors concatenated
        along dim 0 (e.g. fused gate_up from per-expert `experts.N.gate_proj` / `up_proj`); None where
        the checkpoint must hold `name` itself."""
        return None

    def checkpoint_name(self, name: str, config: Any) -> str | tuple[str, ...] | None:
        """The name a checkpoint stores the model's tensor `name` under where it is not `name` (a family
        whose published checkpoints keep their original layout, which transformers renames on load), or
        several candidates, the first the checkpoint holds wins; None where the checkpoint uses the
        model's names."""
        return None

    def gguf_names(self, name: str) -> tuple[str, ...] | None:
        """The GGUF tensors (llama.cpp's names) that make up the model's tensor `name`, in the order
        they are concatenated along dim 1; None where a GGUF file does not hold it (e.g. the vision
        tower, which llama.cpp keeps in a separate mmproj file)."""
        return None

    def gguf_parts(self, name: str, state: dict[str, torch.Tensor], config: Any) -> list[torch.Tensor] | None:
        """The values of the GGUF tensors (one per name of `gguf_names`, or of `mmproj_source`) that the
        model's tensor `name` is written as, where llama.cpp's converter does more than split it along dim 1
        (splits and transposes it, permutes it, fuses it with its neighbours in `state`); [] where it is
        written as part of another tensor's; None for the plain split."""
        return None

    def from_gguf(self, name: str, parts: list[torch.Tensor], config: Any) -> torch.Tensor | None:
        """The model's tensor `name` from its GGUF tensors (dequantized, in `gguf_names` / `mmproj_source`
        order) where `gguf_parts` wrote them otherwise than split along dim 1: its inverse; None for the rest."""
        return None

    def gguf_metadata(self, config: Any) -> tuple[str, dict[str, Any]] | None:
        """(llama.cpp's architecture name, its `<arch>.*` keys by full name: the hyperparameters llama.cpp
        reads from a GGUF before it loads one) for the model's config (models/llama_cpp_keys.py builds
        the shared ones); None for a family llama.cpp has no text architecture for (the writer says so)."""
        return None

    def mmproj_metadata(self, config: Any, processor: Any) -> dict[str, Any] | None:
        """The `clip.*` keys of an mmproj GGUF (llama.cpp's vision tower file: its projector type, the
        tower's sizes, the processor's pixel normalisation) for the model's config; None for a family
        llama.cpp has no projector for (the writer says so)."""
        return None

    #: llama.cpp's architecture name (a GGUF's `general.architecture`), what `gguf_metadata` writes
    llama_cpp_arch: str | None = None
    #: why a GGUF pair cannot hold this family (what llama.cpp has no architecture or projector for, or what
    #: is not mapped here yet), said by `vismmoe-kt convert` and the GGUF-alone loader; None where it can
    llama_cpp_gap: str | None = None

    def config_from_gguf(self, text: Any, mmproj: Any, tokenizer: Any) -> Any:
        """The model's config rebuilt from a GGUF pair's metadata (core/gguf_model.py's GgufMetadata of the
        text file and the mmproj file: the inverse of `gguf_metadata` and `mmproj_metadata`, with what only
        tensor shapes and the tokenizer's special tokens say); a LoadError for a family not yet rebuilt."""
        raise LoadError(self._not_rebuilt(text, "its config"))

    def processor_from_gguf(self, mmproj: Any, tokenizer: Any, chat_template: str, family: str) -> Any:
        """The family's processor from the mmproj's `clip.*` keys (the image processor's parameters), the
        tokenizer and the chat template; a LoadError for a family not yet rebuilt."""
        raise LoadError(self._not_rebuilt(mmproj, "its processor"))

    def _not_rebuilt(self, meta: Any, what: str) -> str:
        family = "/".join(self.model_types)
        return (f"{getattr(meta, 'path', 'the GGUF')}: family {family} (llama.cpp's {self.llama_cpp_arch}): "
                f"rebuilding {what} from GGUF metadata alone is not supported yet; pass --model_path DIR with "
                f"its config, tokenizer and processor (the weights still come from --gguf_path)")

    def experts_key(self, layer: int) -> str | None:
        """The module name of decoder layer `layer`'s routed experts (whose `expert_tensors` a checkpoint
        holds); None where the family has not said."""
        return None

    def mmproj_source(self, name: str, config: Any) -> MmprojSource | None:
        """Where an mmproj GGUF (`--mmproj_path`) holds the model's vision tensor `name`, under the names
        llama.cpp's converter gives it; None for tensors outside the vision tower, or a family without
        an mmproj layout."""
        return None

    def load_processor(self, model_dir: Path) -> Any:
        raise NotImplementedError

    # --- config ------------------------------------------------------------------------------
    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def moe_layers_from_config(self, config: Any) -> list[int]:
        """Indices of the decoder layers that are MoE layers, from the config alone (before the model exists)."""
        raise NotImplementedError

    def moe_shape(self, config: Any) -> MoEShape:
        raise NotImplementedError

    def kv_cache_shape(self, config: Any) -> tuple[int, int, int]:
        """(heads, key width, value width) of what one decoder layer's attention writes to its KV cache per
        position (`past_key_values.update(keys, values, layer)`): the engine's static and slot caches are
        made in this shape. Standard attention: its key/value heads and head dim; latent attention (MLA)
        caches something else (models/kimi_k25.py)."""
        text = self.text_config(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return int(text.num_key_value_heads), int(head_dim), int(head_dim)

    def context_length(self, config: Any) -> int:
        return self.text_config(config).max_position_embeddings

    def layer_of(self, module_name: str) -> int:
        """The decoder-layer index in a module's dotted name (operators learn their layer this way)."""
        match = _LAYER_INDEX.search(module_name)
        if not match:
            raise ValueError(f"cannot tell the layer index from module name {module_name!r}")
        return int(match.group(1))

    # --- the model's parts -------------------------------------------------------------------
    def text_model(self, model: nn.Module) -> nn.Module:
        """The language model module (a VisDecoder where the rules put one)."""
        raise NotImplementedError

    def output_head(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return self.layers_of(self.text_model(model))

    def layers_of(self, text: nn.Module) -> nn.ModuleList:
        """The decoder layers of a text model (the module itself, not the whole model)."""
        raise NotImplementedError

    def token_embedding(self, text: nn.Module) -> nn.Module:
        raise NotImplementedError

    def final_norm(self, text: nn.Module) -> nn.Module:
        raise NotImplementedError

    def rotary(self, text: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for these positions."""
        raise NotImplementedError

    def attention(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def input_norm(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def post_attention_norm(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def feed_forward(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def router(self, layer: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def experts(self, layer: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def shared_experts(self, layer: nn.Module) -> nn.Module | None:
        """The MoE layer's shared experts (a dense MLP every token runs, added to the routed experts'
        output); None where the family has none or the layer is not an MoE layer."""
        return None

    def expert_set(self, module_name: str) -> str | None:
        """The expert set an experts module belongs to: None for the layer's primary set (the one `router`,
        `experts` and `moe_shape` describe, which decode uses), a name for a second set of a
        modality-separated MoE layer (ERNIE-4.5-VL's "vision" experts, which only image tokens reach)."""
        return None

    def expert_set_shape(self, config: Any, expert_set: str | None) -> MoEShape:
        """`moe_shape` of an expert set (`expert_set`'s answer: None, the primary set, is `moe_shape`)."""
        if expert_set is None:
            return self.moe_shape(config)
        raise ValueError(f"{type(self).__name__} has one expert set per MoE layer, not {expert_set!r}")

    def visual_router(self, layer: nn.Module) -> nn.Module | None:
        """Where image tokens are routed in a modality-separated MoE layer (their own router, which sees the
        rows of the modality argument's non-text tokens, in order); None where `router` routes every token."""
        return None

    def modality_argument(self) -> str | None:
        """The keyword argument by which the model hands its text model and decoder layers each token's
        modality for the experts (ERNIE-4.5-VL's `moe_mm_token_type_ids`, (B, T), 0 for text), which our
        text model slices with the tokens it keeps; None where the family has none."""
        return None

    def expert_weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2I, H), down (E, H, I)) of a fused experts module."""
        return tuple(getattr(experts, name) for name in self.expert_tensors)  # type: ignore[return-value]

    def expert_activation(self, experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    # --- routing -----------------------------------------------------------------------------
    def routed_experts(self, router_output: Any) -> torch.Tensor:
        """The (T, K) expert ids in what the router module returns (forward hooks read it)."""
        raise NotImplementedError

    def with_routing(self, router_output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """The router's output with these (T, K) weights and expert ids in place of its own choice."""
        raise NotImplementedError

    def router_probabilities(self, router_logits: torch.Tensor) -> torch.Tensor:
        """(T, E) per-expert probabilities from the router's logits (a softmax; sigmoid scorers override)."""
        return torch.softmax(router_logits.float(), dim=-1)

    def routing_weights(self, config: Any, probabilities: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """(..., K) weights the family's router gives the chosen experts `ids` (..., K), from every expert's
        probability (..., E), for routing made outside the model (the synthetic router); None where they are
        the chosen probabilities renormalised to sum to 1 (Qwen3's top-k, which that router gives already)."""
        return None

    def router_output(self, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """What a router that `fused_router` describes returns, from its (T, E) logits and (T, K) choice: the
        fused forward a prompt's routers get on the GPU (engine/fused_ops.py `fuse_routers`) returns it."""
        raise NotImplementedError

    def fused_router(self, router: nn.Module) -> tuple[torch.Tensor, int] | None:
        """(weight (E, H), top_k) when the router is softmax -> top-k -> renormalise over a linear
        layer, which the decode step computes in fewer kernels; None for any other router."""
        return None

    def rms_norm_params(self, norm: nn.Module) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) when `norm` is an RMSNorm the decode step may fuse; None otherwise."""
        return None

    def decode_attention_parts(self, attn: nn.Module) -> DecodeAttentionParts | None:
        """The attention's parts where it is one the decode step may fuse (DecodeAttentionParts); None
        for every other attention, which runs as the module itself."""
        return None

    def attention_norms(self, attn: nn.Module) -> tuple[nn.Module, ...]:
        """The norms inside an attention module (Qwen3's per-head query and key RMSNorms), which the
        lean engine may give a fused forward; () where there are none."""
        return ()

    # --- vision and positions ----------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def vision_patch_projection(self, module: nn.Module) -> nn.Module | None:
        """The Conv3d of `module` if it is this family's patch embedding, taking the processor's flattened patches
        (rows of channels x frames x patch x patch values, in the conv kernel's order) to the tower's width, so
        engine/vision_patches.py may run it as one matrix product (any module may be asked); None otherwise."""
        return None

    def vision_merge_size(self, config: Any) -> int:
        """Patches merged into one visual token, per side."""
        raise NotImplementedError

    def vision_last_attention(self, vision_tower: nn.Module) -> nn.Module:
        """The attention of the vision encoder's last block (the saliency source)."""
        raise NotImplementedError

    def vision_attention_parts(self, attn: nn.Module) -> VisionAttentionParts | None:
        """The parts of a vision attention engine/vision_attention.py runs (any module may be asked); None: the
        module's own forward."""
        return None

    def vision_tower_replayable(self) -> bool:
        """Whether the vision tower's forward takes `(pixels, grid_thw, **kwargs)` and the tensors it makes from the
        grid alone precomputed (`vision_graph_inputs`), so engine/vision_graph.py may replay it per grid."""
        return False

    def vision_graph_inputs(self, vision_tower: nn.Module, grid_thw: torch.Tensor) -> dict[str, Any] | None:
        """The keyword arguments that hand the tower's forward what it would compute from `grid_thw` alone (so it
        runs device work only); None where this family's tower cannot take them."""
        return None

    #: whether `prompt_inputs` builds a whole picture prompt's text model inputs (else the model's own forward runs)
    builds_prompt_inputs = False

    def prompt_inputs(self, model: nn.Module, inputs: dict[str, torch.Tensor], visual_rows: torch.Tensor,
                      visual_tokens: int) -> dict[str, Any] | None:
        """What the model's forward hands its text model for a whole picture prompt (inputs_embeds with the vision
        tower's features at `visual_rows`, visual_pos_masks, the family's extra inputs), built as that forward
        builds them but without reading anything back from the device: the prompt's `visual_tokens` visual rows
        (N,) on the device were read from its token ids on the host (engine/host_prompt.py). None where this
        family's forward is left to transformers."""
        return None

    def image_token_id(self, config: Any) -> int | None:
        return None

    def image_token_mask(self, config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        token = self.image_token_id(config)
        return input_ids == token if token is not None else torch.zeros_like(input_ids, dtype=torch.bool)

    def position_rows(self) -> int:
        """Rows of the text model's rotary position ids: 3 for M-RoPE (temporal, height, width: Qwen3-VL,
        GLM-4.5V), 1 for plain 1-D RoPE. The engine builds decode positions with this many rows and hands
        `rotary` (rows, B, T) ids."""
        return 3

    def rope_index(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(position ids (3, B, T), rope deltas) of a whole processed prompt (M-RoPE families)."""
        raise NotImplementedError

    def rope_delta(self, model: nn.Module) -> torch.Tensor | None:
        """The position offset of decode steps after the last prompt (M-RoPE: images shorten positions)."""
        return None

    def set_rope_delta(self, model: nn.Module, delta: torch.Tensor | None) -> None:
        pass

    def install_hooks(self, model: nn.Module) -> None:
        """Wire what the family's model does not hand our operators itself, once the rules are applied
        (the loader calls this). Qwen3-VL's model passes its text model `visual_pos_masks`: nothing to do."""

    def add_deepstack(self, text: nn.Module, hidden: torch.Tensor, visual_rows: torch.Tensor,
                      embeds: torch.Tensor) -> torch.Tensor:
        """Add a layer's DeepStack vision features (N, H) to the visual rows of `hidden` (Qwen3-VL): `visual_rows`
        (N,) index hidden.reshape(-1, H), found once a prompt (a boolean mask would wait for the device at
        every layer that adds them)."""
        return hidden

    # --- attention read for visual-token saliency ----------------------------------------------
    def attention_received(self, attn: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(patches,) head-averaged attention each patch receives in a vision attention (within each
        image), recomputed from the attention's inputs (the tower's fused kernel never forms it)."""
        raise NotImplementedError

    def last_token_attention(self, attn: nn.Module, hidden: torch.Tensor,
                             position_embeddings: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of the last token to `positions` in a text attention layer (`hidden`:
        the layer's input after its input norm; batch 1): FastV-style saliency."""
        raise NotImplementedError

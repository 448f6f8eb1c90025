"""VisDecoder: the text model, with affinity-aware visual-token pruning after the pinned prefix.

Replaces `model.language_model`. Prefill with an image runs the first `prune_layer` decoder layers
(the pinned prefix, whose routing is observable at no transfer cost) on every token, recording each
visual token's routed experts there. Then it keeps all text tokens and the visual tokens that
`compression` selects (VisMMOE Algorithm 1 by default), with their original M-RoPE positions, and
runs the remaining layers on those alone: their KV caches hold only kept tokens, the prefix layers'
caches hold all. Decode steps need nothing special (positions continue from the full sequence, each
layer attends to what its cache holds). Pruned positions leave with their prefix hidden states, so
the output keeps the input's length.

Companion operator `VisionSaliency` replaces `model.visual` and records the saliency of each merged
visual token (vismmoe_kt.vision.saliency) for the decoder to read.

Rule kwargs: compression (affinity | saliency | random | none), keep_ratio (beta; 1.0 = off),
salient_ratio (alpha; default 0.4 * beta), tradeoff (lambda, 2.0), prune_layer (auto = the offload
runtime's pinned prefix depth, or a decoder-layer index), saliency_source (vision: attention received
in the vision encoder's last block | llm: the last token's attention in the last prefix layer),
decode (lean: our decode path, vismmoe_kt.engine, with a static cache and captured segments | hf: the
transformers loop), graphs (auto: CUDA graphs on a CUDA device | cuda | replay: the CPU twin of the
graph plumbing | off).
Limitation: pruning needs batch size 1 without padding; other batches raise a clear error.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..vision.compression import METHODS, select
from ..engine.graphs import GRAPH_MODES
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule

CONTEXT_KEY = "compression"


@dataclass
class CompressionStats:
    prefills: int = 0
    pruned_prefills: int = 0
    visual_tokens_before: int = 0
    visual_tokens_after: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    # experts the visual tokens route to in the prefix layers (union over those layers), all vs kept:
    # the working set that Algorithm 1 shrinks
    prefix_experts_visual_all: int = 0
    prefix_experts_visual_kept: int = 0
    compression_seconds: float = 0.0


class CompressionContext:
    """What the vision tower and the decoder of one model share for a request."""

    def __init__(self):
        self.recorder = None  # SaliencyRecorder, set by VisionSaliency
        # which rows of the hidden states the layers are processing now are image tokens (flattened
        # batch x sequence), for operators that treat modalities differently (ReaLB)
        self.token_is_visual: torch.Tensor | None = None


def shared_context(loader: Any) -> CompressionContext:
    context = getattr(loader, "context", None)
    if context is None:
        raise ValueError("VisDecoder/VisionSaliency need vismmoe_kt's loader (load with vismmoe_kt.load)")
    return context.setdefault(CONTEXT_KEY, CompressionContext())


class VisionSaliency(BaseInjectedModule):
    """The vision tower, unchanged, plus a hook that records visual-token saliency when asked."""

    def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cuda", generate_device="cuda", **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        from ..vision.saliency import SaliencyRecorder

        merge = getattr(orig_module, "spatial_merge_size", None) or config.vision_config.spatial_merge_size
        shared_context(gguf_loader).recorder = SaliencyRecorder(orig_module, merge)


IMPLICIT_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")  # kernels that take is_causal themselves


def causal_mask(queries: int, past: int, dtype: torch.dtype, device: torch.device,
                implicit_causal: bool = False) -> torch.Tensor | None:
    """Additive (1, 1, q, past + q) mask: query i sees keys up to past + i. None when no mask is needed:
    one query sees everything, and with `implicit_causal` a prefill from an empty cache is plain causal
    attention, which the kernel does itself (flash/efficient kernels, no q x q mask in memory)."""
    if queries == 1 or (past == 0 and implicit_causal):
        return None
    keys = past + queries
    allowed = torch.arange(keys, device=device)[None, :] <= (past + torch.arange(queries, device=device))[:, None]
    return torch.zeros(queries, keys, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class VisDecoder(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("gradient_checkpointing",)

    def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cuda", generate_device="cuda",
                 compression: str = "affinity", keep_ratio: float = 0.5, salient_ratio: float | None = None,
                 tradeoff: float = 2.0, prune_layer: Any = "auto", saliency_source: str = "vision", seed: int = 0,
                 decode: str = "lean", graphs: str = "auto", **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        if isinstance(graphs, bool):  # YAML reads a bare `off` / `on` as a boolean
            graphs = "auto" if graphs else "off"
        if decode not in ("lean", "hf"):
            raise ValueError(f"decode {decode!r} is not one of: lean, hf")
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs {graphs!r} is not one of: {', '.join(GRAPH_MODES)}")
        if graphs == "cuda" and torch.device(self.generate_device).type != "cuda":
            raise ValueError(f"graphs: cuda needs a CUDA generate_device, this rule has {self.generate_device}")
        self.decode, self.graphs = decode, graphs
        self._lean = None  # vismmoe_kt.engine.generation.LeanEngine, made at the first lean request
        self.step_hooks: list = []  # (before, after) around each lean decode step (see LeanDecodeStep)
        if compression not in METHODS:
            raise ValueError(f"compression {compression!r} is not one of: {', '.join(METHODS)}")
        if not 0 < float(keep_ratio) <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
        self.keep_ratio = float(keep_ratio)
        self.salient_ratio = float(salient_ratio) if salient_ratio is not None else 0.4 * self.keep_ratio
        if not 0 < self.salient_ratio <= self.keep_ratio:
            raise ValueError(f"salient_ratio must be in (0, keep_ratio], got {self.salient_ratio}")
        if saliency_source not in ("vision", "llm"):
            raise ValueError(f"saliency_source {saliency_source!r} is not one of: vision, llm")
        self.saliency_source = saliency_source
        if prune_layer != "auto" and not (isinstance(prune_layer, int) and prune_layer >= 1):
            raise ValueError(f"prune_layer must be 'auto' or a decoder-layer index >= 1, got {prune_layer!r}")
        self.compression, self.tradeoff, self.prune_layer, self.seed = compression, float(tradeoff), prune_layer, seed
        self.active = compression != "none" and self.keep_ratio < 1
        self.shared = shared_context(gguf_loader)
        if self.active and compression in ("affinity", "saliency") and saliency_source == "vision":
            if self.shared.recorder is None:
                raise ValueError(f"compression {compression!r} needs the vision tower's saliency: add a rule replacing "
                                 f"model.visual with vismmoe_kt.operators.vis_decoder.VisionSaliency before this one")
            self.shared.recorder.enabled = True
        self.counters = CompressionStats()
        self._routes: dict[int, torch.Tensor] = {}
        self._recording = False
        self.last_keep: torch.Tensor | None = None  # sequence indices kept by the last pruned prefill ...
        self.last_prune_at: int | None = None        # ... in the layers from this one on
        self._llm_saliency: torch.Tensor | None = None
        for index, layer in enumerate(orig_module.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.register_forward_hook(self._route_hook(index))

    # --- prefix routing ------------------------------------------------------------------------
    def _route_hook(self, index: int):
        def hook(module, args, output):
            if self._recording:
                self._routes[index] = output[2]  # (tokens, K) routed expert ids
        return hook

    def _prune_at(self) -> int:
        if self.prune_layer != "auto":
            return int(self.prune_layer)
        runtime = self.gguf_loader.context.get("offload_runtime")
        if runtime is None:
            raise ValueError("prune_layer: auto needs the offload runtime's pinned prefix (VisExperts rules); "
                             "give prune_layer a layer index instead")
        offloaded = [layer for layer in runtime.moe_layers if layer not in runtime.pinned]
        return offloaded[0] if offloaded else len(self.orig_module.layers)

    def _keep(self, visual: torch.Tensor, prefix_layers: list[int]) -> torch.Tensor:
        """Sequence indices that continue: every text token and the selected visual tokens."""
        positions = torch.nonzero(visual, as_tuple=True)[0]
        n = positions.numel()
        num_experts = self.orig_module.config.num_experts
        masks = torch.zeros(n, num_experts, dtype=torch.bool, device=visual.device)
        for index in prefix_layers:
            if index in self._routes:
                routes = self._routes[index][positions]
                masks.scatter_(1, routes, True)
        if self.saliency_source == "llm":
            saliency = self._llm_saliency
        else:
            saliency = self.shared.recorder.take() if self.shared.recorder is not None else None
        if saliency is None or saliency.numel() != n:
            if self.compression in ("affinity", "saliency"):
                raise RuntimeError(f"saliency for {n} visual tokens is missing (got "
                                   f"{None if saliency is None else saliency.numel()}); was the vision tower run?")
            saliency = torch.zeros(n)
        kept = select(self.compression, saliency.cpu(), masks.cpu(), self.keep_ratio, self.salient_ratio,
                      self.tradeoff, self.seed).to(visual.device)
        self.counters.prefix_experts_visual_all += int(masks.any(dim=0).sum())
        self.counters.prefix_experts_visual_kept += int(masks[kept].any(dim=0).sum())
        keep = ~visual
        keep[positions[kept]] = True
        return torch.nonzero(keep, as_tuple=True)[0]

    # --- forward -------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):
        from transformers.cache_utils import DynamicCache
        from transformers.modeling_outputs import MoeModelOutputWithPast

        text = self.orig_module
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=text.config)
        if inputs_embeds is None:
            inputs_embeds = text.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(length, device=inputs_embeds.device) + past).view(1, 1, -1).expand(4, batch, -1)
        elif position_ids.ndim == 2:
            position_ids = position_ids[None].expand(4, *position_ids.shape)
        text_positions = None
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            text_positions, position_ids = position_ids[0], position_ids[1:]

        prefill = past == 0 and length > 1
        prune = self.active and prefill and visual_pos_masks is not None and bool(visual_pos_masks.any())
        if prefill:
            self.counters.prefills += 1
        if batch != 1 or (attention_mask is not None and not bool(attention_mask.all())):
            if prune:
                raise ValueError("VisDecoder prunes visual tokens for batch size 1 without padding only; "
                                 "send requests one at a time or set keep_ratio: 1.0")
            return text.forward(input_ids=None, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                position_ids=torch.cat([text_positions[None], position_ids]) if text_positions is not None else position_ids,
                                past_key_values=past_key_values, use_cache=use_cache, visual_pos_masks=visual_pos_masks,
                                deepstack_visual_embeds=deepstack_visual_embeds, **kwargs)

        hidden = inputs_embeds
        self.shared.token_is_visual = visual_pos_masks.reshape(-1) if visual_pos_masks is not None and \
            visual_pos_masks.shape[:2] == inputs_embeds.shape[:2] else torch.zeros(batch * length, dtype=torch.bool,
                                                                                  device=inputs_embeds.device)
        if prefill and visual_pos_masks is not None and bool(visual_pos_masks.any()):
            self._visual_summary(inputs_embeds, visual_pos_masks)
        cos, sin = text.rotary_emb(hidden, position_ids)
        prune_at = self._prune_at() if prune else None
        self._routes.clear()
        self._recording = prune
        keep = full = None
        masks: dict[tuple[int, int], torch.Tensor | None] = {}
        implicit_causal = getattr(text.config, "_attn_implementation", None) in IMPLICIT_CAUSAL
        for index, layer in enumerate(text.layers):
            if index == prune_at:
                start = time.perf_counter()
                keep = self.last_keep = self._keep(visual_pos_masks[0], list(range(prune_at)))
                self.last_prune_at = prune_at
                self._recording = False
                full = hidden
                hidden = hidden[:, keep]
                cos, sin = cos[:, keep], sin[:, keep]
                text_positions = text_positions[:, keep] if text_positions is not None else None
                if deepstack_visual_embeds is not None:
                    kept_visual = visual_pos_masks[0, keep]
                    order = torch.cumsum(visual_pos_masks[0].long(), 0)[keep][kept_visual] - 1
                    deepstack_visual_embeds = [e[order] for e in deepstack_visual_embeds]
                visual_pos_masks = visual_pos_masks[:, keep]
                self.shared.token_is_visual = visual_pos_masks.reshape(-1)
                self._visual_summary(hidden, visual_pos_masks)
                self._count(visual_pos_masks, full.shape[1], keep.numel(), time.perf_counter() - start)
            if prune and self.saliency_source == "llm" and index == prune_at - 1:
                self._llm_saliency = self._prefix_attention(layer, hidden, (cos, sin), visual_pos_masks[0])
            layer_past = past_key_values.get_seq_length(index) if past_key_values is not None else 0
            shape = (hidden.shape[1], layer_past)
            if shape not in masks:  # layers with the same lengths share one mask
                masks[shape] = causal_mask(*shape, hidden.dtype, hidden.device, implicit_causal)
            mask = masks[shape]
            hidden = layer(hidden, attention_mask=mask, position_ids=text_positions, past_key_values=past_key_values,
                           position_embeddings=(cos, sin), **kwargs)
            if deepstack_visual_embeds is not None and index < len(deepstack_visual_embeds):
                hidden = text._deepstack_process(hidden, visual_pos_masks, deepstack_visual_embeds[index])
        self._recording = False
        hidden = text.norm(hidden)
        if keep is not None:  # give pruned positions their prefix state so the output keeps its length
            out = text.norm(full)
            out[:, keep] = hidden
            hidden = out
        return MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)

    def _visual_summary(self, inputs_embeds: torch.Tensor, visual: torch.Tensor) -> None:
        """h_v for the lookahead predictor: the mean visual embedding (of the kept tokens, once pruned)."""
        runtime = self.gguf_loader.context.get("offload_runtime")
        if runtime is not None:
            runtime.visual_summary = inputs_embeds[visual].float().mean(dim=0)

    def _prefix_attention(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, visual: torch.Tensor):
        """FastV-style saliency: the last token's attention to each visual token in this prefix layer."""
        from ..vision.saliency import last_token_attention

        with torch.no_grad():
            normed = layer.input_layernorm(hidden)
            return last_token_attention(layer.self_attn, normed, position_embeddings,
                                        torch.nonzero(visual, as_tuple=True)[0]).cpu()

    def _count(self, kept_visual_mask: torch.Tensor, before: int, after: int, seconds: float) -> None:
        c = self.counters
        c.pruned_prefills += 1
        c.tokens_before += before
        c.tokens_after += after
        kept_visual = int(kept_visual_mask.sum())
        c.visual_tokens_after += kept_visual
        c.visual_tokens_before += kept_visual + (before - after)
        c.compression_seconds += seconds

    # --- decode ----------------------------------------------------------------------------------
    def lean_engine(self, lm_head: nn.Module):
        if self._lean is None:
            from ..engine.generation import LeanEngine

            self._lean = LeanEngine(self, lm_head, self.graphs)
        return self._lean

    def set_token_is_visual(self, flag: torch.Tensor) -> None:
        self.shared.token_is_visual = flag

    def stats(self) -> dict[str, Any]:
        lean = {f"decode_{k}": v for k, v in self._lean.stats().items()} if self._lean is not None else {}
        return {"compression": self.compression, "keep_ratio": self.keep_ratio if self.active else 1.0,
                **asdict(self.counters), **lean}

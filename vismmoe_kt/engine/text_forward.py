"""The text model's forward, ours: masks for our static cache and visual-token pruning mid-model.

The VisDecoder rule replaces the language model with an operator whose forward is `TextForward`.
Prefill with an image runs the first `prune_at` decoder layers (the pinned prefix, whose routing is
observable at no transfer cost; with none pinned, up to the first MoE layer) on every token,
recording each visual token's routed experts there. Then it keeps all text tokens and the visual
tokens that the compression method selects (VisMMOE Algorithm 1 by default), with their original
M-RoPE positions, and runs the remaining layers on those alone: their KV caches hold only kept
tokens, the prefix layers' caches hold all. Decode steps need nothing special (positions continue
from the full sequence, each layer attends to what its cache holds). Pruned positions leave with
their prefix hidden states, so the output keeps the input's length. What the prefill kept goes to
the load context (`pruning`), where the decode engine reads it. keep_ratio 1.0 gives exactly the
reference model's outputs.

Limitation: pruning needs batch size 1 without padding; other batches raise a clear error. Batched
generation's prompts prefilled together (right-padded, into a `SlotRowsView`) run this loop unpruned:
from an empty cache, causal attention alone keeps each prompt from its padding.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..core.context import LoadContext
from ..core.model_pass import HostPrompt
from ..models import ModelAdapter
from ..vision.compression import CompressionSettings, select
from .decode_attention import NAME as GROUPED_DECODE_ATTENTION
from .host_prompt import to_device
from .slot_cache import SlotRowsView

# kernels that take is_causal themselves (grouped decode attention hands every prefill to sdpa)
IMPLICIT_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3", GROUPED_DECODE_ATTENTION)


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


def true_rows(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of a 1-D `mask`'s True entries, ascending, where the host knows there are `count`: a stable
    sort puts them first in their order, where torch.nonzero would wait for the device to learn the count."""
    return torch.sort(mask.to(torch.uint8), descending=True, stable=True).indices[:count]


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


class TextForward:
    def __init__(self, text: nn.Module, adapter: ModelAdapter, settings: CompressionSettings, context: LoadContext):
        self.text, self.adapter, self.settings, self.context = text, adapter, settings, context
        self.layers = adapter.layers_of(text)
        self.num_experts = adapter.moe_shape(text.config).num_experts
        self.counters = CompressionStats()
        self._capture: dict[str, Any] | None = None  # prefill_parts: what the model's forward hands us
        self._routes: dict[int, torch.Tensor] = {}
        # a modality-separated family's modality argument (models/base.py) and this forward's visual rows
        # in it: image tokens route through their own router, which sees those rows only
        self._modality = adapter.modality_argument()
        self._modality_rows: torch.Tensor | None = None
        self._visual_routers = any(adapter.visual_router(layer) is not None for layer in self.layers)
        self._recording = False
        self._llm_saliency: torch.Tensor | None = None
        self._expert_counts: torch.Tensor | None = None  # (all, kept) prefix experts of pruned prompts, on the device
        context.pruning.active = settings.active
        self._hooked: dict[int, tuple[nn.Module, Any]] = {}  # layer -> (the router hooked, the hook's handle)
        self._hook_routers()

    def _hook_routers(self) -> None:
        """Hook each layer's router as it is now (where visual tokens are routed). Checked again before each
        pruned prefill: a routing source put on the loaded model (the benchmarks' install_routing) replaces the
        routers with operators that call the old module and then replace its choice, and the prefix's routing
        must be the choice the experts get, not the replaced router's own."""
        for index, layer in enumerate(self.layers):
            router = self.adapter.visual_router(layer) or self.adapter.router(layer)
            hooked = self._hooked.get(index)
            if router is None or (hooked is not None and hooked[0] is router):
                continue
            if hooked is not None:
                hooked[1].remove()
            self._hooked[index] = (router, router.register_forward_hook(self._route_hook(index)))

    # --- prefix routing ------------------------------------------------------------------------
    def _route_hook(self, index: int):
        def hook(module, args, output):
            if self._recording:
                chosen = self.adapter.routed_experts(output)  # (rows, K) routed expert ids
                rows = self._modality_rows
                if rows is not None:  # a visual router's rows: the modality's non-text tokens, in order
                    full = torch.zeros(rows.numel(), chosen.shape[1], dtype=chosen.dtype, device=chosen.device)
                    full[rows.to(chosen.device)] = chosen
                    chosen = full
                self._routes[index] = chosen  # (tokens, K)
        return hook

    def _prune_at(self) -> int:
        if self.settings.prune_layer != "auto":
            return int(self.settings.prune_layer)
        runtime = self.context.offload_runtime
        if runtime is None:
            raise ValueError("prune_layer: auto needs the offload runtime's pinned prefix (VisExperts rules); "
                             "give prune_layer a layer index instead")
        offloaded = runtime.offloaded_layers()
        # at least the first MoE layer first, even with no pinned prefix: Algorithm 1 ranks by the routing before
        # the prune (some families' first layers are dense: nothing routed there)
        first_routed = min(self._hooked, default=0)  # the first layer with a router
        return max(offloaded[0], first_routed + 1) if offloaded else len(self.layers)

    def _keep(self, visual: torch.Tensor, prefix_layers: list[int],
              host: HostPrompt | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence indices that continue: every text token and the selected visual tokens; the selected ones'
        indices among the visual tokens), both ascending. With the prompt's host facts nothing here waits for the
        device: the counts are the host's, the choice runs where the routing and saliency are."""
        s = self.settings
        if host is not None:
            positions, n = host.visual_rows, host.visual_tokens
        else:
            positions = torch.nonzero(visual, as_tuple=True)[0]  # waits for the device
            n = positions.numel()
        masks = torch.zeros(n, self.num_experts, dtype=torch.bool, device=visual.device)
        for index in prefix_layers:
            if index in self._routes:
                masks.scatter_(1, self._routes[index][positions], True)
        if s.saliency_source == "llm":
            saliency = self._llm_saliency
        else:
            recorder = self.context.saliency
            saliency = recorder.take() if recorder is not None else None
        if saliency is None or saliency.numel() != n:
            if s.compression in ("affinity", "saliency"):
                raise RuntimeError(f"saliency for {n} visual tokens is missing (got "
                                   f"{None if saliency is None else saliency.numel()}); was the vision tower run?")
            saliency = torch.zeros(n, device=masks.device)
        kept = select(s.compression, saliency.to(masks.device), masks, s.keep_ratio, s.salient_ratio, s.tradeoff,
                      s.seed)
        kept = to_device(kept, visual.device)  # `random` draws on the host
        counts = torch.stack([masks.any(dim=0).sum(), masks[kept].any(dim=0).sum()])
        self._expert_counts = counts if self._expert_counts is None else self._expert_counts + counts
        keep = ~visual
        keep.index_fill_(0, positions[kept], True)  # not `keep[...] = True`: CUDA copies that scalar from the host, waiting
        return true_rows(keep, visual.numel() - n + kept.numel()), kept

    # --- forward -------------------------------------------------------------------------------
    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):
        from transformers.cache_utils import DynamicCache
        from transformers.modeling_outputs import MoeModelOutputWithPast

        text, adapter, context = self.text, self.adapter, self.context
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        modality = kwargs.get(self._modality) if self._modality else None
        if self._capture is not None:  # prefill_parts: keep the inputs, run nothing
            self._capture.update(inputs_embeds=inputs_embeds, position_ids=position_ids, visual_pos_masks=visual_pos_masks,
                                 deepstack_visual_embeds=deepstack_visual_embeds, modality=modality)
            return MoeModelOutputWithPast(last_hidden_state=inputs_embeds[:, -1:], past_key_values=past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=text.config)
        if inputs_embeds is None:
            inputs_embeds = adapter.token_embedding(text)(input_ids)
        batch, length = inputs_embeds.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        rows = adapter.position_rows()  # rotary rows (M-RoPE: 3); a leading row of text positions may precede them
        if position_ids is None:
            position_ids = (torch.arange(length, device=inputs_embeds.device) + past).view(1, 1, -1).expand(rows + 1, batch, -1)
        elif position_ids.ndim == 2:
            position_ids = position_ids[None].expand(rows + 1, *position_ids.shape)
        text_positions = None
        if position_ids.ndim == 3 and position_ids.shape[0] == rows + 1:
            text_positions, position_ids = position_ids[0], position_ids[1:]

        prefill = past == 0 and length > 1
        host = self._host_prompt(batch, length) if prefill else None
        # whether the prompt has visual tokens: from its host facts (host_prompt.py), else read from the device
        has_visual = host.visual_tokens > 0 if host is not None else \
            visual_pos_masks is not None and bool(visual_pos_masks.any())
        prune = self.settings.active and prefill and has_visual
        if prefill:
            self.counters.prefills += 1
        grouped = isinstance(past_key_values, SlotRowsView)  # prompts prefilled together, right-padded
        if grouped and prune:
            raise ValueError("prompts prefilled together cannot prune visual tokens: prefill them one at a time")
        if not grouped and (batch != 1 or (attention_mask is not None and not bool(attention_mask.all()))):
            if prune:
                raise ValueError("VisDecoder prunes visual tokens for batch size 1 without padding only; "
                                 "send requests one at a time or set keep_ratio: 1.0")
            return text.forward(input_ids=None, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                position_ids=self._positions_for_text_model(text_positions, position_ids),
                                past_key_values=past_key_values, use_cache=use_cache, visual_pos_masks=visual_pos_masks,
                                deepstack_visual_embeds=deepstack_visual_embeds, **kwargs)

        hidden = inputs_embeds
        context.token_is_visual = visual_pos_masks.reshape(-1) if visual_pos_masks is not None and \
            visual_pos_masks.shape[:2] == inputs_embeds.shape[:2] else torch.zeros(batch * length, dtype=torch.bool,
                                                                                  device=inputs_embeds.device)
        if prefill and has_visual:
            self._visual_summary(inputs_embeds, visual_pos_masks, host.visual_rows if host is not None else None)
        cos, sin = adapter.rotary(text, hidden, position_ids)
        prune_at = self._prune_at() if prune else None
        self._routes.clear()
        if prune:
            self._hook_routers()
        self._recording = prune
        self._modality_rows = modality.reshape(-1) != 0 if prune and modality is not None and self._visual_routers \
            else None
        keep = full = None
        visual_rows = host.visual_rows if host is not None and deepstack_visual_embeds is not None else \
            self._visual_rows(visual_pos_masks, deepstack_visual_embeds)
        masks: dict[tuple[int, int], torch.Tensor | None] = {}
        implicit_causal = getattr(text.config, "_attn_implementation", None) in IMPLICIT_CAUSAL
        for index, layer in enumerate(self.layers):
            if index == prune_at:
                start = time.perf_counter()
                keep, kept = self._keep(visual_pos_masks[0], list(range(prune_at)), host)
                context.pruning.keep, context.pruning.prune_at = keep, prune_at
                self._recording = False
                full = hidden
                hidden = hidden[:, keep]
                cos, sin = cos[:, keep], sin[:, keep]
                text_positions = text_positions[:, keep] if text_positions is not None else None
                if deepstack_visual_embeds is not None:  # a visual token's features follow it (kept ascends)
                    deepstack_visual_embeds = [e[kept] for e in deepstack_visual_embeds]
                visual_pos_masks = visual_pos_masks[:, keep]
                kept_rows = true_rows(visual_pos_masks.reshape(-1), kept.numel())
                visual_rows = kept_rows if deepstack_visual_embeds is not None else None
                context.token_is_visual = visual_pos_masks.reshape(-1)
                if modality is not None:  # the kept tokens' modalities, for the layers' expert sets
                    modality = kwargs[self._modality] = modality[:, keep]
                # the kept tokens' vision-tower embeddings, as the predictor's training traces record
                # them (not the hidden states at this layer)
                self._visual_summary(inputs_embeds[:, keep], visual_pos_masks, kept_rows)
                self._count(kept.numel(), full.shape[1], keep.numel(), time.perf_counter() - start)
            if prune and self.settings.saliency_source == "llm" and index == prune_at - 1:
                rows = host.visual_rows if host is not None else torch.nonzero(visual_pos_masks[0], as_tuple=True)[0]
                self._llm_saliency = self._prefix_attention(layer, hidden, (cos, sin), rows)
            layer_past = past_key_values.get_seq_length(index) if past_key_values is not None else 0
            shape = (hidden.shape[1], layer_past)
            if shape not in masks:  # layers with the same lengths share one mask
                masks[shape] = causal_mask(*shape, hidden.dtype, hidden.device, implicit_causal)
            hidden = layer(hidden, attention_mask=masks[shape], position_ids=text_positions,
                           past_key_values=past_key_values, position_embeddings=(cos, sin), **kwargs)
            if deepstack_visual_embeds is not None and index < len(deepstack_visual_embeds):
                hidden = adapter.add_deepstack(text, hidden, visual_rows, deepstack_visual_embeds[index])
        self._recording = False
        self._modality_rows = None
        norm = adapter.final_norm(text)
        hidden = norm(hidden)
        if keep is not None:  # give pruned positions their prefix state so the output keeps its length
            out = norm(full)
            out[:, keep] = hidden
            hidden = out
        return MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)

    def _host_prompt(self, batch: int, length: int) -> HostPrompt | None:
        """The host facts of the prompt this forward runs (the ModelPass's one row, whole, from its first token),
        else None."""
        model_pass = self.context.model_pass
        rows = model_pass.prefill if model_pass is not None else ()
        if batch != 1 or len(rows) != 1 or rows[0].host is None or rows[0].start or rows[0].length != length:
            return None
        return rows[0].host

    @staticmethod
    def _visual_rows(visual_pos_masks: torch.Tensor | None, deepstack: list | None) -> torch.Tensor | None:
        """The visual rows of the flattened hidden states, where DeepStack features are added (once a prompt,
        and again for the kept tokens)."""
        if deepstack is None or visual_pos_masks is None:
            return None
        return torch.nonzero(visual_pos_masks.reshape(-1), as_tuple=True)[0]

    def _positions_for_text_model(self, text_positions, position_ids):
        """Positions in the form the wrapped transformers text model takes: (B, T) for 1-D RoPE, else the
        rotary rows with the text row in front where there is one."""
        if self.adapter.position_rows() == 1:
            return position_ids[0]
        return torch.cat([text_positions[None], position_ids]) if text_positions is not None else position_ids

    # --- chunked prefill (continuous batching) -------------------------------------------------------
    def prefill_parts(self, run: Any) -> dict[str, Any]:
        """What the model's forward hands the text model when `run()` calls it (the prompt's embeddings
        with the vision tower's output in place, M-RoPE positions, the visual mask, deepstack features),
        the text model itself not run: `prefill_chunk` then runs it a chunk at a time."""
        if self.settings.active:
            raise ValueError("a chunked prefill cannot prune visual tokens (pruning needs the whole prompt in "
                             "one forward): prefill whole, or set keep_ratio: 1.0")
        self._capture = {}
        try:
            run()
            parts = self._capture
        finally:
            self._capture = None
        if "inputs_embeds" not in parts:
            raise RuntimeError("the model's forward did not call its text model")
        return parts

    def prefill_chunk(self, parts: dict[str, Any], start: int, end: int, past_key_values: Any) -> torch.Tensor:
        """Positions [start, end) of a prompt from `prefill_parts` through the text model, on top of the
        first `start` in `past_key_values`: (1, end - start, H), final norm applied."""
        visual, deepstack = parts["visual_pos_masks"], parts["deepstack_visual_embeds"]
        if visual is not None:
            before, inside = int(visual[0, :start].sum()), int(visual[0, start:end].sum())
            visual = visual[:, start:end] if inside else None
            deepstack = [d[before:before + inside] for d in deepstack] if deepstack is not None and inside else None
        positions = parts["position_ids"]  # None for text alone: positions follow the cache's length
        return self(inputs_embeds=parts["inputs_embeds"][:, start:end],
                    position_ids=positions[..., start:end] if positions is not None else None,
                    past_key_values=past_key_values, use_cache=True, visual_pos_masks=visual,
                    deepstack_visual_embeds=deepstack, **self.modality_of(parts, start, end)).last_hidden_state

    def modality_of(self, parts: dict[str, Any], start: int = 0, end: int | None = None) -> dict[str, Any]:
        """The keyword argument with positions [start, end) of the experts' modality that `prefill_parts`
        captured (a modality-separated family's), or nothing."""
        modality = parts.get("modality")
        return {self._modality: modality[:, start:end]} if modality is not None else {}

    def _visual_summary(self, inputs_embeds: torch.Tensor, visual: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """h_v for the lookahead predictor: the mean visual embedding (of the kept tokens, once pruned); `rows`: the
        visual rows of a batch of one where known (a boolean mask's selection waits for the device)."""
        runtime = self.context.offload_runtime
        if runtime is not None:
            embeds = inputs_embeds[visual] if rows is None else inputs_embeds.reshape(-1, inputs_embeds.shape[-1])[rows]
            runtime.set_visual_summary(embeds.float().mean(dim=0))

    def _prefix_attention(self, layer: nn.Module, hidden: torch.Tensor, position_embeddings, rows: torch.Tensor):
        """FastV-style saliency: the last token's attention to each visual token (`rows`) in this prefix layer,
        left on the device."""
        adapter = self.adapter
        with torch.no_grad():
            normed = adapter.input_norm(layer)(hidden)
            return adapter.last_token_attention(adapter.attention(layer), normed, position_embeddings, rows)

    def _count(self, kept_visual: int, before: int, after: int, seconds: float) -> None:
        c = self.counters
        c.pruned_prefills += 1
        self.context.pruning.pruned_prefills += 1
        c.tokens_before += before
        c.tokens_after += after
        c.visual_tokens_after += kept_visual
        c.visual_tokens_before += kept_visual + (before - after)
        c.compression_seconds += seconds

    def stats(self) -> dict[str, Any]:
        if self._expert_counts is not None:  # the prefix experts' counts, kept on the device until asked for
            every, kept = self._expert_counts.tolist()
            self.counters.prefix_experts_visual_all += every
            self.counters.prefix_experts_visual_kept += kept
            self._expert_counts = None
        return {"compression": self.settings.compression, "keep_ratio": self.settings.keep_ratio if self.settings.active else 1.0,
                **asdict(self.counters)}

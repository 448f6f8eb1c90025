"""Routing traces: what each MoE layer chose for each request and step, on disk.

Format: one safetensors file per request, `request-000123.safetensors`, holding for each step s
(step 0 is the prefill, then one per decoded token):
    s{s}.active   uint8 (L, E)   1 where MoE layer l (in MoE-layer order) routed at least one token to e
    s{s}.hidden   float16 (L, H) mean of the tokens' MoE inputs at layer l (the predictor's h_h)
    s{s}.routes.{l}  int16 (T_l, K)  the routed experts of every token at MoE layer l
and once per request:
    modality      uint8 (T,)     1 for visual tokens of the prompt
    kept          int64 (T',)    prompt positions that continued past the prefix (absent: no pruning)
    visual        float16 (V,)   mean of the kept visual tokens' embeddings (the predictor's h_v)
The metadata (strings) holds `steps`, `moe_layers` (JSON list of decoder-layer indices) and `phases`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class TraceRecorder:
    """Hooks the routers (and the vision tower) of a loaded model; `finish()` writes one request."""

    def __init__(self, model: nn.Module, adapter: Any):
        self.model, self.adapter = model, adapter
        layers = adapter.decoder_layers(model)
        self.moe_layers = [i for i, layer in enumerate(layers) if adapter.router(layer) is not None]
        self.position = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.num_experts = adapter.moe_shape(model.config).num_experts
        self._handles = [adapter.router(layers[i]).register_forward_hook(self._route(i)) for i in self.moe_layers]
        self._handles.append(adapter.vision_tower(model).register_forward_hook(self._vision))
        self.reset()

    def reset(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._visual_embeds: torch.Tensor | None = None

    def _route(self, layer: int):
        def hook(module, args, output):
            routes = self.adapter.routed_experts(output)
            index = self.position[layer]
            if index == 0 or not self.steps:  # the first MoE layer opens a step
                self.steps.append({"routes": {}, "hidden": {}})
            step = self.steps[-1]
            step["routes"][index] = routes.detach().to(torch.int16).cpu()
            step["hidden"][index] = args[0].detach().float().mean(dim=0).cpu()
        return hook

    def _vision(self, module, args, output):
        embeds = getattr(output, "pooler_output", None)
        if embeds is None and isinstance(output, tuple):
            embeds = output[1] if len(output) > 1 else output[0]
        self._visual_embeds = embeds.detach().float().cpu() if isinstance(embeds, torch.Tensor) else None

    def finish(self, path: Path, visual_mask: torch.Tensor, kept: torch.Tensor | None,
               with_visual: bool = True) -> dict[str, Any]:
        """Write the steps recorded since the last reset as one request; returns its summary.
        `with_visual=False` stores a zero visual summary: what the runtime feeds the predictor when no
        VisDecoder computes h_v, so training and serving see the same features."""
        tensors: dict[str, torch.Tensor] = {"modality": visual_mask.to(torch.uint8).cpu().contiguous()}
        if kept is not None:
            tensors["kept"] = kept.cpu().to(torch.int64).contiguous()
        hidden_size = None
        for s, step in enumerate(self.steps):
            active = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.uint8)
            for index, routes in step["routes"].items():
                active[index, routes.long().flatten().unique()] = 1
                tensors[f"s{s}.routes.{index}"] = routes.contiguous()
            tensors[f"s{s}.active"] = active
            hidden = torch.stack([step["hidden"][i] for i in sorted(step["hidden"])])
            hidden_size = hidden.shape[1]
            tensors[f"s{s}.hidden"] = hidden.half().contiguous()
        visual = torch.zeros(hidden_size or 1)
        if with_visual and self._visual_embeds is not None and self._visual_embeds.numel():
            embeds = self._visual_embeds
            if kept is not None and visual_mask.any():
                visual_positions = torch.nonzero(visual_mask, as_tuple=True)[0]
                kept_visual = torch.isin(visual_positions, kept.to(visual_positions.device))
                embeds = embeds[kept_visual[: embeds.shape[0]].to(embeds.device)]
            visual = embeds.mean(dim=0)
        tensors["visual"] = visual.half().contiguous()
        phases = ["prefill"] + ["decode"] * (len(self.steps) - 1)
        metadata = {"steps": str(len(self.steps)), "moe_layers": json.dumps(self.moe_layers), "phases": json.dumps(phases)}
        save_file(tensors, str(path), metadata=metadata)
        return {"steps": len(self.steps), "prompt_tokens": int(visual_mask.numel()), "visual_tokens": int(visual_mask.sum())}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Steps of one request as predictor inputs: dicts with active (L, E) bool, hidden (L, H), visual, phase."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    phases = json.loads(metadata["phases"])
    return [{"active": tensors[f"s{s}.active"].bool(), "hidden": tensors[f"s{s}.hidden"].float(),
             "visual": tensors["visual"].float(), "phase": phases[s]} for s in range(int(metadata["steps"]))]

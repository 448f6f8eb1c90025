"""VisExperts: a layer's routed experts served by the shared offload runtime.

Replaces `...mlp.experts` (the HF experts module is called as `experts(hidden[T, H],
top_k_index[T, K], top_k_weights[T, K])` after the model's own router). Its weights never become
parameters: `load()` reads the layer's fused tensors through the loader and hands them to the
runtime, which keeps them in a GPU bank (pinned prefix) or in the host ExpertStore.

Rule kwargs (all operators of a model must agree; the first one creates the runtime):
    expert_budget      GPU memory for routed experts, bytes or "24GiB" (pinned prefix + slabs)
    policy             vismmoe (default) | lru
    pinned_layers      auto (Eq. 10) | an int, checked against the budget
    min_pinned_layers  L_semantic of Eq. 10 (default 1)
    min_cache_bytes    C_safe of Eq. 10 (default: one layer of experts)
    prefetch_window, prefetch_gamma, max_in_flight
    miss_policy        wait (default: fetch a missing expert, stall on it) | cpu (run its tokens on the
                       CPU backend, overlapped with the GPU's hits) | auto (per expert, by a cost model
                       measured at start-up, or `cost_model: {fetch_seconds, cpu_seconds_fixed,
                       cpu_seconds_per_token}`)
    cpu_backend        torch (default: reads the host store in place) | kt-kernel | auto
    predictor          path of a trained lookahead predictor (vismmoe-kt calibrate writes predictor.pt);
                       null: the history policy (prefetch_window, prefetch_gamma)
    prefetch_topk      B, the (layer, expert) pairs the predictor queues at each layer (20)
Compute runs on `generate_device` (its slabs and banks live there).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..models import adapter_for
from ..runtime.budget import BudgetError
from ..runtime.offload import OffloadRuntime, OffloadSettings
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule

CONTEXT_KEY = "offload_runtime"
_WEIGHTS = ("gate_up_proj", "down_proj")


def shared_runtime(loader: Any, config: Any, settings: OffloadSettings, device: str) -> OffloadRuntime:
    """The one runtime of this load, created by the first operator; later ones must agree with it."""
    context = getattr(loader, "context", None)
    if context is None:
        raise ValueError("VisExperts needs vismmoe_kt's loader (load the model with vismmoe_kt.load)")
    runtime = context.get(CONTEXT_KEY)
    if runtime is None:
        adapter = adapter_for(config.model_type)
        text = adapter.text_config(config)
        dtype = loader.dtype or getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        runtime = OffloadRuntime(settings, adapter.moe_layers_from_config(config), text.num_experts,
                                 text.hidden_size, text.moe_intermediate_size, dtype, device, text.num_experts_per_tok)
        context[CONTEXT_KEY] = runtime
    elif runtime.settings != settings or runtime.device != torch.device(device):
        raise ValueError("every VisExperts rule of a model must use the same runtime kwargs and device")
    return runtime


class VisExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module,
                 prefill_device: str = "cuda", generate_device: str = "cuda", expert_budget: Any = None,
                 policy: str = "vismmoe", pinned_layers: Any = "auto", min_pinned_layers: int = 1,
                 min_cache_bytes: Any = None, prefetch_window: int = 2, prefetch_gamma: float = 0.8,
                 max_in_flight: int = 16, miss_policy: str = "wait", cpu_backend: str = "torch",
                 cost_model: dict | None = None, predictor: str | None = None, prefetch_topk: int = 20,
                 **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        match = re.search(r"layers\.(\d+)\.", key)
        if not match:
            raise ValueError(f"cannot tell the layer index from module name {key!r}")
        self.layer = int(match.group(1))
        settings = OffloadSettings.from_kwargs(expert_budget, policy, pinned_layers, min_pinned_layers,
                                               min_cache_bytes, prefetch_window, prefetch_gamma, max_in_flight,
                                               miss_policy, cpu_backend, cost_model, predictor, prefetch_topk)
        self.runtime = shared_runtime(gguf_loader, config, settings, self.generate_device)
        if self.layer not in self.runtime.moe_layers:
            raise ValueError(f"{key} is not an MoE layer of this model")

    def load(self) -> None:
        from ..core.weights import read_tensor

        experts = self.orig_module
        # where the loader hands tensors over fastest: host memory for a checkpoint (mmap), the GPU for
        # synthetic weights (made there); the runtime copies them into its store or banks either way
        staging = torch.device(getattr(self.gguf_loader, "staging_device", "cpu"))
        tensors = [read_tensor(self.gguf_loader, f"{self.key}.{name}", staging, getattr(experts, name).shape)
                   for name in _WEIGHTS]
        self.runtime.load_layer(self.layer, *tensors)
        for name in _WEIGHTS:  # the runtime owns the weights now; no meta parameters stay behind
            del experts._parameters[name]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights, self.orig_module.act_fn)

    def decode_capturable(self) -> bool:
        return self.runtime.decode_capturable(self.layer)

    def stats(self) -> dict[str, Any]:
        return {**self.runtime.summary_once(self.layer), **self.runtime.layer_stats(self.layer)}

    def extra_repr(self) -> str:
        where = "pinned" if self.layer in self.runtime.pinned else "offloaded"
        return f"{super().extra_repr()}, layer={self.layer} ({where})"

"""VisExperts: a layer's routed experts served by the shared offload runtime.

Replaces `...mlp.experts` (the HF experts module is called as `experts(hidden[T, H],
top_k_index[T, K], top_k_weights[T, K])` after the model's own router). Its weights never become
parameters: `load()` reads the layer's fused tensors through the loader and hands them to the
runtime, which keeps them in a GPU bank (pinned prefix) or in the host ExpertStore.

Rule kwargs: OffloadSettings (vismmoe_kt/runtime/offload_settings.py); all operators of a model
must agree, the first one creates the runtime and hands it its prefetch policy (the lookahead
predictor's when `predictor` names one, else the history policy), and puts it in the load context,
where the decode step finds it (its step hooks keep the cache between steps). Compute runs on
`generate_device` (its slabs and banks live there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime.offload import OffloadRuntime
from ..runtime.offload_settings import OffloadSettings
from .base import (HF_READ_ATTRIBUTES, BaseInjectedModule, gguf_down_formats, gguf_expert_format, settings_from,
                   stored_gguf_experts)


def checkpoint_format(operator: "VisExperts", settings: OffloadSettings) -> str | None:
    """The GGUF's expert format (q8_0, q4_0, q4_k or q5_k) where `store_dtype: auto` may keep the file's
    bytes as they are, else None: a fact for the runtime's plan (offload_plan.py decides)."""
    if settings.store_dtype != "auto":
        return None
    return gguf_expert_format(operator.gguf_loader, operator.key, operator.adapter.expert_tensors)


def shared_runtime(operator: "VisExperts", settings: OffloadSettings, expert_set: str | None = None) -> OffloadRuntime:
    """The one runtime of this load's expert set (the primary one: `context.offload_runtime`), made by the
    first operator; later ones must agree with it."""
    context, adapter, config = operator.context, operator.adapter, operator.config
    runtime = context.offload_runtime if expert_set is None else context.expert_set_runtimes.get(expert_set)
    device = operator.generate_device
    if runtime is None:
        shape = adapter.expert_set_shape(config, expert_set)
        dtype = operator.model_dtype
        prefetch = lookahead = None
        if settings.predictor:
            prefetch, lookahead = predictor_policies(settings, shape, context, torch.device(device))
        # quantized slabs are sized for the largest down experts the file holds (a Q4_K_M file's Q6_K)
        down_formats = gguf_down_formats(operator.gguf_loader, adapter, list(shape.moe_layers)) \
            if settings.slab_format != "dequantized" else {}
        runtime = OffloadRuntime(settings, list(shape.moe_layers), shape.num_experts, shape.hidden, shape.inter,
                                 dtype, device, shape.top_k, prefetch, lookahead, context.cpu_threads,
                                 getattr(operator.gguf_loader, "model_dir", None),
                                 getattr(operator.gguf_loader, "weight_files", list)(), down_formats,
                                 checkpoint_format(operator, settings))
        if expert_set is not None:  # a second set runs in prefills only: no decode table, no step hooks
            context.expert_set_runtimes[expert_set] = runtime
            return runtime
        context.offload_runtime = runtime
        if runtime.enable_table(adapter.expert_activation(operator.orig_module)):
            context.graph_variants.append(runtime.graph_variant)  # the decode step's captures depend on it
    elif runtime.requested_settings != settings or runtime.device != torch.device(device):
        raise ValueError(f"every {type(operator).__name__} rule of a model must use the same runtime kwargs and device")
    return runtime


def predictor_policies(settings: OffloadSettings, shape: Any, context: Any, device: torch.device) -> tuple[Any, Any]:
    """The calibrated predictor twice: as the placement path's prefetch policy (prefill), and on the
    device inside table decode steps (DeviceLookahead). A predictor calibrated on synthetic routing
    reads the routing source's latent state instead of the model's hidden state."""
    from ..predictor.device_lookahead import DeviceLookahead
    from ..predictor.prefetch import PredictorPrefetch

    prefetch = PredictorPrefetch.load(settings.predictor, settings.prefetch_topk, len(shape.moe_layers),
                                      shape.num_experts, shape.hidden, device)
    hidden_of = None
    if getattr(prefetch.predictor.config, "hidden_source", "model") == "synthetic":
        def hidden_of(index: int, hidden: torch.Tensor) -> torch.Tensor:
            if context.routing is None:
                from ..errors import InputError

                raise InputError(f"predictor {settings.predictor} was calibrated on synthetic routing "
                                 "(hidden_source: synthetic): it needs --routing synthetic")
            return context.routing.latent(index)
        prefetch.hidden_of = hidden_of
    lookahead = DeviceLookahead(prefetch.predictor, settings.prefetch_topk, device,
                                settings.prefetch_min_probability, hidden_of, settings.prefetch_stride)
    return prefetch, lookahead


class VisExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)
    second_set = False  # serves a layer's primary expert set (VisionExperts: the second one)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module,
                 prefill_device: str = "cuda", generate_device: str = "cuda", **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device)
        self.layer = self.adapter.layer_of(key)
        expert_set = self.adapter.expert_set(key)
        name = type(self).__name__
        if (expert_set is not None) != self.second_set:
            other = "VisionExperts" if expert_set is not None else "VisExperts"
            raise ValueError(f"{key} holds {'the ' + expert_set if expert_set else 'the primary'} experts of its "
                             f"layer: match it with {other}, not {name}")
        settings = settings_from(OffloadSettings, kwargs, name)
        if expert_set is not None and settings.predictor:
            raise ValueError(f"{name} ({key}): the lookahead predictor serves the decode experts; set predictor: "
                             "null for a second expert set")
        self.runtime = shared_runtime(self, settings, expert_set)
        if self.layer not in self.runtime.moe_layers:
            raise ValueError(f"{key} is not an MoE layer of this model")
        self.act = self.adapter.expert_activation(orig_module)

    def load(self) -> None:
        from ..core.weights import read_tensor

        experts, names = self.orig_module, self.adapter.expert_tensors
        if self.runtime.store.quantized:  # an offloaded layer, or one pinned as blocks (raw_down_format says)
            stored = stored_gguf_experts(self.gguf_loader, self.key, names)  # a GGUF's quantized experts
            down = self.runtime.raw_down_format(self.layer, *(kind for _, kind in stored)) if stored else None
            if down is not None:  # its bytes, as they are (a Q4_K_M file's Q6_K down too)
                self.runtime.load_layer_raw(self.layer, *(data for data, _ in stored), down_format=down)
                for name in names:
                    del experts._parameters[name]
                return
        # where the loader hands tensors over fastest: host memory for a checkpoint (mmap), the GPU for
        # synthetic weights (made there); the runtime copies them into its store or banks either way
        staging = torch.device(getattr(self.gguf_loader, "staging_device", "cpu"))
        tensors = [read_tensor(self.gguf_loader, f"{self.key}.{name}", staging, getattr(experts, name).shape,
                               self.adapter.gguf_names)
                   for name in names]
        # the hybrid's kt-kernel copy can be a GGUF's quantized experts as stored (cpu_dtype: auto)
        stored = stored_gguf_experts(self.gguf_loader, self.key, names) if self.runtime.takes_stored(self.layer) else None
        self.runtime.load_layer(self.layer, *tensors, stored=stored)
        for name in names:  # the runtime owns the weights now; no meta parameters stay behind
            del experts._parameters[name]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights, self.act)

    def decode_capturable(self) -> bool:
        return self.runtime.decode_capturable(self.layer)

    def batch_capturable(self) -> bool:
        return self.runtime.batch_capturable(self.layer)

    def stats(self) -> dict[str, Any]:
        return {**self.runtime.summary_once(self.layer), **self.runtime.layer_stats(self.layer)}

    def extra_repr(self) -> str:
        where = "pinned" if self.layer in self.runtime.pinned else "offloaded"
        return f"{super().extra_repr()}, layer={self.layer} ({where})"


class VisionExperts(VisExperts):
    """The second expert set of a modality-separated MoE layer (ERNIE-4.5-VL's vision experts), offloaded
    apart from the decode experts.

    Only image tokens (and their start/end markers) route to these experts, so they run in prefills with
    images and never in decode. Their own runtime (`context.expert_set_runtimes`), budget and policy keep
    them from taking the GPU memory the decode experts' slabs need: a small budget streams each prefill's
    vision experts from the host store through a few slabs, and nothing of theirs stays in the decode
    step (no decode table, no step hooks, no lookahead predictor). Rule kwargs: OffloadSettings, as
    VisExperts; every VisionExperts rule of a model must agree."""

    second_set = True

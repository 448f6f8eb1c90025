"""PlacedExperts: a layer's routed experts with their weights on one device, computed on another.

Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
The HF experts module is called as `experts(hidden[T, H], top_k_index[T, K], top_k_weights[T, K])`.

Two placements, chosen by the rule's kwargs:
- compute where the weights are (`weights_device` == compute device): activations are shipped to
  the experts and the result back. Experts on `cpu` beside a GPU model is KTransformers' layout
  with torch as the CPU backend.
- weights on the host, compute on the GPU: every call copies the experts its tokens routed to and
  drops them afterwards. That is on-demand loading with no cache, the baseline the offload
  runtime's slab cache improves on.
The compute device is `prefill_device` for calls with more than one token, else `generate_device`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import HF_READ_ATTRIBUTES, BaseInjectedModule


def routed_expert_mlp(
    hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, act: Any,
) -> torch.Tensor:
    """Reference SwiGLU experts: `index` addresses rows of gate_up (E', 2I, H) and down (E', H, I)."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(index).tolist():
        token, slot = torch.where(index == expert)
        gate, up = F.linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@dataclass
class ExpertCallStats:
    calls: int = 0
    tokens: int = 0
    experts_fetched: int = 0
    bytes_fetched: int = 0


class PlacedExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("gate_up_proj", "down_proj", "act_fn")

    def __init__(
        self,
        key: str,
        gguf_loader: Any,
        config: Any,
        orig_module: nn.Module,
        prefill_device: str = "cuda",
        generate_device: str = "cuda",
        weights_device: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        for needed in ("gate_up_proj", "down_proj", "act_fn"):
            if not hasattr(orig_module, needed):
                raise ValueError(f"{type(orig_module).__name__} has no {needed!r}: PlacedExperts needs fused experts")
        self._weights_device = str(weights_device) if weights_device is not None else None
        self.counters = ExpertCallStats()

    @property
    def weights_device(self) -> torch.device:
        return torch.device(self._weights_device or self.generate_device)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out_device = hidden_states.device
        compute = torch.device(self.prefill_device if hidden_states.shape[0] > 1 else self.generate_device)
        self.counters.calls += 1
        self.counters.tokens += hidden_states.shape[0]
        hidden, index, weights = (t.to(compute) for t in (hidden_states, top_k_index, top_k_weights))
        experts = self.orig_module
        if compute == self.weights_device:
            return experts(hidden, index, weights).to(out_device)
        hit, local_index = torch.unique(index, return_inverse=True)  # fetch only the routed experts
        rows = hit.to(self.weights_device)
        gate_up = experts.gate_up_proj[rows].to(compute, non_blocking=True)
        down = experts.down_proj[rows].to(compute, non_blocking=True)
        self.counters.experts_fetched += hit.numel()
        self.counters.bytes_fetched += gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        return routed_expert_mlp(hidden, local_index, weights, gate_up, down, experts.act_fn).to(out_device)

    def stats(self) -> dict[str, Any]:
        return {"weights_device": str(self.weights_device), **asdict(self.counters)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weights_device={self.weights_device}"

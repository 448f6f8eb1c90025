"""ExpertParallelExperts: a layer's routed experts split over the ranks of a torch.distributed group.

Replaces `...mlp.experts`; each rank keeps only its own experts (read from the checkpoint, the rest
dropped), so host and device memory per rank fall with the group size. Attention and everything
else stay replicated: each rank serves its own requests (data parallel), as in ReaLB's setting.
Rule kwargs: expert_map (null: contiguous; or a list giving each expert's rank).
The process group must exist (torchrun + init_process_group); without one this is a clear error.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.expert_parallel import contiguous_map, ep_forward
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule


class ExpertParallelExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module, prefill_device: str = "cuda",
                 generate_device: str = "cuda", expert_map: list[int] | None = None, **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("expert parallelism needs a torch.distributed process group: launch with torchrun "
                             "(vismmoe-kt ... under `torchrun --nproc-per-node N`) or call init_process_group first")
        ranks, num_experts = dist.get_world_size(), orig_module.num_experts
        rank_of = torch.tensor(expert_map) if expert_map is not None else contiguous_map(num_experts, ranks)
        if rank_of.shape != (num_experts,) or int(rank_of.min()) < 0 or int(rank_of.max()) >= ranks:
            raise ValueError(f"expert_map must give each of the {num_experts} experts a rank in 0..{ranks - 1}")
        self.expert_rank = rank_of
        self.local_experts = torch.nonzero(rank_of == dist.get_rank(), as_tuple=True)[0]
        match = re.search(r"layers\.(\d+)\.", key)
        self.layer = int(match.group(1)) if match else -1
        self.local_gate_up: torch.Tensor | None = None
        self.local_down: torch.Tensor | None = None

    def load(self) -> None:
        from ..weights import read_tensor

        experts = self.orig_module
        device = self.weights_device
        full = {name: read_tensor(self.gguf_loader, f"{self.key}.{name}", torch.device("cpu"), getattr(experts, name).shape)
                for name in ("gate_up_proj", "down_proj")}
        self.local_gate_up = full["gate_up_proj"][self.local_experts].to(device).contiguous()
        self.local_down = full["down_proj"][self.local_experts].to(device).contiguous()
        for name in ("gate_up_proj", "down_proj"):
            del experts._parameters[name]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return ep_forward(hidden_states, top_k_index, top_k_weights, self.local_gate_up, self.local_down,
                          self.local_experts, self.expert_rank, self.orig_module.act_fn)

    def stats(self) -> dict[str, Any]:
        return {"ep_size": str(dist.get_world_size()), "local_experts": int(self.local_experts.numel())}

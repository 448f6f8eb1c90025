"""ExpertParallelExperts: a layer's routed experts split over the ranks of a torch.distributed group.

Replaces `...mlp.experts`; each rank keeps only its own experts (read from the checkpoint, the rest
dropped), so host and device memory per rank fall with the group size. Attention and everything
else stay replicated: each rank serves its own requests (data parallel), as in ReaLB's setting.
Rule kwargs: expert_map (null: contiguous; or a list giving each expert's rank); ReaLB on real ranks:
mode (bf16 | realb | realb-seq | fixed | all), fixed_threshold, precision_backend, lb_gate_tokens, fp4_scope,
eps, lowprec_cost, md_start, md_min -- the same plan and AIMD code as MixedPrecisionExperts, fed by
the group's summed per-expert loads, so every rank takes the same decision.
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
                 generate_device: str = "cuda", expert_map: list[int] | None = None, mode: str = "bf16",
                 fixed_threshold: float = 0.7, precision_backend: str = "auto", lb_gate_tokens: int = 2048,
                 fp4_scope: str = "vision_tokens", eps: float = 0.05, lowprec_cost: float = 0.5,
                 md_start: float = 0.9, md_min: float = 0.0, **kwargs: Any):
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
        from ..lb.controller import RealbController
        from ..lb.precision import expert_mlp_fn, resolve_backend
        from .vis_decoder import shared_context

        self.mode, self.scope = mode, fp4_scope
        self.controller = RealbController(mode, float(fixed_threshold), int(lb_gate_tokens), float(eps),
                                          float(lowprec_cost), fp4_scope, float(md_start), float(md_min))
        self.lowprec_mlp = expert_mlp_fn(resolve_backend(precision_backend, self.generate_device))
        self.shared = shared_context(gguf_loader)
        self.last_plan: torch.Tensor | None = None  # switched experts of the last call (same on every rank)

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

    def _plan(self, load: torch.Tensor, vision: torch.Tensor, tokens: int) -> torch.Tensor:
        self.last_plan, _ = self.controller.decide(load, vision, self.expert_rank, dist.get_world_size(), tokens)
        return self.last_plan

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        visual = self.shared.token_is_visual
        if visual is None or visual.numel() != hidden_states.shape[0]:
            visual = None
        return ep_forward(hidden_states, top_k_index, top_k_weights, self.local_gate_up, self.local_down,
                          self.local_experts, self.expert_rank, self.orig_module.act_fn, visual=visual,
                          plan=None if self.mode == "bf16" else self._plan, lowprec_mlp=self.lowprec_mlp,
                          whole_expert=self.mode == "all" or self.scope == "expert")

    def stats(self) -> dict[str, Any]:
        return {"ep_size": str(dist.get_world_size()), "local_experts": int(self.local_experts.numel())}

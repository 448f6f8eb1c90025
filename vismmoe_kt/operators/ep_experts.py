"""ExpertParallelExperts: a layer's routed experts split over the ranks of a torch.distributed group.

Replaces `...mlp.experts`; each rank keeps only its own experts (read from the checkpoint, the rest
dropped), so host and device memory per rank fall with the group size. Attention and everything
else stay replicated: each rank serves its own requests (data parallel), as in ReaLB's setting.
Rule kwargs: expert_map (null: contiguous; or a list giving each expert's rank); ReaLB on real ranks:
mode (bf16 | realb | realb-seq | fixed | all | eplb), fixed_threshold, precision_backend, lb_gate_tokens, fp4_scope,
eps, lowprec_cost, md_start, md_min -- the same plan and AIMD code as MixedPrecisionExperts, fed by
the group's summed per-expert loads, so every rank takes the same decision; EPLB (mode eplb):
eplb_redundant (null: one extra copy per rank), eplb_period (8), eplb_window (16).
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
                 md_start: float = 0.9, md_min: float = 0.0, eplb_redundant: int | None = None,
                 eplb_period: int = 8, eplb_window: int = 16, **kwargs: Any):
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
        self.controller = RealbController("bf16" if mode == "eplb" else mode, float(fixed_threshold),
                                          int(lb_gate_tokens), float(eps), float(lowprec_cost), fp4_scope,
                                          float(md_start), float(md_min))
        # EPLB: copies of hot experts on several ranks, re-placed every `eplb_period` steps from the
        # group's summed loads of the last `eplb_window` steps; weights move through the group
        self.holders = [[int(r)] for r in rank_of]
        self.eplb_redundant = ranks if eplb_redundant is None else int(eplb_redundant)
        self.eplb_period, self.eplb_window, self.steps = int(eplb_period), int(eplb_window), 0
        self.load_history: list[torch.Tensor] = []
        if mode == "eplb" and (num_experts + self.eplb_redundant) % ranks:
            raise ValueError(f"experts + eplb_redundant ({num_experts} + {self.eplb_redundant}) must split evenly "
                             f"over {ranks} ranks")
        self.lowprec_mlp = expert_mlp_fn(resolve_backend(precision_backend, self.generate_device))
        self.shared = shared_context(gguf_loader)
        self.last_plan: torch.Tensor | None = None  # switched experts of the last call (same on every rank)

    def load(self) -> None:
        from ..core.weights import read_tensor

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

    def _replace_experts(self, top_k_index: torch.Tensor) -> None:
        """EPLB: record this step's global loads; every `eplb_period` steps move to a new placement."""
        from ..parallel.replication import move_weights, placement_table

        load = torch.bincount(top_k_index.reshape(-1), minlength=self.expert_rank.numel()).double()
        dist.all_reduce(load)
        self.load_history = (self.load_history + [load.cpu()])[-self.eplb_window:]
        self.steps += 1
        if self.steps % self.eplb_period:
            return
        new = placement_table(torch.stack(self.load_history).mean(dim=0), self.eplb_redundant, dist.get_world_size())
        held = {int(e): torch.cat([self.local_gate_up[i].flatten(), self.local_down[i].flatten()])
                for i, e in enumerate(self.local_experts.tolist())}
        moved = move_weights(held, self.holders, new)
        self.holders = new
        split = self.local_gate_up[0].numel()
        gate_up_shape, down_shape = self.local_gate_up.shape[1:], self.local_down.shape[1:]
        self.local_experts = torch.tensor(sorted(moved), dtype=torch.long)
        self.local_gate_up = torch.stack([moved[e][:split].view(gate_up_shape) for e in self.local_experts.tolist()])
        self.local_down = torch.stack([moved[e][split:].view(down_shape) for e in self.local_experts.tolist()])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        holders = None
        if self.mode == "eplb":
            from ..parallel.replication import holders_tensor

            holders = holders_tensor(self.holders)
        visual = self.shared.token_is_visual
        if visual is None or visual.numel() != hidden_states.shape[0]:
            visual = None
        out = ep_forward(hidden_states, top_k_index, top_k_weights, self.local_gate_up, self.local_down,
                          self.local_experts, self.expert_rank, self.orig_module.act_fn, visual=visual,
                          plan=None if self.mode in ("bf16", "eplb") else self._plan, lowprec_mlp=self.lowprec_mlp,
                          whole_expert=self.mode == "all" or self.scope == "expert", holders=holders)
        if self.mode == "eplb":  # after the step, so a re-placement never splits one layer's exchange
            self._replace_experts(top_k_index)
        return out

    def stats(self) -> dict[str, Any]:
        return {"ep_size": str(dist.get_world_size()), "local_experts": int(self.local_experts.numel())}

"""ExpertParallelExperts: a layer's routed experts split over the ranks of a torch.distributed group.

Replaces `...mlp.experts`; each rank keeps only its own experts (read from the checkpoint, the rest
dropped), so host and device memory per rank fall with the group size. Attention and everything
else stay replicated: each rank serves its own requests (data parallel), as in ReaLB's setting.
Rule kwargs: ExpertParallelSettings (vismmoe_kt/lb/settings.py): expert_map, and ReaLB on real
ranks -- the same plan and AIMD code as MixedPrecisionExperts, fed by the group's summed per-expert
loads, so every rank takes the same decision; mode eplb replicates hot experts instead. Decode steps
(announced with their rows on every rank: context.ep_fixed_rows) exchange fixed-size buffers with no
read on the host (ep_forward_static) wherever no precision decision is needed.
The process group must exist (torchrun + init_process_group); without one this is a clear error.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.graphs import warming_up
from ..lb.controller import RealbStats
from ..lb.fp8_experts import Fp8Experts
from ..lb.precision import expert_mlp_fn, resolve_backend
from ..lb.settings import ExpertParallelSettings
from ..parallel.compute_timer import ComputeTimer
from ..parallel.expert_parallel import contiguous_map, ep_forward, ep_forward_static
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule, settings_from


class ExpertParallelExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("act_fn",)

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module, prefill_device: str = "cuda",
                 generate_device: str = "cuda", **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device)
        s = self.settings = settings_from(ExpertParallelSettings, kwargs, "ExpertParallelExperts")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("expert parallelism needs a torch.distributed process group: launch with torchrun "
                             "(vismmoe-kt ... under `torchrun --nproc-per-node N`) or call init_process_group first")
        ranks, num_experts = dist.get_world_size(), self.adapter.moe_shape(config).num_experts
        rank_of = torch.tensor(s.expert_map, device="cpu") if s.expert_map is not None \
            else contiguous_map(num_experts, ranks)
        if rank_of.shape != (num_experts,) or int(rank_of.min()) < 0 or int(rank_of.max()) >= ranks:
            raise ValueError(f"expert_map must give each of the {num_experts} experts a rank in 0..{ranks - 1}")
        self.expert_rank = rank_of
        self.local_experts = torch.nonzero(rank_of == dist.get_rank(), as_tuple=True)[0]
        self.layer = self.adapter.layer_of(key)
        self.local_gate_up: torch.Tensor | None = None
        self.local_down: torch.Tensor | None = None
        self.mode, self.scope = s.mode, s.fp4_scope
        self.controller = s.controller()
        # EPLB: copies of hot experts on several ranks, re-placed every `eplb_period` steps from the
        # group's summed loads of the last `eplb_window` steps; weights move through the group
        self.holders = [[int(r)] for r in rank_of]
        self.eplb_redundant = ranks if s.eplb_redundant is None else s.eplb_redundant
        self.eplb_period, self.eplb_window, self.steps = s.eplb_period, s.eplb_window, 0
        self.load_history: list[torch.Tensor] = []
        self.eplb_moves = 0
        self.pending_move = None  # Async EPLB: (the move under way, its holders table)
        if s.mode == "eplb" and (num_experts + self.eplb_redundant) % ranks:
            raise ValueError(f"experts + eplb_redundant ({num_experts} + {self.eplb_redundant}) must split evenly "
                             f"over {ranks} ranks")
        self.backend = resolve_backend(s.precision_backend, self.generate_device)
        self.lowprec_mlp = expert_mlp_fn(self.backend)
        self.fp8: Fp8Experts | None = None  # the fp8 backend's E4M3 copy of this rank's experts (made at load)
        self.act = self.adapter.expert_activation(orig_module)
        self.last_plan: torch.Tensor | None = None  # switched experts of the last call (same on every rank)
        self.fixed_passes = 0
        self.timer = ComputeTimer(self.generate_device)  # this rank's own compute per call (off unless enabled)
        self.counters = RealbStats()  # the group's: pairs, switched ones, the LB gate, imbalance
        # decode steps exchange fixed-size buffers (no host reads) where no host decision is needed: BF16,
        # or ReaLB whose LB gate cannot open at the step's rows on every rank (`_fixed_exchange`)
        self.ranks, self.gate_tokens = ranks, s.lb_gate_tokens
        self.context.expert_parallel.append(self)  # followers drive these in layer order (parallel/launch.py)
        if s.capture_exchange and not any(getattr(v, "ep_rows", False) for v in self.context.graph_variants):
            # a captured exchange has the size of its capture: one capture per step size of the group
            # (data parallel: the most rows any rank brings, which the step hooks set before this is read)
            def rows(context=self.context) -> int:
                return context.ep_step_rows
            rows.ep_rows = True
            self.context.graph_variants.append(rows)
        self.context.expert_parallel.sort(key=lambda op: op.layer)

    def load(self) -> None:
        from ..core.weights import read_tensor

        experts, (gate_up, down) = self.orig_module, self.adapter.expert_tensors
        device = self.weights_device
        full = {name: read_tensor(self.gguf_loader, f"{self.key}.{name}", torch.device("cpu"),
                                       getattr(experts, name).shape, self.adapter.gguf_names)
                for name in (gate_up, down)}
        self.local_gate_up = full[gate_up][self.local_experts].to(device).contiguous()
        self.local_down = full[down][self.local_experts].to(device).contiguous()
        self._place_tables()
        for name in (gate_up, down):
            del experts._parameters[name]
        if self.backend == "fp8" and self.mode not in ("bf16", "eplb"):  # eplb moves weights: never switches
            self.fp8 = Fp8Experts(self.local_gate_up, self.local_down)  # this rank's experts in E4M3, once

    def _plan(self, load: torch.Tensor, vision: torch.Tensor, tokens: int) -> torch.Tensor:
        """The group's plan from its summed loads (the same on every rank, so are these counters)."""
        self.last_plan, plan = self.controller.decide(load, vision, self.expert_rank, dist.get_world_size(), tokens)
        c = self.counters
        c.calls, c.pairs = c.calls + 1, c.pairs + int(load.sum())
        whole = self.mode == "all" or self.scope == "expert"  # else only the image rows of a switched expert
        c.lowprec_pairs += int((load if whole else vision)[self.last_plan].sum())
        c.switched_experts += int(self.last_plan.sum())
        c.observe_plan(plan)
        return self.last_plan

    def _replace_experts(self, top_k_index: torch.Tensor) -> None:
        """EPLB: record this step's global loads; every `eplb_period` steps move to a new placement. With
        `eplb_async` the move runs on a group of its own through the next step, which the old placement
        serves (its weights stay until then), and every rank adopts the new one after that step."""
        from ..parallel.replication import move_group, move_weights, placement_table, start_move

        load = torch.bincount(top_k_index.reshape(-1), minlength=self.expert_rank.numel()).double()
        dist.all_reduce(load)
        self.load_history = (self.load_history + [load.cpu()])[-self.eplb_window:]
        self.steps += 1
        if self.pending_move is not None:  # started a step ago, on every rank: adopted by all at this step
            move, holders = self.pending_move
            self.pending_move = None
            self._adopt(move.finish(), holders)
        if self.steps % self.eplb_period:
            return
        new = placement_table(torch.stack(self.load_history).mean(dim=0), self.eplb_redundant, dist.get_world_size())
        held = {int(e): torch.cat([self.local_gate_up[i].flatten(), self.local_down[i].flatten()])
                for i, e in enumerate(self.local_experts.tolist())}
        self.eplb_moves += 1
        if self.settings.eplb_async:
            self.pending_move = (start_move(held, self.holders, new, group=move_group(), async_op=True), new)
        else:
            self._adopt(move_weights(held, self.holders, new), new)

    def _adopt(self, moved: dict[int, torch.Tensor], holders: list[list[int]]) -> None:
        """This rank's experts and the group's holders table under a new placement."""
        split = self.local_gate_up[0].numel()
        gate_up_shape, down_shape = self.local_gate_up.shape[1:], self.local_down.shape[1:]
        self.holders = holders
        self.local_experts = torch.tensor(sorted(moved), dtype=torch.long)
        self.local_gate_up = torch.stack([moved[e][:split].view(gate_up_shape) for e in self.local_experts.tolist()])
        self.local_down = torch.stack([moved[e][split:].view(down_shape) for e in self.local_experts.tolist()])
        self._place_tables()

    def _place_tables(self) -> None:
        """The placement tables beside the weights, for the fixed-size exchange: a captured decode step may
        not copy a host tensor to the GPU (CUDA graphs refuse unpinned host copies), so they are placed
        here, whenever the placement changes, never inside a step."""
        device = self.local_gate_up.device
        self.local_experts_placed = self.local_experts.to(device)
        self.expert_rank_placed = self.expert_rank.to(device)

    def _fixed_exchange(self, rows: int) -> bool:
        """Whether a decode step of at most `rows` rows a rank exchanges fixed-size buffers: no precision
        plan could switch an expert in it (BF16, or ReaLB's gate shut at rows x ranks tokens), so no
        decision waits on the host. The same answer on every rank (same settings, same rows)."""
        if self.mode == "bf16":
            return True
        return self.mode in ("realb", "realb-seq", "fixed") and rows * self.ranks < self.gate_tokens

    def decode_capturable(self) -> bool:
        """A decode step may capture this layer's exchange with `capture_exchange`: the fixed-size
        exchanges read nothing on the host (on a GPU with BF16 weights: grouped GEMM captures in BF16
        only). The capture's warm-up run skips the collectives (engine.graphs.warming_up), so every
        rank runs each step's collectives once, graphed or not."""
        if not self.settings.capture_exchange or not self._fixed_exchange(1):
            return False
        return self.local_gate_up is None or self.local_gate_up.device.type != "cuda" \
            or self.local_gate_up.dtype == torch.bfloat16

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        rows = self.context.ep_fixed_rows
        if rows and self._fixed_exchange(rows):  # a decode step, on every rank at once
            if warming_up():  # a capture's first run, dropped: the replay runs the collectives
                return torch.zeros_like(hidden_states)
            self.fixed_passes += 1
            return ep_forward_static(hidden_states, top_k_index, top_k_weights, self.local_gate_up, self.local_down,
                                     self.local_experts_placed, self.expert_rank_placed, self.act, rows, timer=self.timer)
        holders = None
        if self.mode == "eplb":
            from ..parallel.replication import holders_tensor

            holders = holders_tensor(self.holders)
        visual = self.context.token_is_visual
        if visual is None or visual.numel() != hidden_states.shape[0]:
            visual = None
        out = ep_forward(hidden_states, top_k_index, top_k_weights, self.local_gate_up, self.local_down,
                          self.local_experts, self.expert_rank, self.act, visual=visual,
                          plan=None if self.mode in ("bf16", "eplb") else self._plan, lowprec_mlp=self.lowprec_mlp,
                          whole_expert=self.mode == "all" or self.scope == "expert", holders=holders,
                          overlap_plan=self.mode != "realb-seq", lowprec_experts=None if self.fp8 is None else self.fp8.grouped_rows,
                          timer=self.timer)
        if self.mode == "eplb":  # after the step, so a re-placement never splits one layer's exchange
            self._replace_experts(top_k_index)
        return out

    def stats(self) -> dict[str, Any]:
        return {"ep_size": str(dist.get_world_size()), "local_experts": int(self.local_experts.numel()),
                "ep_fixed_exchanges": self.fixed_passes, **({"eplb_moves": self.eplb_moves} if self.mode == "eplb" else {}), **(asdict(self.counters) if self.counters.calls else {}),
                **(self.fp8.stats() if self.fp8 is not None else {})}

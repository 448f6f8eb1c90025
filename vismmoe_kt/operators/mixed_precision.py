"""MixedPrecisionExperts: ReaLB's modality-aware mixed precision for one MoE layer's experts.

Per call (one layer, one step):
    route (the model's router) -> statistics: per-expert load and image-token load, per virtual rank
      -> plan: LB gate, overloaded vision-dominant ranks, greedy switch of vision-heavy experts
         (vismmoe_kt.lb.policy), with M_d under AIMD control (vismmoe_kt.lb.aimd)
      -> compute: BF16 pairs with the model's own experts; low-precision pairs with weights and
         activations passed through the precision backend; sum.
NVFP4 scales (post-training, no second copy of the weights): each expert's weight global scales are
computed once at load; its input-activation global scale comes from the amax of the activations it
has seen in BF16 (the first requests calibrate it), so switching an expert quantizes its weights on
demand with fixed scales. Experts are spread over `ep_size` ranks contiguously (expert e on rank e * R // E); with one device
the ranks are virtual, their times estimated from their loads. The image-token mask comes from the
VisDecoder rule (compression none is enough) through the loader's shared context.

Rule kwargs: mode (bf16 | all = FP4-All, every pair of every expert | realb | realb-seq | fixed |
eplb = the history-based replication baseline, BF16 compute with rank loads under EPLB's placement;
eplb_redundant (extra copies, default one per rank), eplb_period (8 steps), eplb_window (16 steps)), fixed_threshold (M_d for `fixed`),
precision_backend (auto | nvfp4-emulated | fp8 | nvfp4; see vismmoe_kt.lb.precision), ep_size (4), lb_gate_tokens (Gamma,
2048), fp4_scope (vision_tokens | expert), eps (0.05), lowprec_cost (0.5: a low-precision pair's
time relative to BF16, for the plan), md_start (0.9), md_min (0.0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..lb.controller import MODES as PRECISION_MODES
from ..lb.controller import RealbController
from ..lb.precision import expert_mlp_fn, resolve_backend
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule
from .vis_decoder import shared_context

MODES = PRECISION_MODES + ("eplb",)


@dataclass
class RealbStats:
    calls: int = 0
    gated_calls: int = 0
    pairs: int = 0
    lowprec_pairs: int = 0
    switched_experts: int = 0
    imbalance_before: float = 0.0  # summed over ungated calls; divide by calls - gated_calls
    imbalance_after: float = 0.0


class MixedPrecisionExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("gate_up_proj", "down_proj", "act_fn")

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module, prefill_device: str = "cuda",
                 generate_device: str = "cuda", mode: str = "realb", fixed_threshold: float = 0.7,
                 precision_backend: str = "nvfp4-emulated", ep_size: int = 4, lb_gate_tokens: int = 2048,
                 fp4_scope: str = "vision_tokens", eps: float = 0.05, lowprec_cost: float = 0.5,
                 md_start: float = 0.9, md_min: float = 0.0, eplb_redundant: int | None = None,
                 eplb_period: int = 8, eplb_window: int = 16, **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of: {', '.join(MODES)}")
        num_experts = orig_module.num_experts
        if not 1 <= int(ep_size) <= num_experts:
            raise ValueError(f"ep_size must be between 1 and the {num_experts} experts, got {ep_size}")
        self.backend = resolve_backend(precision_backend, self.generate_device)
        self.lowprec_mlp = expert_mlp_fn(self.backend)
        self.mode, self.ep_size, self.scope = mode, int(ep_size), fp4_scope
        self.controller = RealbController("bf16" if mode == "eplb" else mode, float(fixed_threshold), int(lb_gate_tokens),
                                          float(eps), float(lowprec_cost), fp4_scope, float(md_start), float(md_min))
        self.aimd = self.controller.aimd
        self.expert_rank = torch.arange(num_experts) * self.ep_size // num_experts
        self.eplb = None
        if mode == "eplb":
            from ..lb.eplb import EPLBPlacement

            redundant = self.ep_size if eplb_redundant is None else int(eplb_redundant)
            self.eplb = EPLBPlacement(num_experts, self.ep_size, redundant, int(eplb_window), int(eplb_period))
        self.shared = shared_context(gguf_loader)
        self.counters = RealbStats()
        self.weight_scales: dict[str, torch.Tensor] = {}                 # per expert, set at load
        self.activation_amax = torch.zeros(num_experts)                  # per expert, calibrated online

    def load(self) -> None:
        super().load()
        self.calibrate_weights()

    def calibrate_weights(self) -> None:
        """NVFP4 global scale of every expert's gate_up and down weights (448 * 6 / amax)."""
        from ..lb.nvfp4 import E2M1_MAX, E4M3_MAX

        experts = self.orig_module
        for name in ("gate_up_proj", "down_proj"):
            amax = getattr(experts, name).detach().abs().amax(dim=(1, 2)).float().cpu()
            self.weight_scales[name] = (E4M3_MAX * E2M1_MAX) / amax.clamp(min=1e-12)

    def _observe_activations(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Running amax of each expert's inputs (vectorised: per-token amax scattered to the routed experts)."""
        per_token = hidden.detach().abs().amax(dim=1).float()
        per_pair = per_token.repeat_interleave(top_k_index.shape[1])
        seen = torch.zeros_like(self.activation_amax).to(per_pair.device).scatter_reduce_(
            0, top_k_index.reshape(-1), per_pair, reduce="amax")
        self.activation_amax = torch.maximum(self.activation_amax, seen.cpu())

    def _scales(self, expert: int) -> dict:
        from ..lb.nvfp4 import E2M1_MAX, E4M3_MAX

        if not self.weight_scales:
            self.calibrate_weights()  # injected into an already loaded model
        amax = float(self.activation_amax[expert])
        scales = {"gate_up": self.weight_scales["gate_up_proj"][expert], "down": self.weight_scales["down_proj"][expert]}
        if amax > 0:
            scales["input"] = torch.tensor(E4M3_MAX * E2M1_MAX / amax)
        return scales

    def _visual_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        mask = self.shared.token_is_visual
        if mask is None or mask.numel() != rows:
            return torch.zeros(rows, dtype=torch.bool, device=device)  # no image tokens in sight
        return mask.to(device)

    def _plan(self, top_k_index: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
        """Which experts run in low precision this call (bool, E)."""
        num_experts = self.expert_rank.numel()
        if self.mode in ("bf16", "all"):
            return self.controller.decide(torch.zeros(num_experts), torch.zeros(num_experts), self.expert_rank,
                                          self.ep_size, top_k_index.shape[0])[0]
        flat = top_k_index.reshape(-1).cpu()
        load = torch.bincount(flat, minlength=num_experts).float()
        if self.eplb is not None:  # the baseline balances by placement, never by precision
            static = torch.zeros(self.ep_size, dtype=torch.float64).index_add_(0, self.expert_rank, load.double())
            placed = self.eplb.observe(load)
            self.counters.imbalance_before += float(static.max() / static.mean().clamp(min=1e-9))
            self.counters.imbalance_after += float(placed.max() / placed.mean().clamp(min=1e-9))
            return torch.zeros(num_experts, dtype=torch.bool)
        vision = torch.bincount(top_k_index[visual].reshape(-1).cpu(), minlength=num_experts).float()
        switched, plan = self.controller.decide(load, vision, self.expert_rank, self.ep_size, top_k_index.shape[0])
        c = self.counters
        if plan is not None and plan.gated:
            c.gated_calls += 1
        elif plan is not None:
            c.imbalance_before += plan.imbalance(after=False)
            c.imbalance_after += plan.imbalance()
        return switched

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        experts = self.orig_module
        visual = self._visual_rows(hidden_states.shape[0], hidden_states.device)
        self._observe_activations(hidden_states, top_k_index)
        switched = self._plan(top_k_index, visual).to(top_k_index.device)
        lowprec = switched[top_k_index]  # (T, K) pairs whose expert switched
        if self.scope == "vision_tokens" and self.mode != "all":  # FP4-All means every pair
            lowprec &= visual[:, None]
        c = self.counters
        c.calls += 1
        c.pairs += top_k_index.numel()
        c.lowprec_pairs += int(lowprec.sum())
        c.switched_experts += int(switched.sum())
        out = experts(hidden_states, top_k_index, top_k_weights.masked_fill(lowprec, 0))
        if lowprec.any():
            out = out + self._lowprec_pairs(hidden_states, top_k_index, top_k_weights, lowprec)
        return out

    def _lowprec_pairs(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                       lowprec: torch.Tensor) -> torch.Tensor:
        """Each switched expert quantized on demand by the backend (no copy kept), its pairs computed."""
        experts = self.orig_module
        out = torch.zeros_like(hidden)
        for expert in torch.unique(index[lowprec]).tolist():
            token, slot = torch.where((index == expert) & lowprec)
            y = self.lowprec_mlp(hidden[token], experts.gate_up_proj[expert], experts.down_proj[expert], experts.act_fn,
                                 self._scales(expert))
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def stats(self) -> dict[str, Any]:
        # settings as text (summing them over layers would mean nothing); counters are summed
        return {"mode": self.mode, "precision_backend": self.backend, "ep_size": str(self.ep_size),
                "m_d_first_layer": f"{self.aimd.threshold:.2f}", **asdict(self.counters)}

"""MixedPrecisionExperts: ReaLB's modality-aware mixed precision for one MoE layer's experts.

Per call (one layer, one step):
    route (the model's router) -> statistics: per-expert load and image-token load, per virtual rank
      -> plan: LB gate, overloaded vision-dominant ranks, greedy switch of vision-heavy experts
         (vismmoe_kt/lb/policy.py), with M_d under AIMD control (vismmoe_kt/lb/aimd.py)
      -> compute: BF16 pairs with the model's own experts; low-precision pairs through the precision
         backend with post-training scales (vismmoe_kt/lb/lowprec.py; the fp8 backend from E4M3 weights
         made at load, as grouped GEMMs: vismmoe_kt/lb/fp8_experts.py); each pair computed once, in
         one precision (the BF16 ones by grouped GEMM over the model's expert weights); each token's
         K pair outputs summed in order (deterministic). A call with nothing switched is the model's
         own experts call.
Experts are spread over `ep_size` ranks contiguously (expert e on rank e * R // E); with one device
the ranks are virtual, their times estimated from their loads. The image-token mask comes from the
load context (the text model's forward writes it: a VisDecoder rule, compression none is enough); a
modality-separated layer's vision experts (ERNIE-4.5-VL) see image rows only.

Rule kwargs: MixedPrecisionSettings (vismmoe_kt/lb/settings.py).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..lb.controller import RealbStats
from ..lb.fp8_experts import Fp8Experts
from ..lb.lowprec import ExpertScales, lowprec_pairs
from ..lb.precision import expert_mlp_fn, resolve_backend
from ..lb.settings import MODES, MixedPrecisionSettings
from ..models.base import VISION_SET
from ..runtime.expert_compute import bank_experts, precision_split_rows
from .base import HF_READ_ATTRIBUTES, BaseInjectedModule, settings_from

__all__ = ["MixedPrecisionExperts", "MODES"]


class MixedPrecisionExperts(BaseInjectedModule):
    forwarded_attributes = HF_READ_ATTRIBUTES + ("gate_up_proj", "down_proj", "act_fn")

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module, prefill_device: str = "cuda",
                 generate_device: str = "cuda", **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device)
        s = self.settings = settings_from(MixedPrecisionSettings, kwargs, "MixedPrecisionExperts")
        expert_set = self.adapter.expert_set(key)
        num_experts = self.adapter.expert_set_shape(config, expert_set).num_experts
        if not 1 <= s.ep_size <= num_experts:
            raise ValueError(f"ep_size must be between 1 and the {num_experts} experts, got {s.ep_size}")
        self.backend = resolve_backend(s.precision_backend, self.generate_device)
        self.lowprec_mlp = expert_mlp_fn(self.backend)
        self.mode, self.ep_size, self.scope = s.mode, s.ep_size, s.fp4_scope
        self.controller = s.controller()
        self.aimd = self.controller.aimd
        # host bookkeeping: explicit devices, because upstream builds operators under torch.device("meta")
        self.expert_rank = torch.arange(num_experts, device="cpu") * self.ep_size // num_experts
        self.eplb = None
        if s.mode == "eplb":
            from ..lb.eplb import EPLBPlacement

            redundant = self.ep_size if s.eplb_redundant is None else s.eplb_redundant
            self.eplb = EPLBPlacement(num_experts, self.ep_size, redundant, s.eplb_window, s.eplb_period)
        self.counters = RealbStats()
        self.scales = ExpertScales(num_experts)
        self.fp8: Fp8Experts | None = None  # the fp8 backend's E4M3 copy of the experts (made at load)
        # a modality-separated layer's vision experts (ERNIE-4.5-VL): only image tokens reach them, so every
        # row they are handed is visual (the text model's mask covers the whole sequence, not their rows)
        self.image_rows_only = expert_set == VISION_SET

    def load(self) -> None:
        super().load()
        self.scales.calibrate_weights(*self.adapter.expert_weights(self.orig_module))
        self._make_fp8()

    def _make_fp8(self) -> None:
        """The fp8 backend: every expert's weights in E4M3 once (fp8_experts.py), where experts may switch."""
        if self.backend == "fp8" and self.mode not in ("bf16", "eplb") and self.fp8 is None:
            self.fp8 = Fp8Experts(*self.adapter.expert_weights(self.orig_module))

    def _visual_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        if self.image_rows_only:
            return torch.ones(rows, dtype=torch.bool, device=device)
        mask = self.context.token_is_visual
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
        self.counters.observe_plan(plan)
        return switched

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        experts = self.orig_module
        visual = self._visual_rows(hidden_states.shape[0], hidden_states.device)
        self.scales.observe(hidden_states, top_k_index)
        switched = self._plan(top_k_index, visual).to(top_k_index.device)
        lowprec = switched[top_k_index]  # (T, K) pairs whose expert switched
        if self.scope == "vision_tokens" and self.mode != "all":  # FP4-All means every pair
            lowprec &= visual[:, None]
        c = self.counters
        c.calls += 1
        c.pairs += top_k_index.numel()
        c.lowprec_pairs += int(lowprec.sum())
        c.switched_experts += int(switched.sum())
        if not lowprec.any():
            return experts(hidden_states, top_k_index, top_k_weights)
        if not self.scales.weights:  # injected into an already loaded model
            self.scales.calibrate_weights(*self.adapter.expert_weights(experts))
            self._make_fp8()
        return self._split(hidden_states, top_k_index, top_k_weights, lowprec)

    def _split(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               lowprec: torch.Tensor) -> torch.Tensor:
        """(T, H): every token's K weighted pair outputs summed in order."""
        return self._pair_outputs(hidden, index, weights, lowprec).sum(dim=1)

    def _pair_outputs(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                      lowprec: torch.Tensor) -> torch.Tensor:
        """(T, K, H) weighted pair outputs, each pair computed once: the switched ones by the precision
        backend, the rest by grouped GEMM over the model's expert weights, one row per pair (an
        expert's group holds exactly its BF16 pairs, so an unswitched expert's outputs are the all-BF16
        ones bit for bit)."""
        experts = self.orig_module
        gate_up, down = self.adapter.expert_weights(experts)
        act = self.adapter.expert_activation(experts)
        if self.fp8 is not None:  # one sort: the BF16 pairs grouped by expert, then the switched ones (E4M3)
            tokens, k = index.shape
            token = torch.arange(tokens, device=index.device).repeat_interleave(k)
            y = precision_split_rows(hidden, token, index.reshape(-1), lowprec.reshape(-1), gate_up, down, act,
                                     self.fp8.grouped_rows)
            return (y * weights.reshape(-1, 1).to(y.dtype)).to(hidden.dtype).view(tokens, k, -1)
        pairs = lowprec_pairs(self.lowprec_mlp, hidden, index, weights, lowprec, gate_up, down, act, self.scales)
        token, slot = torch.nonzero(~lowprec, as_tuple=True)
        if token.numel():
            rows = torch.arange(gate_up.shape[0], device=index.device)
            pairs[token, slot] = bank_experts(hidden[token], index[token, slot, None], weights[token, slot, None],
                                              rows, gate_up, down, act)
        return pairs

    def stats(self) -> dict[str, Any]:
        # settings as text (summing them over layers would mean nothing); counters are summed
        return {"mode": self.mode, "precision_backend": self.backend, "ep_size": str(self.ep_size),
                "m_d_first_layer": f"{self.aimd.threshold:.2f}", **asdict(self.counters),
                **(self.fp8.stats() if self.fp8 is not None else {})}

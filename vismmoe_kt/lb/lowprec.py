"""Low-precision computation of switched experts, with post-training scales and no second copy.

NVFP4 scales: each expert's weight global scales are computed once at load (448 * 6 / amax); its
input-activation global scale comes from the amax of the activations it has seen in BF16 (the first
requests calibrate it), so switching an expert quantizes its weights on demand with fixed scales.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .nvfp4 import E2M1_MAX, E4M3_MAX


class ExpertScales:
    def __init__(self, num_experts: int):
        self.weights: dict[str, torch.Tensor] = {}       # "gate_up" / "down" -> (E,), set at load
        self.activation_amax = torch.zeros(num_experts, device="cpu")  # calibrated online (host bookkeeping)

    def calibrate_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        for name, weight in (("gate_up", gate_up), ("down", down)):
            amax = weight.detach().abs().amax(dim=(1, 2)).float().cpu()
            self.weights[name] = (E4M3_MAX * E2M1_MAX) / amax.clamp(min=1e-12)

    def observe(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Running amax of each expert's inputs (vectorised: per-token amax scattered to the routed experts)."""
        per_token = hidden.detach().abs().amax(dim=1).float()
        per_pair = per_token.repeat_interleave(top_k_index.shape[1])
        seen = torch.zeros_like(self.activation_amax).to(per_pair.device).scatter_reduce_(
            0, top_k_index.reshape(-1), per_pair, reduce="amax")
        self.activation_amax = torch.maximum(self.activation_amax, seen.cpu())

    def of(self, expert: int) -> dict[str, torch.Tensor]:
        scales = {"gate_up": self.weights["gate_up"][expert], "down": self.weights["down"][expert]}
        amax = float(self.activation_amax[expert])
        if amax > 0:
            scales["input"] = torch.tensor(E4M3_MAX * E2M1_MAX / amax)
        return scales


def lowprec_pairs(mlp: Callable[..., torch.Tensor], hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  lowprec: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Any,
                  scales: ExpertScales) -> torch.Tensor:
    """The `lowprec` (T, K) pairs of every switched expert, each quantized on demand by the backend's `mlp`,
    weighted, each in its own place (T, K, H); zeros for the other pairs. (The fp8 backend runs them all
    at once instead: fp8_experts.py, through runtime/expert_compute.precision_split_rows.)"""
    out = torch.zeros(*index.shape, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    for expert in torch.unique(index[lowprec]).tolist():
        token, slot = torch.where((index == expert) & lowprec)
        y = mlp(hidden[token], gate_up[expert], down[expert], act, scales.of(expert))
        out[token, slot] = (y * weights[token, slot, None]).to(out.dtype)
    return out

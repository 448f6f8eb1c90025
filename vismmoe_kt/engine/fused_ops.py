"""Fewer-launch equivalents of the text model's small ops, for the decode step.

At batch 1 a decode step is mostly small kernels, so the launches count: transformers' RMSNorm is
six element-wise kernels (cast, square, mean, rsqrt, scale, cast) before the weight, and its router
takes a softmax over every expert, a top-k and a renormalising division. These give the same values
(fp32 statistics, the weight applied in the input dtype; top-k of the logits then a softmax over the
k, which equals softmax -> top-k -> renormalise because the normaliser cancels) in fewer kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for Qwen3's RMSNorm (weight, variance_epsilon), with torch's fused RMS kernel."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def route(gate: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), both (T, K), as Qwen3's top-k router gives them."""
    logits = F.linear(hidden, gate.weight)
    top, chosen = torch.topk(logits, gate.top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float).to(logits.dtype), chosen


def is_qwen_rms_norm(module: nn.Module) -> bool:
    return hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor)


def is_top_k_router(module: nn.Module) -> bool:
    return hasattr(module, "top_k") and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and type(module).__name__.endswith("TopKRouter")

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


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm with fp32 statistics and the weight applied in the input dtype (Qwen3's), with
    torch's fused RMS kernel."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def route(weight: torch.Tensor, top_k: int, hidden: torch.Tensor, probabilities: bool = False) -> tuple[torch.Tensor, ...]:
    """(weights, expert ids), both (T, K), of a softmax -> top-k -> renormalise router over `weight`;
    with `probabilities`, also the softmax over every expert (T, E), fp32."""
    logits = F.linear(hidden, weight)
    top, chosen = torch.topk(logits, top_k, dim=-1)
    out = (torch.softmax(top, dim=-1, dtype=torch.float).to(logits.dtype), chosen)
    return (*out, torch.softmax(logits, dim=-1, dtype=torch.float)) if probabilities else out

"""Fewer-launch equivalents of the text model's small ops, for the decode step.

At batch 1 a decode step is mostly small kernels, so the launches count: transformers' RMSNorm is
six element-wise kernels (cast, square, mean, rsqrt, scale, cast) before the weight, and its router
takes a softmax over every expert, a top-k and a renormalising division. These give the same values
(fp32 statistics, the weight applied in the input dtype; top-k of the logits then a softmax over the
k, which equals softmax -> top-k -> renormalise because the normaliser cancels) in fewer kernels.

On a CUDA device the RMSNorm is one Triton kernel (a program per row); elsewhere torch's fused RMS
kernel between two casts. Inside a CUDA graph every launch saved is a gap saved: a decode step of
Qwen3-VL-30B-A3B runs four RMSNorms per layer (the layer's two, the attention's query and key ones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's kernels
    triton = tl = None


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm with fp32 statistics and the weight applied in the input dtype (Qwen3's)."""
    if x.is_cuda and tl is not None and x.shape[-1] <= MAX_TRITON_WIDTH:
        return _rms_norm_triton(weight, eps, x)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


MAX_TRITON_WIDTH = 16384  # a row in one program's registers


def _rms_norm_triton(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), eps, N=width,
                                       BLOCK=triton.next_power_of_2(width), num_warps=4 if width > 1024 else 1)
    return out.view(*x.shape[:-1], width)


if tl is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, row_stride, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * row_stride + cols, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        scaled = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)).to(x.dtype)  # back to the input dtype
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = w.to(tl.float32) * scaled.to(tl.float32)  # weight * normed, as torch promotes the two
        tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def fuse_norms(norms: Any, params: Any) -> int:
    """Give each of `norms` (RMSNorm modules) the fused forward, `params(norm)` -> (weight, eps) or None
    (then it keeps its own); the count changed. Only where the Triton kernel serves it (weights on a
    CUDA device): elsewhere the module's own forward is already what the CPU runs best."""
    changed = 0
    for norm in norms:
        found = params(norm)
        if found is None or not found[0].is_cuda or tl is None or "forward" in vars(norm):
            continue
        eps = found[1]
        norm.forward = lambda x, norm=norm: rms_norm(norm.weight, eps, x)  # the module's weight, as it is now
        changed += 1
    return changed


def route(weight: torch.Tensor, top_k: int, hidden: torch.Tensor, probabilities: bool = False) -> tuple[torch.Tensor, ...]:
    """(weights, expert ids), both (T, K), of a softmax -> top-k -> renormalise router over `weight`;
    with `probabilities`, also the softmax over every expert (T, E), fp32."""
    logits = F.linear(hidden, weight)
    top, chosen = torch.topk(logits, top_k, dim=-1)
    out = (torch.softmax(top, dim=-1, dtype=torch.float).to(logits.dtype), chosen)
    return (*out, torch.softmax(logits, dim=-1, dtype=torch.float)) if probabilities else out

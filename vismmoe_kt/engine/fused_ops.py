"""Fewer-launch equivalents of the text model's small ops, for the decode step (and a prompt's modules).

At batch 1 a decode step is mostly small kernels, so the launches count: transformers' RMSNorm is
six element-wise kernels (cast, square, mean, rsqrt, scale, cast) before the weight, and its router
takes a softmax over every expert, a top-k and a renormalising division. These give the same values
(fp32 statistics, the weight applied in the input dtype; top-k of the logits then a softmax over the
k, which equals softmax -> top-k -> renormalise because the normaliser cancels) in fewer kernels: on
the GPU the norm is one kernel, the residual add before it shares that kernel (`add_rms_norm`), and
the router's top-k and softmaxes are one kernel after its GEMV.

On a CUDA device the RMSNorm is one Triton kernel (a program per row); elsewhere torch's fused RMS
kernel between two casts. Inside a CUDA graph every launch saved is a gap saved: a decode step of
Qwen3-VL-30B-A3B runs four RMSNorms per layer (the layer's two, the attention's query and key ones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kernel_launch import launch, next_power_of_2

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
    launch(_rms_norm_kernel, (rows.shape[0],), rows, weight, out, rows.stride(0), eps, N=width,
           BLOCK=next_power_of_2(width), num_warps=4 if width > 1024 else 1)
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


def add_rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm): the decode step's residual add and the norm after it in one kernel on
    the GPU (the sum rounded to the dtype first, as torch's add does)."""
    if x.is_cuda and tl is not None and x.shape[-1] <= MAX_TRITON_WIDTH and x.dtype == residual.dtype:
        width = x.shape[-1]
        rows, added = x.reshape(-1, width), residual.reshape(-1, width)
        total = torch.empty_like(rows)
        out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        launch(_add_rms_norm_kernel, (rows.shape[0],), rows, added, weight, total, out, rows.stride(0), added.stride(0),
               eps, N=width, BLOCK=next_power_of_2(width), num_warps=4 if width > 1024 else 1)
        return total.view(x.shape), out.view(*x.shape[:-1], width)
    total = x + residual
    return total, rms_norm(weight, eps, total)


if tl is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, total_ptr, out_ptr, x_stride, r_stride, eps, N: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
        total = (x.to(tl.float32) + tl.load(r_ptr + row * r_stride + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * N + cols, total, mask=ok)
        tf = total.to(tl.float32)
        scaled = (tf * tl.rsqrt(tl.sum(tf * tf, axis=0) / N + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * N + cols, (w.to(tl.float32) * scaled.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


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
        norm.forward = lambda x, norm=norm, eps=eps: fused_norm(norm, eps, x)
        changed += 1
    return changed


def fused_norm(norm: torch.nn.Module, eps: float, x: torch.Tensor) -> torch.Tensor:
    """A fused norm's forward with the module's weight as it is now; training and gradients get the module's own
    (the kernel has no backward)."""
    if norm.training or torch.is_grad_enabled():
        return type(norm).forward(norm, x)
    return rms_norm(norm.weight, eps, x)


def fuse_routers(routers: Any, adapter: Any) -> int:
    """Give each of `routers` that `adapter.fused_router` describes (softmax -> top-k -> renormalise over a
    linear layer) a forward of two kernels, its GEMM and the route kernel, on the GPU; the count changed.
    A prompt runs the routers as modules (the decode step fuses its own), and transformers' top-k router is
    seven kernels: the GEMM, a softmax over every expert, the top-k's two, a sum, a division and a cast.
    The module's output as the adapter builds it, the decode step's values (see `route`: equal to the module's
    up to rounding, and among equal logits the lowest index first)."""
    changed = 0
    for router in routers:
        # an operator on the router (a routing source's) calls the module it replaced: that one is fused
        while router is not None and isinstance(getattr(router, "orig_module", None), torch.nn.Module):
            router = router.orig_module
        found = adapter.fused_router(router) if router is not None else None
        if found is None or not found[0].is_cuda or tl is None or "forward" in vars(router) \
                or found[0].shape[0] > MAX_TRITON_WIDTH:
            continue
        router.forward = lambda x, router=router, k=found[1]: routed_output(adapter, router, k, x)
        changed += 1
    return changed


def routed_output(adapter: Any, router: torch.nn.Module, top_k: int, hidden: torch.Tensor) -> Any:
    """A fused router's forward: `adapter.router_output(logits, weights, ids)` of hidden (..., H); training and
    gradients get the module's own (the kernel has no backward)."""
    if router.training or torch.is_grad_enabled():
        return type(router).forward(router, hidden)
    weight = router.weight
    logits = F.linear(hidden.reshape(-1, weight.shape[1]), weight)
    weights, ids = route_logits(logits, top_k)
    return adapter.router_output(logits, weights, ids)


def route(weight: torch.Tensor, top_k: int, hidden: torch.Tensor, probabilities: bool = False) -> tuple[torch.Tensor, ...]:
    """(weights, expert ids), both (T, K), of a softmax -> top-k -> renormalise router over `weight`;
    with `probabilities`, also the softmax over every expert (T, E), fp32. On the GPU the top-k and the
    softmaxes after the logits' GEMV are one kernel."""
    return route_logits(F.linear(hidden, weight), top_k, probabilities)


def route_logits(logits: torch.Tensor, top_k: int, probabilities: bool = False) -> tuple[torch.Tensor, ...]:
    """`route` after the GEMV: (weights, expert ids) of the (T, E) logits, with `probabilities` also the
    softmax over every expert."""
    if logits.is_cuda and tl is not None and logits.dim() == 2 and logits.shape[-1] <= MAX_TRITON_WIDTH:
        return _route_triton(logits, top_k, probabilities)
    top, chosen = torch.topk(logits, top_k, dim=-1)
    out = (torch.softmax(top, dim=-1, dtype=torch.float).to(logits.dtype), chosen)
    return (*out, torch.softmax(logits, dim=-1, dtype=torch.float)) if probabilities else out


def _route_triton(logits: torch.Tensor, top_k: int, probabilities: bool) -> tuple[torch.Tensor, ...]:
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    chosen = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    every = torch.empty(tokens, experts if probabilities else 1, dtype=torch.float32, device=logits.device)
    launch(_route_kernel, (tokens,), logits, logits.stride(0), weights, chosen, every, E=experts, K=top_k,
           BLOCK=next_power_of_2(experts), KBLOCK=next_power_of_2(top_k), PROBABILITIES=probabilities,
           num_warps=1 if experts <= 256 else 4)
    return (weights, chosen, every) if probabilities else (weights, chosen)


if tl is not None:
    @triton.jit
    def _route_kernel(logits_ptr, stride, weights_ptr, chosen_ptr, every_ptr, E: tl.constexpr, K: tl.constexpr,
                      BLOCK: tl.constexpr, KBLOCK: tl.constexpr, PROBABILITIES: tl.constexpr):
        """A program per token: the K largest logits in descending order (the lowest index first among
        equal ones), the softmax over those K in fp32 rounded to the logits' dtype, and with PROBABILITIES
        the softmax over all E."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        logits = tl.load(logits_ptr + row * stride + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
        remaining = logits
        ks = tl.arange(0, KBLOCK)
        top = tl.full([KBLOCK], float("-inf"), tl.float32)
        for k in tl.static_range(K):
            largest = tl.max(remaining, axis=0)
            # (a NaN row matches nothing: its ids stay in range, E - 1, and its weights NaN)
            index = tl.minimum(tl.min(tl.where(remaining == largest, cols, BLOCK), axis=0), E - 1)
            tl.store(chosen_ptr + row * K + k, index.to(tl.int64))
            top = tl.where(ks == k, largest, top)
            remaining = tl.where(cols == index, float("-inf"), remaining)
        exps = tl.exp(top - tl.max(top, axis=0))
        tl.store(weights_ptr + row * K + ks, (exps / tl.sum(exps, axis=0)).to(weights_ptr.dtype.element_ty), mask=ks < K)
        if PROBABILITIES:
            every = tl.exp(logits - tl.max(logits, axis=0))
            tl.store(every_ptr + row * E + cols, every / tl.sum(every, axis=0), mask=cols < E)

"""A picture's patch embedding as one matrix product.

Shapes: S patches, K = channels x frames x patch height x patch width values a patch, C the tower's width.

Qwen3-VL's patch embedding is a Conv3d whose kernel equals its stride, over patches the processor has already cut
and flattened to (S, K): each output row is one patch's K values times the kernel, and nothing slides. cuDNN runs it
as an implicit-GEMM convolution that took 0.25 ms of a replayed 448 px tower's 4.2 ms of kernels on an H100 (0.62
ms at 896 px, one kernel each), for 2 x S x K x C = 2.8 GFLOP at 448 px. The same sums as a GEMM (the patch rows
times the kernel flattened in the same (channel, frame, row, column) order, plus the bias) are cuBLAS's, a matter
of microseconds. Only the order of the fp32 accumulation differs from the convolution's, so the values agree to
the dtype's rounding, not to the bit: the module keeps its own forward where gradients are asked for.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PatchProjection:
    """A replacement forward for a patch embedding: `(hidden_states (S, K) or any shape of S x K values)` -> (S, C),
    the module's contract; `conv` the module's Conv3d (kernel = stride, no padding, one group)."""

    def __init__(self, module: nn.Module, conv: nn.Conv3d):
        self.conv = conv
        self.own_forward = module.forward
        self.values = conv.weight[0].numel()  # K
        self.served = 0

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.conv.weight
        if torch.is_grad_enabled() or hidden_states.numel() % self.values:
            return self.own_forward(hidden_states)
        self.served += 1
        rows = hidden_states.reshape(-1, self.values).to(weight.dtype)
        return F.linear(rows, weight.reshape(weight.shape[0], self.values), self.conv.bias)


def is_patch_projection(conv: Any) -> bool:
    """Whether `conv` is a Conv3d that computes each output from one whole patch: kernel equal to stride, no padding
    or dilation, one group."""
    return type(conv) is nn.Conv3d and tuple(conv.kernel_size) == tuple(conv.stride) and conv.groups == 1 \
        and all(p == 0 for p in conv.padding) and all(d == 1 for d in conv.dilation) and conv.padding_mode == "zeros"


def install(adapter: Any, model: nn.Module) -> int:
    """Give each patch embedding the adapter describes (`vision_patch_projection`) the forward above; the count."""
    installed = 0
    for module in model.modules():
        conv = adapter.vision_patch_projection(module)
        if conv is None or not is_patch_projection(conv) or "forward" in vars(module):
            continue
        module.forward = PatchProjection(module, conv)
        installed += 1
    return installed

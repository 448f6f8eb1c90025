"""Routed-expert compute over a bank of blocks: one grouped GEMM per projection, no per-expert loop.

Shapes: T tokens, K routed experts per token, R bank rows (slabs, or a pinned layer's experts),
H hidden, I expert intermediate size.

A bank is `(R, block)` memory seen as gate_up `(R, 2I, H)` and down `(R, H, I)`; `rows[e]` is the
bank row holding expert `e` of the layer. Token-expert pairs are sorted by row and both projections
run as transformers' grouped GEMM (`torch._grouped_mm` where the device and shapes allow, its own
per-group fallback elsewhere), so the GPU path has no Python loop over experts.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # transformers' dispatcher picks torch's grouped GEMM or a correct fallback per device/shape
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # pragma: no cover - older/newer transformers without it
    _grouped_linear = None


def _grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, in) sorted by group; weight (R, out, in); offs (R,) cumulative ends -> (S, out)."""
    if _grouped_linear is not None:
        return _grouped_linear(x, weight, offs)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for row, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[row].T
        start = end
    return out


def bank_experts(
    hidden: torch.Tensor,          # (T, H)
    top_k_index: torch.Tensor,     # (T, K) expert ids
    top_k_weights: torch.Tensor,   # (T, K)
    rows: torch.Tensor,            # (E,) int: bank row of each expert (only routed ones are read)
    gate_up: torch.Tensor,         # (R, 2I, H)
    down: torch.Tensor,            # (R, H, I)
    act: Any,
) -> torch.Tensor:
    num_rows, k = gate_up.shape[0], top_k_index.shape[1]
    pair_rows = rows[top_k_index].reshape(-1)
    sorted_rows, order = torch.sort(pair_rows)
    token = order // k
    # histc, not bincount: bincount's output size depends on data, which CUDA graphs cannot capture
    counts = torch.histc(sorted_rows.float() if hidden.device.type == "cpu" else sorted_rows.int(),
                         bins=num_rows, min=0, max=num_rows - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = hidden[token].to(gate_up.dtype)
    gate, up = _grouped(x, gate_up, offs).chunk(2, dim=-1)
    y = _grouped(act(gate) * up, down, offs)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, y.to(hidden.dtype))

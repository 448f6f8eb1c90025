"""Routed-expert compute over a bank of blocks: one grouped GEMM per projection, no per-expert loop.

Shapes: T tokens, K routed experts per token, R bank rows (slabs, or a pinned layer's experts),
H hidden, I expert intermediate size.

A bank is `(R, block)` memory seen as gate_up `(R, 2I, H)` and down `(R, H, I)`; `rows[e]` is the
bank row holding expert `e` of the layer. Token-expert pairs are sorted by row and both projections
run as transformers' grouped GEMM (`torch._grouped_mm` where the device and shapes allow, its own
per-group fallback elsewhere), so the GPU path has no Python loop over experts. Each token's K
outputs are summed in a fixed order, so a step gives the same bits on every run.
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


MAX_GROUPS = 512  # torch._grouped_mm refuses 1024 groups and more in one call; stay well below


def row_chunks(row_counts: list[tuple[int, int]], max_groups: int = MAX_GROUPS) -> list[tuple[int, int, int, int]]:
    """Split used bank rows into runs of at most `max_groups` rows.

    `row_counts`: (bank row, token-expert pairs routed to it), known on the host after the layer's
    one sync. Returns (first row, last row + 1, first pair, last pair + 1) per chunk, where pairs are
    counted in row order (the order `bank_experts` sorts them in).
    """
    chunks: list[tuple[int, int, int, int]] = []
    pair = 0
    for row, count in sorted(row_counts):
        if chunks and row < chunks[-1][0] + max_groups:
            lo, _, start, end = chunks[-1]
            chunks[-1] = (lo, row + 1, start, end + count)
        else:
            chunks.append((row, row + 1, pair, pair + count))
        pair += count
    return chunks


def bank_experts(
    hidden: torch.Tensor,          # (T, H)
    top_k_index: torch.Tensor,     # (T, K) expert ids
    top_k_weights: torch.Tensor,   # (T, K)
    rows: torch.Tensor,            # (E,) int: bank row of each expert (only routed ones are read)
    gate_up: torch.Tensor,         # (R, 2I, H)
    down: torch.Tensor,            # (R, H, I)
    act: Any,
    chunks: list[tuple[int, int, int, int]] | None = None,  # from row_chunks; None: all R rows at once
) -> torch.Tensor:
    num_rows, k = gate_up.shape[0], top_k_index.shape[1]
    pair_rows = rows[top_k_index].reshape(-1)
    sorted_rows, order = torch.sort(pair_rows)
    token = order // k
    # histc, not bincount: bincount's output size depends on data, which CUDA graphs cannot capture
    counts = torch.histc(sorted_rows.float() if hidden.device.type == "cpu" else sorted_rows.int(),
                         bins=num_rows, min=0, max=num_rows - 1)
    x = hidden[token].to(gate_up.dtype)
    if chunks is None:
        if num_rows > MAX_GROUPS:
            raise ValueError(f"a bank of {num_rows} rows needs chunks (grouped GEMM takes {MAX_GROUPS} groups)")
        chunks = [(0, num_rows, 0, x.shape[0])]
    parts = []
    for lo, hi, start, end in chunks:
        offs = torch.cumsum(counts[lo:hi], dim=0, dtype=torch.int32)
        gate, up = _grouped(x[start:end], gate_up[lo:hi], offs).chunk(2, dim=-1)
        parts.append(_grouped(act(gate) * up, down[lo:hi], offs))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    # back to (token, k) order and summed over k in that order: deterministic, where index_add_'s
    # CUDA atomics add a token's K contributions in a different order on every run
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    return unsorted.view(-1, k, y.shape[-1]).sum(dim=1).to(hidden.dtype)


def precision_split_rows(
    rows_x: torch.Tensor,          # (S, H) source rows
    token: torch.Tensor | None,    # (P,) source row of each pair; None: pair p is rows_x[p]
    experts: torch.Tensor,         # (P,) each pair's expert, a row of gate_up / down
    lowprec: torch.Tensor,         # (P,) bool: the pair runs in low precision
    gate_up: torch.Tensor,         # (E, 2I, H)
    down: torch.Tensor,            # (E, H, I)
    act: Any,
    lowprec_grouped: Any,          # (x (Q, H) grouped by expert, ends (E,) int64 cumulative, act) -> (Q, H)
) -> torch.Tensor:
    """(P, H) outputs of P pairs, each computed once: the BF16 ones by grouped GEMM over their experts,
    the `lowprec` ones by `lowprec_grouped` (the fp8 backend's E4M3 copy, lb/fp8_experts.py).

    One stable sort by (precision, expert) puts every BF16 pair first, grouped by expert, then every
    low-precision pair, grouped the same way: each part is a view of one gathered copy of the rows,
    and the results go back to pair order in one pass. The split point is the one number read by the
    host. Where the operators first gathered each part through a boolean mask and scattered it back
    (a host sync per mask, two (P, H) copies per part), a rank's layer with a few switched experts took
    longer than the same pairs all in BF16 (realb_layer_bench, H200, 2026-12-01). An expert's BF16 group
    holds exactly its BF16 pairs, so an unswitched expert's outputs are the all-BF16 ones bit for bit.
    """
    num_experts = gate_up.shape[0]
    key = experts + num_experts * lowprec.long()
    sorted_key, order = torch.sort(key, stable=True)
    ends = torch.searchsorted(sorted_key, torch.arange(2 * num_experts, device=key.device), right=True)
    low = int(lowprec.sum())  # the host's one read
    split = key.numel() - low
    x = rows_x[order if token is None else token[order]].to(gate_up.dtype)
    parts = []
    if split:
        offs = ends[:num_experts].to(torch.int32)
        gate, up = _grouped(x[:split], gate_up, offs).chunk(2, dim=-1)
        parts.append(_grouped(act(gate) * up, down, offs))
    if low:
        parts.append(lowprec_grouped(x[split:], ends[num_experts:] - split, act).to(x.dtype))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return torch.empty_like(y).index_copy_(0, order, y)

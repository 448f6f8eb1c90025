"""Expert-parallel MoE over torch.distributed: each rank holds a share of every layer's experts.

Per MoE layer, on every rank (data parallel over requests: each rank brings its own tokens):
    route (the model's router) -> count: pairs for each destination rank, exchanged so every rank
    knows what it will receive -> dispatch: token rows and expert ids, `all_to_all_single` with
    uneven splits -> compute: the local experts, grouped GEMM over the received pairs -> combine:
    results back with the reverse all-to-all, weighted and summed per token.
Shapes: T tokens here, K experts per token, P pairs (T*K), E experts, R ranks, H hidden.
The expert-to-rank map is contiguous (expert e on rank e * R // E) unless one is given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..runtime.expert_compute import bank_experts


def contiguous_map(num_experts: int, ranks: int) -> torch.Tensor:
    return torch.arange(num_experts) * ranks // num_experts


def ep_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               local_gate_up: torch.Tensor, local_down: torch.Tensor, local_experts: torch.Tensor,
               expert_rank: torch.Tensor, act: Any, group: Any = None) -> torch.Tensor:
    """The layer's routed-expert output for this rank's tokens, experts spread over the group."""
    ranks = dist.get_world_size(group)
    device = hidden.device
    tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    dest = expert_rank.to(device)[expert]
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=ranks)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    token = order // k
    send_rows = hidden[token].contiguous()
    recv_rows = hidden.new_empty(sum(recv_split), hidden.shape[1])
    dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=group)
    recv_experts = expert.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_experts, expert[order].contiguous(), recv_split, send_split, group=group)
    # local compute: every received pair is a one-expert "token"
    local_index = torch.full((int(expert_rank.numel()),), -1, dtype=torch.long, device=device)
    local_index[local_experts.to(device)] = torch.arange(local_experts.numel(), device=device)
    if recv_rows.shape[0]:
        rows = local_index[recv_experts][:, None]
        results = bank_experts(recv_rows, rows, torch.ones_like(rows, dtype=hidden.dtype),
                               torch.arange(local_experts.numel(), device=device), local_gate_up, local_down, act)
    else:
        results = recv_rows
    back = hidden.new_empty(send_rows.shape)
    dist.all_to_all_single(back, results.contiguous(), send_split, recv_split, group=group)
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, back * weights[:, None])

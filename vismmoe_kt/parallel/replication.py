"""EPLB-style replication on real ranks: which rank holds which copy of each expert, and moving
expert weights between ranks through the process group when the placement changes.

The placement (vismmoe_kt.lb.eplb's replicate + pack) is computed on every rank from the group's
summed loads, so all ranks agree without exchanging it. `move_weights` then sends each rank the
experts it newly holds from a rank that held them before (the lowest such rank), with one
all_to_all of the flattened weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..lb.eplb import pack, replicate


def placement_table(load: torch.Tensor, redundant: int, ranks: int) -> list[list[int]]:
    """holders[e] = ranks holding a copy of expert e (a rank may appear more than once: two copies)."""
    copies = replicate(load, load.numel() + redundant)
    holders: list[list[int]] = [[] for _ in range(load.numel())]
    for expert, rank in pack(load, copies, ranks):
        holders[expert].append(rank)
    return holders


def move_weights(weights: dict[int, torch.Tensor], old: list[list[int]], new: list[list[int]], group=None) -> dict[int, torch.Tensor]:
    """This rank's expert weights under `new`, given those it holds under `old` ({expert: flat tensor})."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    example = next(iter(weights.values()))
    size = example.numel()
    sends: list[list[int]] = [[] for _ in range(ranks)]  # experts this rank sends to each rank
    receives: list[list[int]] = [[] for _ in range(ranks)]
    for expert, (had, has) in enumerate(zip(old, new)):
        source = min(had)
        for target in sorted(set(has) - set(had)):
            if source == rank:
                sends[target].append(expert)
            if target == rank:
                receives[source].append(expert)
    send = torch.cat([weights[e] for per_rank in sends for e in per_rank]) if any(sends) else example.new_empty(0)
    recv = example.new_empty(sum(len(r) for r in receives) * size)
    dist.all_to_all_single(recv, send, [len(r) * size for r in receives], [len(s) * size for s in sends], group=group)
    mine = {e: weights[e] for e in weights if rank in new[e]}
    offset = 0
    for per_rank in receives:
        for expert in per_rank:
            mine[expert] = recv[offset:offset + size].clone()
            offset += size
    return mine


def holders_tensor(holders: list[list[int]]) -> torch.Tensor:
    """(E, C) rank table for ep_forward, -1 padded."""
    width = max(len(h) for h in holders)
    return torch.tensor([h + [-1] * (width - len(h)) for h in holders])

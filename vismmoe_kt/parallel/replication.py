"""EPLB-style replication on real ranks: which rank holds which copy of each expert, and moving
expert weights between ranks through the process group when the placement changes.

The placement (vismmoe_kt.lb.eplb's replicate + pack) is computed on every rank from the group's
summed loads, so all ranks agree without exchanging it. `move_weights` then sends each rank the
experts it newly holds from a rank that held them before (the lowest such rank), with one
all_to_all of the flattened weights; `start_move(..., async_op=True)` on `move_group()` leaves it
running while steps go on under the old placement (Async EPLB).
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


class PendingMove:
    """A re-placement's weight exchange under way: `finish()` waits for it and gives this rank's expert
    weights under the new placement ({expert: flat tensor})."""

    def __init__(self, kept: dict[int, torch.Tensor], receives: list[list[int]], recv: torch.Tensor,
                 send: torch.Tensor, size: int, work):
        self.kept, self.receives, self.recv, self.size, self.work = kept, receives, recv, size, work
        self._send = send  # the collective reads it until it completes

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def finish(self) -> dict[int, torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        if self in _UNDER_WAY:
            _UNDER_WAY.remove(self)
        mine, offset = dict(self.kept), 0
        for per_rank in self.receives:
            for expert in per_rank:
                mine[expert] = self.recv[offset:offset + self.size].clone()
                offset += self.size
        self._send = None
        return mine


def start_move(weights: dict[int, torch.Tensor], old: list[list[int]], new: list[list[int]], group=None,
               async_op: bool = False) -> PendingMove:
    """Start sending each rank the experts it newly holds under `new` from the lowest rank that held them
    under `old`, one all_to_all of the flattened weights; `async_op`: return while it runs (Async EPLB:
    on a group of its own, it overlaps the steps served meanwhile)."""
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
    work = dist.all_to_all_single(recv, send, [len(r) * size for r in receives], [len(s) * size for s in sends],
                                  group=group, async_op=async_op)
    kept = {e: weights[e] for e in weights if rank in new[e]}
    move = PendingMove(kept, receives, recv, send, size, work if async_op else None)
    if async_op:
        _UNDER_WAY.append(move)
    return move


# moves started asynchronously and not yet finished, on this rank
_UNDER_WAY: list[PendingMove] = []


def moves_under_way() -> int:
    return len(_UNDER_WAY)


def wait_for_moves() -> None:
    """Wait for every exchange still under way on this rank (their weights land in the receive buffers; a
    later step adopts them as before). Before the process group goes: torn down under a collective in
    flight, gloo aborts the process ("terminate called without an active exception"). Every rank starts
    the same moves at the same step, so each waits for its own and no rank waits on a collective alone."""
    for move in list(_UNDER_WAY):
        if move.work is not None:
            move.work.wait()
    _UNDER_WAY.clear()


def move_weights(weights: dict[int, torch.Tensor], old: list[list[int]], new: list[list[int]], group=None) -> dict[int, torch.Tensor]:
    """This rank's expert weights under `new`, given those it holds under `old` ({expert: flat tensor})."""
    return start_move(weights, old, new, group).finish()


_MOVE_GROUP: list = []


def move_group():
    """A process group of every rank for Async EPLB's weight moves, made once: its collectives run on a
    communicator (and, with NCCL, a stream) of their own, so a move overlaps the dispatches of the
    steps served meanwhile instead of queueing with them. Every rank reaches its first re-placement at
    the same step (same period), so they all create it together, as new_group requires."""
    if not _MOVE_GROUP:
        _MOVE_GROUP.append(dist.new_group(list(range(dist.get_world_size()))))
    return _MOVE_GROUP[0]


def holders_tensor(holders: list[list[int]]) -> torch.Tensor:
    """(E, C) rank table for ep_forward, -1 padded."""
    width = max(len(h) for h in holders)
    return torch.tensor([h + [-1] * (width - len(h)) for h in holders])

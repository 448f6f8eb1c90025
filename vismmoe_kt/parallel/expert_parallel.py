"""Expert-parallel MoE over torch.distributed: each rank holds a share of every layer's experts.

Per MoE layer, on every rank (data parallel over requests: each rank brings its own tokens):
    route (the model's router) -> count: pairs for each destination rank, exchanged so every rank
    knows what it will receive -> dispatch: token rows and expert ids, `all_to_all_single` with
    uneven splits -> compute: the local experts, grouped GEMM over the received pairs -> combine:
    results back with the reverse all-to-all, weighted and summed per token.
Shapes: T tokens here, K experts per token, P pairs (T*K), E experts, R ranks, H hidden.
The expert-to-rank map is contiguous (expert e on rank e * R // E) unless one is given.

With a `plan` callback (ReaLB on real ranks) each rank also contributes its per-expert loads and
image-token loads to one small all-reduce, issued before the dispatch and waited for after it, so
the metadata exchange hides behind the token exchange (`overlap_plan=False`, ReaLB-seq: waited for
before the dispatch, the paper's ablation without the pipeline); every rank then computes the same
precision plan from the same global numbers (vismmoe_kt.lb.policy, shared with the single-process
operator).
Each dispatched pair carries its modality (packed into the expert id: id + E for image tokens), so
the receiving rank can keep text rows of a switched expert in BF16.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import PeerLostError
from ..runtime.expert_compute import bank_experts, precision_split_rows


def guarded(fn: Callable) -> Callable:
    """Turn the transport's errors (a closed connection, a timeout) into one clear error."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            rank = dist.get_rank() if dist.is_initialized() else "?"
            raise PeerLostError(f"rank {rank}: the expert-parallel group lost a peer during an exchange "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); stopping") from exc
    run.__doc__ = fn.__doc__
    return run


def contiguous_map(num_experts: int, ranks: int) -> torch.Tensor:
    return torch.arange(num_experts, device="cpu") * ranks // num_experts


def ep_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               local_gate_up: torch.Tensor, local_down: torch.Tensor, local_experts: torch.Tensor,
               expert_rank: torch.Tensor, act: Any, group: Any = None, visual: torch.Tensor | None = None,
               plan: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
               lowprec_mlp: Callable | None = None, whole_expert: bool = False,
               holders: torch.Tensor | None = None, overlap_plan: bool = True,
               lowprec_experts: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor] | None = None,
               timer: Callable[[], Any] | None = None) -> torch.Tensor:
    """The layer's routed-expert output for this rank's tokens, experts spread over the group.

    visual (T,) bool: image tokens; plan(global_load[E], global_vision[E], global_tokens) -> switched
    (E,) bool; lowprec_mlp(x, gate_up, down, act) computes a switched expert's pairs. holders (E, C)
    lists the ranks with a copy of each expert (-1 pads; EPLB replication): pair p of expert e goes to
    copy p mod copies(e); without it, expert e lives on expert_rank[e] only. overlap_plan: the plan's
    all-reduce runs beside the dispatch (ReaLB); False waits for it first (ReaLB-seq).
    lowprec_experts(x, ends, act): every switched pair at once, x grouped by local expert (group e ending
    at ends[e]) (the fp8 backend's grouped GEMMs over its E4M3 copy, Fp8Experts.grouped_rows), the BF16
    and switched pairs split by one sort (runtime/expert_compute.precision_split_rows); else lowprec_mlp
    expert by expert. timer(): a context
    manager around this rank's own expert compute (parallel/compute_timer.py)."""
    ranks = dist.get_world_size(group)
    device = hidden.device
    tokens, k = top_k_index.shape
    num_experts = int(expert_rank.numel())
    expert = top_k_index.reshape(-1)
    visual = torch.zeros(tokens, dtype=torch.bool, device=device) if visual is None else visual.to(device)
    pair_visual = visual.repeat_interleave(k)
    pending = None
    if plan is not None:  # one small all-reduce, overlapped with the dispatch below
        metadata = torch.stack([torch.bincount(expert, minlength=num_experts),
                                torch.bincount(expert[pair_visual], minlength=num_experts)]).to(torch.float64)
        metadata = torch.cat([metadata.flatten(), torch.tensor([float(tokens)], dtype=torch.float64, device=device)])
        pending = (metadata, dist.all_reduce(metadata, group=group, async_op=True))
        if not overlap_plan:
            pending[1].wait()  # sequential: the metadata is in before a token row moves
    if holders is None:
        dest = expert_rank.to(device)[expert]
    else:  # spread an expert's pairs over its copies, deterministically
        table = holders.to(device)
        copies = (table >= 0).sum(dim=1)
        pick = torch.arange(expert.numel(), device=device) % copies[expert]
        dest = table[expert, pick]
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=ranks)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    token = order // k
    send_rows = hidden[token].contiguous()
    recv_rows = hidden.new_empty(sum(recv_split), hidden.shape[1])
    dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=group)
    codes = (expert + num_experts * pair_visual.long())[order].contiguous()
    recv_codes = codes.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_codes, codes, recv_split, send_split, group=group)
    recv_experts, recv_visual = recv_codes % num_experts, recv_codes >= num_experts
    switched = torch.zeros(num_experts, dtype=torch.bool, device=device)
    if pending is not None:
        metadata, work = pending
        work.wait()
        load, vision = metadata[:-1].view(2, num_experts)
        switched = plan(load.float().cpu(), vision.float().cpu(), int(metadata[-1])).to(device)
    with (timer or nullcontext)():  # this rank's own compute, for the straggler figures
        results = recv_rows
        if recv_rows.shape[0]:
            local_index = torch.full((num_experts,), -1, dtype=torch.long, device=device)
            local_index[local_experts.to(device)] = torch.arange(local_experts.numel(), device=device)
            rows = local_index[recv_experts][:, None]
            lowprec = switched[recv_experts] & (recv_visual | whole_expert)
            if lowprec_experts is not None:  # each received pair once: BF16 groups, then the switched ones
                results = precision_split_rows(recv_rows, None, rows[:, 0], lowprec, local_gate_up, local_down, act,
                                               lowprec_experts)
            else:  # BF16 by grouped GEMM (an expert's group holds exactly its BF16 pairs), switched expert by expert
                keep = torch.nonzero(~lowprec, as_tuple=True)[0]
                results = torch.empty_like(recv_rows)
                if keep.numel():
                    results[keep] = bank_experts(recv_rows[keep], rows[keep], recv_rows.new_ones(keep.numel(), 1),
                                                 torch.arange(local_experts.numel(), device=device), local_gate_up,
                                                 local_down, act)
                for e in torch.unique(recv_experts[lowprec]).tolist():
                    pick = torch.nonzero(lowprec & (recv_experts == e), as_tuple=True)[0]
                    i = int(local_index[e])
                    results[pick] = lowprec_mlp(recv_rows[pick], local_gate_up[i], local_down[i], act).to(results.dtype)
    back = hidden.new_empty(send_rows.shape)
    dist.all_to_all_single(back, results.contiguous(), send_split, recv_split, group=group)
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, back * weights[:, None])


ep_forward = guarded(ep_forward)


def ep_forward_static(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      local_gate_up: torch.Tensor, local_down: torch.Tensor, local_experts: torch.Tensor,
                      expert_rank: torch.Tensor, act: Any, capacity: int, group: Any = None,
                      timer: Callable[[], Any] | None = None) -> torch.Tensor:
    """`ep_forward` for decode, with no read on the host: every rank sends every other rank a fixed
    `capacity` x K rows (its at most `capacity` tokens' pairs bound there first, the rest padding), so
    the exchanges have fixed sizes known in advance, `all_to_all_single` with equal splits. BF16 only
    (no precision plan: its decisions are made on the host). The receiver computes its slots' pairs
    (padding ones through its first expert, weight 0, as grouped GEMM needs no branch), sends them
    back the same way, and each token sums its K results in order (deterministic).

    A pass of one rank meets the other ranks' passes of the same kind: every rank must call this for
    the pass (with zero tokens when it has none) when one does (Leader / Lockstep see to it)."""
    ranks = dist.get_world_size(group)
    device, (tokens, k) = hidden.device, top_k_index.shape
    if tokens > capacity:
        raise ValueError(f"a fixed-size exchange of {capacity} tokens a rank got {tokens}")
    num_experts, slots = int(expert_rank.numel()), capacity * k
    expert = top_k_index.reshape(-1)
    dest = expert_rank.to(device)[expert]                                    # (P,)
    # each pair's place among the pairs bound for its rank, in pair order: no sort, no host read
    same = dest[:, None] == dest[None, :]
    place = (same & torch.ones_like(same).tril(-1)).sum(dim=1)
    at = dest * slots + place                                               # row in the (R x slots) buffers
    send = hidden.new_zeros(ranks * slots, hidden.shape[1])
    send[at] = hidden[torch.arange(expert.numel(), device=device) // k]
    codes = torch.full((ranks * slots,), -1, dtype=torch.long, device=device)
    codes[at] = expert
    recv, recv_codes = torch.empty_like(send), torch.empty_like(codes)
    dist.all_to_all_single(recv, send, group=group)
    dist.all_to_all_single(recv_codes, codes, group=group)
    local_index = torch.zeros(num_experts, dtype=torch.long, device=device)  # padding reads local row 0
    local_index[local_experts.to(device)] = torch.arange(local_experts.numel(), device=device)
    valid = recv_codes >= 0
    rows = local_index[recv_codes.clamp(min=0)][:, None]
    with (timer or nullcontext)():
        results = bank_experts(recv, rows, valid[:, None].to(recv.dtype),
                               torch.arange(local_experts.numel(), device=device), local_gate_up, local_down, act)
    back = torch.empty_like(results)
    dist.all_to_all_single(back, results, group=group)
    mine = back[at].view(tokens, k, hidden.shape[1]) * top_k_weights.to(back.dtype)[..., None]
    return mine.sum(dim=1).to(hidden.dtype)


ep_forward_static = guarded(ep_forward_static)

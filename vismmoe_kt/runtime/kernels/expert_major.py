"""A batched decode step's resident experts, expert by expert, on tensor cores.

Shapes: T tokens (the step's rows), K experts per token, P = T x K pairs, E experts of the layer,
H hidden, I expert intermediate size, M = BLOCK_M pairs per block.

With B requests in a step, a layer's P pairs name fewer distinct experts than P when requests share
some, but rarely many fewer (8 requests under realistic routing: about 50 of 64). The table kernel
(bf16_gemv.py) reads an expert's weights once per pair; grouped GEMM reads them once per expert
but pads every group to its large tiles and sorts, gathers and scatters around two library calls.
Here each expert's pairs are gathered into blocks of M (usually one block: few tokens share an
expert), and one program per (block, output tile) reads that tile of the expert's weights once and
multiplies it with the block's M token rows by `tl.dot` (tensor cores, fp32 accumulation):

    gate_up:  h[p] = silu(W_gate[e] @ x[t_p]) * (W_up[e] @ x[t_p])   grid (blocks, I / BLOCK_N)
    down:     y[p] = W_down[e] @ h[p]                                  grid (blocks, H / BLOCK_N)

`expert_blocks` builds the blocks on the device with fixed shapes (at most P blocks: an expert with
c pairs takes ceil(c / M) <= c of them), so the step stays capturable in a CUDA graph; on the GPU one
Triton program does it (`_blocks_kernel`: each pair's rank among its expert's pairs and its expert's
first block, from P x P comparisons; for a prompt's thousands of pairs, a program per chunk of pairs counts
its experts' pairs (`_chunk_counts_kernel`) and another places them from those counts (`_chunk_place_kernel`),
the same plan), where the torch version takes some fifteen small
kernels a layer, each a launch gap in the step. No atomics:
each pair's output row is written by exactly one program per tile, and the caller combines the K rows
of each token in a fixed order, so results are deterministic. `expert_blocks` and the torch twin
`experts_by_block` run anywhere (the CPU tests); the kernels need Triton (or its interpreter). Their
tiles are tuned per device (tuning.py, key expert_major).
"""

from __future__ import annotations

from typing import Any

import torch
from kernel_launch import cdiv, launch, next_power_of_2

from . import tuning
from .triton_support import tl, triton

BLOCK_M = 16  # pairs per block: tl.dot's smallest M


def expert_blocks(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_expert (P,), block_pairs (P, block)) for P pairs' expert `ids` (P,): block b serves expert
    block_expert[b] (-1: unused) for the pairs block_pairs[b] (-1: an empty lane), each expert's pairs
    in pair order. Fixed shapes, device ops only (capturable)."""
    pairs = ids.numel()
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat))
    first_pair = torch.cumsum(counts, 0) - counts                 # each expert's first place in sorted order
    blocks = (counts + block - 1) // block
    first_block = torch.cumsum(blocks, 0) - blocks
    rank = torch.arange(pairs, device=ids.device) - first_pair[sorted_ids]   # place within its expert
    at = first_block[sorted_ids] + rank // block
    block_pairs = torch.full((pairs, block), -1, dtype=torch.long, device=ids.device)
    block_pairs[at, rank % block] = order
    block_expert = torch.full((pairs,), -1, dtype=torch.long, device=ids.device)
    block_expert[at] = sorted_ids
    return block_expert, block_pairs


# the plan kernel compares every pair with every other in one program of 4 warps: up to 64 pairs (a batched step of
# 8 tokens) without a spill; at 128 pairs ptxas spilled 4.9 KB a thread (2461 local loads and stores), at 256 7.9 KB
MAX_PLAN_PAIRS = 64
PLAN_CHUNKS = 32      # beyond that (a prompt's pairs), about this many programs, each a chunk of the pairs
PLAN_CHUNK_RANGE = (64, 256)  # the pairs of a chunk: a power of two in this range
PLAN_WARPS = 16


def plan_chunk(pairs: int) -> int:
    """The pairs of a chunk of the chunked plan: about PLAN_CHUNKS chunks (a program each, spread over the GPU), a
    power of two within PLAN_CHUNK_RANGE. Why not one size: a program's one-hot rows are (chunk, experts); at 256
    pairs and 4 warps the place kernel spilled 4 KB a thread (sm_90, ptxas: 7658 local loads and stores in 21896
    instructions), and a 236-token prompt's 1888 pairs made only 8 programs. At 64 pairs and 16 warps it is 1368
    instructions without a spill, and 30 programs. A long prompt's chunks grow instead of their count, which
    each program reads whole (CHUNKS x experts)."""
    low, high = PLAN_CHUNK_RANGE
    return min(max(next_power_of_2(cdiv(pairs, PLAN_CHUNKS)), low), high)


def block_plan(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_blocks` of (P,) ids on the device: up to MAX_PLAN_PAIRS pairs in one Triton program, every pair
    against every other; beyond, a program per chunk of pairs (`plan_chunk`) counts each expert's pairs in it, then
    a program per chunk places its pairs from every chunk's counts (a few launches where the torch version takes
    some fifteen, each a gap of the host in a prompt's layer). One program walking every chunk in turn had
    taken 113 us a layer of a 236-token prompt on the H100, a tenth of its experts' time."""
    pairs = ids.numel()
    # both -1 (unused) until placed, from one allocation: a fill launch fewer a layer of a host-paced prompt
    plan = torch.full((pairs * (block + 1),), -1, dtype=torch.long, device=ids.device)
    block_expert, block_pairs = plan[:pairs], plan[pairs:].view(pairs, block)
    if pairs > MAX_PLAN_PAIRS:
        chunk = plan_chunk(pairs)
        chunks, width = cdiv(pairs, chunk), next_power_of_2(num_experts)
        counts = torch.empty(chunks, width, dtype=torch.int32, device=ids.device)
        flat = ids.reshape(-1)
        launch(_chunk_counts_kernel, (chunks,), flat, counts, pairs, EP=width, CHUNK=chunk, num_warps=PLAN_WARPS)
        # the chunks' count rounded up to a power of two (the excess masked): a compile per power, not per length
        launch(_chunk_place_kernel, (chunks,), flat, counts, block_expert, block_pairs, pairs, chunks, E=num_experts,
               EP=width, CHUNK=chunk, CHUNKS=next_power_of_2(chunks), BLOCK_M=block, num_warps=PLAN_WARPS)
        return block_expert, block_pairs
    launch(_blocks_kernel, (1,), ids.reshape(-1), block_expert, block_pairs, P=pairs, PP=next_power_of_2(pairs),
           BLOCK_M=block, num_warps=4)
    return block_expert, block_pairs


def experts_by_block(hidden: torch.Tensor, top_k: int, block_expert: torch.Tensor, block_pairs: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, act: Any) -> torch.Tensor:
    """The kernels' torch twin: (P, H) fp32 unweighted pair outputs, block by block."""
    pairs, inter = block_pairs.shape[0], down.shape[2]
    y = torch.zeros(pairs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for b in torch.nonzero(block_expert >= 0, as_tuple=True)[0].tolist():
        lanes = block_pairs[b][block_pairs[b] >= 0]
        e = int(block_expert[b])
        x = hidden[lanes // top_k].float()
        gate, up = (x @ gate_up[e].float().T).split(inter, dim=-1)
        h = (act(gate) * up).to(hidden.dtype).float()  # the kernel stores h in the weights' dtype too
        y[lanes] = h @ down[e].float().T
    return y


def experts_expert_major(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, gate_up_tiles: tuple[int, int, int, int] | None = None,
                         down_tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(P, H) fp32 unweighted pair outputs of T tokens' K experts each, from a bank whose row e holds
    expert e (gate_up (E, 2I, H), down (E, H, I), contiguous), SiLU-gated, on tensor cores; the tiles
    as (BLOCK_N, BLOCK_K, warps, stages) per kernel (default: the device's tuned ones)."""
    num_experts, two_inter, hidden_size = gate_up.shape
    inter = two_inter // 2
    top_k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)
    pairs = ids.numel()
    block_expert, block_pairs = block_plan(ids, num_experts)
    x = hidden.to(gate_up.dtype).contiguous()
    h = torch.empty(pairs, inter, dtype=gate_up.dtype, device=hidden.device)
    y = torch.empty(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    tuned = tuning.get("expert_major", hidden.device)
    n, k, warps, stages = gate_up_tiles or tuned["gate_up"]
    _gate_up_blocks[(pairs, cdiv(inter, n))](
        x, block_expert, block_pairs, gate_up, h, TOP_K=top_k, H=hidden_size, I=inter, BLOCK_M=BLOCK_M,
        BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)
    n, k, warps, stages = down_tiles or tuned["down"]
    _down_blocks[(pairs, cdiv(hidden_size, n))](
        h, block_expert, block_pairs, down, y, H=hidden_size, I=inter, BLOCK_M=BLOCK_M, BLOCK_N=n, BLOCK_K=k,
        num_warps=warps, num_stages=stages)
    return y


if tl is not None:
    @triton.jit
    def _blocks_kernel(ids_ptr, expert_ptr, pairs_ptr, P: tl.constexpr, PP: tl.constexpr, BLOCK_M: tl.constexpr):
        """expert_blocks in one program: P x P comparisons of the pairs' experts give each pair its rank
        among its expert's pairs (those before it) and its expert's first block (the blocks of the
        experts with smaller ids)."""
        i = tl.arange(0, PP)
        valid = i < P
        e = tl.load(ids_ptr + i, mask=valid, other=-1)
        both = valid[:, None] & valid[None, :]                       # row: the pair, column: another
        same = (e[:, None] == e[None, :]) & both
        rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
        blocks = (tl.sum(same.to(tl.int32), axis=1) + BLOCK_M - 1) // BLOCK_M   # its expert's blocks
        first = valid & (rank == 0)                                  # one pair stands for each expert
        lower = (e[None, :] < e[:, None]) & first[None, :] & both
        block = tl.sum(tl.where(lower, blocks[None, :], 0), axis=1) + rank // BLOCK_M
        tl.store(pairs_ptr + block * BLOCK_M + rank % BLOCK_M, i.to(tl.int64), mask=valid)
        tl.store(expert_ptr + block, e, mask=valid)

    @triton.jit
    def _chunk_counts_kernel(ids_ptr, counts_ptr, P, EP: tl.constexpr, CHUNK: tl.constexpr):
        """block_plan's first pass: program c counts each expert's pairs among pairs c CHUNK .. (c + 1) CHUNK."""
        chunk = tl.program_id(0)
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        experts = tl.arange(0, EP)
        e = tl.load(ids_ptr + pair, mask=pair < P, other=-1)
        tl.store(counts_ptr + chunk * EP + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))

    @triton.jit
    def _chunk_place_kernel(ids_ptr, counts_ptr, expert_ptr, pairs_ptr, P, chunks, E: tl.constexpr,
                            EP: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr):
        """block_plan's second pass: program c places its chunk's pairs. From every chunk's counts, each expert's
        blocks and its first block (after those of the smaller ids); a pair's rank among its expert's pairs is
        the count in the chunks before plus its place in its own chunk (a running sum down the chunk's one-hot
        rows)."""
        chunk = tl.program_id(0)
        experts = tl.arange(0, EP)
        index = tl.arange(0, CHUNKS)
        every = tl.load(counts_ptr + index[:, None] * EP + experts[None, :], mask=(index < chunks)[:, None], other=0)
        counts = tl.sum(every, axis=0)
        seen = tl.sum(tl.where((index < chunk)[:, None], every, 0), axis=0)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        first_block = tl.cumsum(blocks, axis=0) - blocks
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = pair < P
        e = tl.load(ids_ptr + pair, mask=valid, other=-1)
        onehot = ((e[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)  # (CHUNK, EP)
        within = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1   # earlier pairs of its expert here
        rank = tl.sum(onehot * seen[None, :], axis=1) + within
        block = tl.sum(onehot * first_block[None, :], axis=1) + rank // BLOCK_M
        tl.store(pairs_ptr + block.to(tl.int64) * BLOCK_M + rank % BLOCK_M, pair.to(tl.int64), mask=valid)
        tl.store(expert_ptr + block, e.to(tl.int64), mask=valid)

    @triton.jit
    def _block(expert_ptr, pairs_ptr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's expert (-1: an unused block), its lanes' pairs, which lanes hold one, and its
        output columns."""
        block = tl.program_id(0)
        pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return tl.load(expert_ptr + block), pair, pair >= 0, cols, cols < N

    @triton.jit
    def _rows_times_weights(x_ptr, rows, ok, w_ptr, cols, col_ok, K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """(BLOCK_M, BLOCK_N) fp32: x[rows] (each of K elements) times the weight rows `cols` of a
        row-major (N, K) matrix, on tensor cores."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc = tl.dot(x, w, acc)
        return acc

    @triton.jit
    def _gate_up_blocks(x_ptr, expert_ptr, pairs_ptr, w_ptr, h_ptr, TOP_K: tl.constexpr, H: tl.constexpr,
                        I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, I, BLOCK_M, BLOCK_N)
        if expert >= 0:
            token = tl.where(ok, pair // TOP_K, 0).to(tl.int64)
            gate_w = w_ptr + expert.to(tl.int64) * (2 * I * H)  # (2I, H): gate rows, then up rows
            gate = _rows_times_weights(x_ptr, token, ok, gate_w, cols, col_ok, H, BLOCK_M, BLOCK_N, BLOCK_K)
            up = _rows_times_weights(x_ptr, token, ok, gate_w + I * H, cols, col_ok, H, BLOCK_M, BLOCK_N, BLOCK_K)
            h = gate * tl.sigmoid(gate) * up
            tl.store(h_ptr + pair[:, None].to(tl.int64) * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_blocks(h_ptr, expert_ptr, pairs_ptr, w_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        expert, pair, ok, cols, col_ok = _block(expert_ptr, pairs_ptr, H, BLOCK_M, BLOCK_N)
        if expert >= 0:
            row = tl.where(ok, pair, 0).to(tl.int64)
            down_w = w_ptr + expert.to(tl.int64) * (H * I)  # (H, I)
            acc = _rows_times_weights(h_ptr, row, ok, down_w, cols, col_ok, I, BLOCK_M, BLOCK_N, BLOCK_K)
            tl.store(y_ptr + row[:, None] * H + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])


def available(dtype: torch.dtype) -> bool:
    """Whether the kernels run for weights of `dtype`: tensor-core dtypes with Triton present."""
    return tl is not None and dtype in (torch.bfloat16, torch.float16)

"""The lookahead prefetch inside the decode graph (DecodeTable.prefetch): the candidates claim
landing slots (table_ops), a few programs copy their blocks from the mapped host store into the
slabs (zero-copy reads over PCIe, on a side stream), and the table is pointed at them (table_ops).
The copy's program count is tuned per device (tuning.py, key prefetch_programs).
"""

from __future__ import annotations

import torch
from kernel_launch import cdiv, next_power_of_2

from . import triton_support, tuning
from .triton_support import TL_DTYPES, tl, triton

# elements each copy program moves per iteration (16 KiB of BF16: enough bytes in flight to keep PCIe busy)
PREFETCH_CHUNK = 8192

if tl is not None:
    from .table_ops import _prefetch_claim_kernel, _prefetch_publish_kernel

    @triton.jit
    def _prefetch_copy_kernel(rows_ptr, ids_ptr, slab_ptr, host_ptr, gate_up_addr, down_addr, B, block_elems,
                              ROUNDS: tl.constexpr, W_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, GATE_UP: tl.constexpr,
                              CHUNK: tl.constexpr, PROGRAMS: tl.constexpr):
        """Copy each claimed candidate's host block into its slab: a few programs, each looping over
        CHUNK-element pieces, so the copy leaves most of the GPU to the layers computing meanwhile."""
        chunks = (block_elems + CHUNK - 1) // CHUNK
        offsets = tl.arange(0, CHUNK)
        for round in range(ROUNDS):  # constant per model and candidate count
            work = tl.program_id(0) + round * PROGRAMS
            pair = tl.minimum(work // chunks, B - 1)
            slab = tl.load(slab_ptr + pair).to(tl.int64)
            if (slab >= 0) & (work < B * chunks):
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                row = tl.load(rows_ptr + pair).to(tl.int64)
                start = (work % chunks) * CHUNK  # chunks never straddle gate_up | down: CHUNK divides both
                src = (tl.load(host_ptr + row) + (expert * block_elems + start) * ELEM_BYTES).to(
                    tl.pointer_type(W_DTYPE), bitcast=True)
                dst = tl.where(start < GATE_UP, gate_up_addr + (slab * GATE_UP + start) * ELEM_BYTES,
                               down_addr + (slab * (block_elems - GATE_UP) + start - GATE_UP) * ELEM_BYTES)
                dst = dst.to(tl.pointer_type(W_DTYPE), bitcast=True)
                inside = start + offsets < block_elems
                tl.store(dst + offsets, tl.load(src + offsets, mask=inside), mask=inside)


def available(dtype: torch.dtype) -> bool:
    """Whether the prefetch copies weights of `dtype` (Triton present)."""
    return triton_support.available(dtype)


def copy_chunk(gate_up_elems: int, down_elems: int, largest: int = PREFETCH_CHUNK) -> int:
    """The largest power of two up to `largest` that divides both parts of a block (a chunk never
    straddles the two pools)."""
    chunk = 1
    while chunk * 2 <= largest and gate_up_elems % (chunk * 2) == 0 and down_elems % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def prefetch(table, rows: torch.Tensor, ids: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
             host_addresses: torch.Tensor, programs: int | None = None) -> torch.Tensor:
    """DecodeTable.prefetch in three launches: claim, copy (zero-copy reads of the mapped host store
    by `programs` programs, default: the device's tuned count), publish. Returns each candidate's slab
    (-1: not copied)."""
    programs = programs or tuning.get("prefetch_programs", ids.device)
    b = ids.numel()
    gate_up, down = pools
    slab = torch.empty(b, dtype=torch.long, device=ids.device)
    bp = next_power_of_2(max(b, 2))
    experts = table.num_experts
    _prefetch_claim_kernel[(1,)](rows, ids, table.slots, table.landing, table.count, table.used, table.owner, slab, b,
                                 E=experts, R=table.landing_slots, BP=bp)
    gate_up_elems, down_elems = gate_up[0].numel(), down[0].numel()
    chunk = copy_chunk(gate_up_elems, down_elems)
    rounds = cdiv(b * cdiv(gate_up_elems + down_elems, chunk), programs)
    _prefetch_copy_kernel[(programs,)](
        rows, ids, slab, host_addresses, gate_up.data_ptr(), down.data_ptr(), b, gate_up_elems + down_elems, ROUNDS=rounds,
        W_DTYPE=TL_DTYPES[gate_up.dtype], ELEM_BYTES=gate_up.element_size(), GATE_UP=gate_up_elems,
        CHUNK=chunk, PROGRAMS=programs, num_warps=4)
    _prefetch_publish_kernel[(1,)](rows, ids, slab, table.slots, b, E=experts, BP=bp)
    return slab

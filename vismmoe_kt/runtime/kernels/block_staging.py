"""Quantized blocks copied as they are, from the mapped host store into device rows in whole 4-byte
words (`_stage_kernel` says why): a staging area for the dequantizing fetch (dequantize.py), or
quantized slabs that the quantized GEMVs read in place."""

from __future__ import annotations

import torch
from kernel_launch import cdiv, next_power_of_2

from . import triton_support
from .triton_support import tl, triton

# 4-byte words per program of a staging copy: 16 KiB in flight each
STAGE_CHUNK = 4096

if tl is not None:
    @triton.jit
    def _stage_kernel(ids_ptr, need_ptr, target_ptr, staging_ptr, host_addr, block_words, row_words,
                      CHUNK: tl.constexpr):
        """The needed pairs' whole blocks (as 4-byte words) from the mapped host store into device rows
        (`target`: each pair's row of `staging`, rows `row_words` apart): contiguous, wide reads, so
        PCIe moves the blocks' bytes once and at speed (a dequantizing read of 34-byte blocks in place
        would issue many small, strided reads). The rows are a staging area, or quantized slabs."""
        pair = tl.program_id(0)
        start = tl.program_id(1) * CHUNK
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        row = tl.load(target_ptr + pair).to(tl.int64)
        offsets = start + tl.arange(0, CHUNK)
        inside = (offsets < block_words) & need
        src = (host_addr + expert * block_words * 4).to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(staging_ptr + row * row_words + offsets, tl.load(src + offsets, mask=inside), mask=inside)


if tl is not None:
    @triton.jit
    def _staging_plan_kernel(slots_ptr, land_ptr, need_ptr, target_ptr, read_ptr, scratch, pairs,
                             BLOCK: tl.constexpr):
        p = tl.arange(0, BLOCK)
        ok = p < pairs
        slot = tl.load(slots_ptr + p, mask=ok, other=0)
        land = tl.load(land_ptr + p, mask=ok, other=0)
        need = slot < 0
        target = tl.where(land >= 0, land, scratch + p)
        tl.store(need_ptr + p, need.to(tl.int8), mask=ok)
        tl.store(target_ptr + p, target, mask=ok)
        tl.store(read_ptr + p, tl.where(need, target, slot), mask=ok)


def staging_plan(slots: torch.Tensor, land: torch.Tensor, scratch: int,
                 use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(need, target, read) of a layer's P pairs on quantized slabs: whether a pair's block must be
    staged (its slot < 0: not resident), the row it is staged into (its landing slab, else the pair's
    scratch row `scratch + pair`), and the row the GEMVs then read. One launch on the GPU, where the
    torch ops were six a layer (compares, wheres, an arange, a cast); `need` is int8 there, bool in
    the torch twin."""
    if use_kernel and slots.numel() <= 4096:
        pairs = slots.numel()
        need = torch.empty(pairs, dtype=torch.int8, device=slots.device)
        target, read = torch.empty_like(slots), torch.empty_like(slots)
        _staging_plan_kernel[(1,)](slots, land, need, target, read, scratch, pairs,
                                   BLOCK=next_power_of_2(pairs), num_warps=1)
        return need, target, read
    need = slots < 0
    target = torch.where(land >= 0, land, scratch + torch.arange(slots.numel(), device=slots.device))
    return need, target, torch.where(need, target, slots)


def available() -> bool:
    """Whether the staging copy runs (Triton present)."""
    return triton_support.available()


def stage_blocks(ids: torch.Tensor, need: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, host_address: int,
                 block_bytes: int) -> None:
    """The needed pairs' blocks (`block_bytes` each, at `host_address` + expert * block_bytes in mapped
    host memory) copied as they are into rows `target` of `rows` (uint8, (N, row bytes)): quantized
    slabs, which the quantized GEMVs read in place."""
    if block_bytes % 4 or rows.shape[1] % 4:
        raise ValueError(f"blocks of {block_bytes} bytes into rows of {rows.shape[1]}: not whole 4-byte words")
    words = block_bytes // 4
    _stage_kernel[(ids.numel(), cdiv(words, STAGE_CHUNK))](
        ids, need.to(torch.int8), target, rows.view(torch.int32), host_address, words, rows.shape[1] // 4,
        CHUNK=STAGE_CHUNK)

"""Quantized blocks copied as they are, from the mapped host store into device rows in whole 4-byte
words (`_stage_kernel` says why): a staging area for the dequantizing fetch (dequantize.py), or
quantized slabs that the quantized GEMVs read in place."""

from __future__ import annotations

import torch

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
    _stage_kernel[(ids.numel(), triton.cdiv(words, STAGE_CHUNK))](
        ids, need.to(torch.int8), target, rows.view(torch.int32), host_address, words, rows.shape[1] // 4,
        CHUNK=STAGE_CHUNK)

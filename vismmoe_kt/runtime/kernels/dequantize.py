"""A quantized store's blocks dequantized on the device into BF16 (or fp16, fp32) slabs or a bank:
the decode misses of dequantized slabs (table_experts.fetch_dequantized), a prefill's fetches, and
a layer-wise prefill's bank. First the needed blocks' bytes over PCIe into device staging rows
(block_staging.py), then one launch per part (gate_up, down) decodes them into their targets.

Program (pair, tile of rows, blocks of columns), one step each and no loop along the row: a miss is
on the critical path, and many short programs finish sooner than a few that walk a row's blocks one
after another.
"""

from __future__ import annotations

import torch
from kernel_launch import cdiv

from . import triton_support
from .triton_support import tl, triton

if tl is not None:
    from .block_decode import _kquant_weights, _q6k_weights
    from .block_staging import STAGE_CHUNK, _stage_kernel

    @triton.jit
    def _fetch_q8_kernel(ids_ptr, need_ptr, target_ptr, pool_ptr, host_addr, block_bytes, part_bytes, slab_elems,
                         part_elems, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         QBLOCKS: tl.constexpr, Q4: tl.constexpr = False):
        """One part (gate_up or down) of the needed pairs' Q8_0 blocks, read at `host_addr` (the staging
        rows: `ids` index them) and written dequantized into their slabs: program (pair, tile of rows,
        QBLOCKS blocks of columns). One step per program, no loop: a miss is on the critical path, and
        many short programs finish sooner than a few that walk a row's blocks one after another."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        target = tl.load(target_ptr + pair).to(tl.int64)
        QB_BYTES: tl.constexpr = 18 if Q4 else 34  # Q4_0: scale + 16 bytes of two nibbles; Q8_0: scale + 32 int8
        row_bytes: tl.constexpr = COLS // 32 * QB_BYTES
        base = host_addr + expert * block_bytes + part_bytes
        lane = tl.arange(0, 32)
        row_ok = (rows < ROWS) & need
        qb = tl.program_id(2) * QBLOCKS + tl.arange(0, QBLOCKS)
        ok = row_ok[:, None] & (qb < COLS // 32)[None, :]                          # (R, Q)
        at = rows[:, None].to(tl.int64) * row_bytes + qb[None, :].to(tl.int64) * QB_BYTES  # each block's first byte
        scale = tl.load((base + at).to(tl.pointer_type(tl.float16), bitcast=True), mask=ok, other=0.0)
        if Q4:  # weight j: the low nibble of byte j (j < 16), else the high nibble of byte j - 16
            packed = tl.load((base + at[:, :, None] + 2 + (lane % 16)[None, None, :]).to(
                tl.pointer_type(tl.uint8), bitcast=True), mask=ok[:, :, None], other=0)
            nibble = (packed.to(tl.int32) >> (4 * (lane // 16))[None, None, :]) & 0xF
            weights = (nibble - 8).to(tl.float32) * scale.to(tl.float32)[:, :, None]
        else:
            values = tl.load((base + at[:, :, None] + 2 + lane[None, None, :]).to(
                tl.pointer_type(tl.int8), bitcast=True), mask=ok[:, :, None], other=0)
            weights = values.to(tl.float32) * scale.to(tl.float32)[:, :, None]
        cols = qb[None, :, None].to(tl.int64) * 32 + lane[None, None, :]
        out = pool_ptr + target * slab_elems + part_elems + rows[:, None, None].to(tl.int64) * COLS + cols
        tl.store(out, weights.to(pool_ptr.dtype.element_ty), mask=ok[:, :, None])

    @triton.jit
    def _fetch_kquant_kernel(ids_ptr, need_ptr, target_ptr, pool_ptr, host_addr, block_bytes, part_bytes, slab_elems,
                             part_elems, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                             KIND: tl.constexpr = 4):
        """`_fetch_q8_kernel` for the k-quants' 256-weight super-blocks, KIND 4 (Q4_K, 144 bytes), 5 (Q5_K,
        176) or 6 (Q6_K, 210): program (pair, tile of rows, super-block column), its 256 weights decoded
        at once."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        need = tl.load(need_ptr + pair) != 0
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        target = tl.load(target_ptr + pair).to(tl.int64)
        SB_BYTES: tl.constexpr = 210 if KIND == 6 else (176 if KIND == 5 else 144)
        row_bytes: tl.constexpr = COLS // 256 * SB_BYTES
        base = host_addr + expert * block_bytes + part_bytes
        w = tl.arange(0, 256)
        row_ok = (rows < ROWS) & need
        out_rows = pool_ptr + target * slab_elems + part_elems + rows[:, None].to(tl.int64) * COLS
        sb = tl.program_id(2)
        at = base + rows[:, None].to(tl.int64) * row_bytes + sb * SB_BYTES   # (R, 1): the super-block's first byte
        ok = row_ok[:, None]
        at8 = at.to(tl.pointer_type(tl.uint8), bitcast=True)
        if KIND == 6:
            weights = _q6k_weights(at, at8, w, ok)
        else:
            weights = _kquant_weights(at, at8, w, ok, KIND == 5)
        tl.store(out_rows + sb * 256 + w[None, :], weights.to(pool_ptr.dtype.element_ty), mask=ok)


def available(dtype: torch.dtype) -> bool:
    """Whether the dequantizing fetch runs into slabs of `dtype` (Triton present)."""
    return triton_support.available(dtype)


def fetch_q8(ids: torch.Tensor, need: torch.Tensor, target: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor],
             host_address: int, block_bytes: int, inter: int, hidden: int, block_rows: int = 16,
             qblocks: int = 8, fmt: str = "q8_0", down_fmt: str | None = None, staged: bool = False) -> None:
    """TableExperts.fetch_dequantized in three launches: the needed pairs' blocks (Q8_0, Q4_0 or Q4_K:
    `fmt`) copied from the mapped host store to device staging, then dequantized into their target slabs
    (gate_up, down); `down_fmt`: the down part's own format where it differs (Q6_K in a Q4_K_M file).
    `staged`: the blocks are on the device already (quantized slabs: `ids` are rows of `host_address`,
    `block_bytes` apart), and are only dequantized."""
    from ..store import PART_CODECS

    down_fmt = down_fmt or fmt
    p = ids.numel()
    gate_up, down = pools
    need = need.to(torch.int8)
    if block_bytes % 4:
        raise ValueError(f"a {fmt} block of {block_bytes} bytes is not whole 4-byte words")
    # first the blocks' bytes over PCIe into device memory, then dequantized from there
    if staged:
        rows_of_staging, staging_address = ids, host_address
    else:
        words = block_bytes // 4
        staging = torch.empty(p, words, dtype=torch.int32, device=ids.device)
        rows_of_staging = torch.arange(p, device=ids.device)  # pair i's block is staging row i
        _stage_kernel[(p, cdiv(words, STAGE_CHUNK))](ids, need, rows_of_staging, staging, host_address, words,
                                                            words, CHUNK=STAGE_CHUNK)
        staging_address = staging.data_ptr()
    for pool, rows, cols, part_bytes, part_fmt in (
            (gate_up, 2 * inter, hidden, 0, fmt),
            (down, hidden, inter, 2 * inter * PART_CODECS[fmt].row_bytes(hidden), down_fmt)):
        args = (rows_of_staging, need, target, pool, staging_address, block_bytes, part_bytes, pool[0].numel(), 0)
        if part_fmt in ("q4_k", "q5_k", "q6_k"):  # 256-weight super-blocks
            _fetch_kquant_kernel[(p, cdiv(rows, block_rows), cols // 256)](
                *args, ROWS=rows, COLS=cols, BLOCK_ROWS=block_rows, KIND=int(part_fmt[1]))
        else:
            _fetch_q8_kernel[(p, cdiv(rows, block_rows), cdiv(cols // 32, qblocks))](
                *args, ROWS=rows, COLS=cols, BLOCK_ROWS=block_rows, QBLOCKS=qblocks, Q4=part_fmt == "q4_0")
